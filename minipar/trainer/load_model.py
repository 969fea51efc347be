"""A trained model back in memory, for generation and evaluation: a minipar checkpoint of any layout
(sharded or full, a LoRA run's adapters on their base) or a Hugging Face directory, loaded on this
grid, with its tokenizer.

    source(path)           "checkpoint" (a manifest.json: save_load.py wrote it) or "hf" (config.json)
    load_model(path, pgm)  -> (LlamaForCausalLM on pgm: this rank's tp slice, its tokenizer)
    checkpoint_config(path) -> (LlamaConfig, the run's saved config dict)
    load_composed(path, pgm) -> (compose.ParallelModel, compose.Step, tokenizer): on ANY layout
                           (api.prepare's composition), for scoring (minipar/post/scoring.py)

A checkpoint is resharded on load to pgm's layout (checkpoint/layout.py), so a run trained on
dp_shard 2 x tp 2 x pp 2 generates on one process or on tp 2. A LoRA checkpoint holds the adapters
only: the base comes back from the run's base_model (or its seed), the adapters are added with the
run's r and alpha and loaded. The tokenizer: the HF directory's own (tokenizer.json beside
config.json), the run's tokenizer_config or base_model for a checkpoint, else the byte tokenizer.

Communication: the checkpoint's every-rank agreement (save_load.load_checkpoint), nothing else;
an HF directory is read slice by slice (models/hf_checkpoint.py).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

from minipar.api import prepare
from minipar.lora import add_lora, check_targets, lora_targets
from minipar.trainer.checkpoint import files as ck_files
from minipar.trainer.checkpoint import save_load as ckpt
from minipar.trainer.checkpoint.verify import read_manifest
from minipar.trainer.data.special_tokens import changes_tokenizer, run_tokenizer
from minipar.trainer.data.tokenizer import load_tokenizer
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig


def source(path: str) -> str:
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return "checkpoint"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise ValueError(f"{path}: neither a minipar checkpoint (manifest.json) nor a Hugging Face directory "
                     f"(config.json); give a step-N directory of a run's output_dir or an HF model directory")


def checkpoint_config(path: str) -> Tuple[LlamaConfig, dict]:
    """The model config in a checkpoint's manifest and the run's saved config (train.py's)."""
    manifest = read_manifest(path)
    if not manifest.get("model_config"):
        raise ValueError(f"{path}: the manifest has no model_config, cannot rebuild the model")
    state = ck_files.load(os.path.join(path, ckpt.TRAINER_STATE))
    run = (state.get("extra") or {}).get("config") or {}
    return LlamaConfig.from_dict(manifest["model_config"]), run


def _has_tokenizer(directory: Optional[str]) -> bool:
    return bool(directory) and any(os.path.isfile(os.path.join(directory, f))
                                   for f in ("tokenizer.json", "tokenizer_config.json"))


def load_model(path: str, pgm=None, tokenizer: Optional[str] = None):
    """(model, tokenizer): the model on pgm (None: one process), in eval mode. `tokenizer`: a
    directory that overrides the one found beside the weights."""
    if source(path) == "hf":
        model = LlamaForCausalLM.from_pretrained(path, pgm)
        tok = tokenizer or (path if _has_tokenizer(path) else None)
        return model.eval(), load_tokenizer(tok)
    config, run = checkpoint_config(path)
    if run.get("adapter") == "lora":        # the adapters on their base (no second copy)
        base = run.get("base_model")
        model = LlamaForCausalLM.from_pretrained(base, pgm, vocab_size=config.vocab_size,
                                                 mean_resizing=bool(run.get("mean_resizing_embeddings")),
                                                 seed=run.get("seed", 0)) if base else \
            LlamaForCausalLM(config, pgm, seed=run.get("seed", 0))
        targets = check_targets(run.get("lora_target_modules"), run.get("lora_target_linear"),
                                lora_targets(model))
        add_lora(model, targets, run["lora_r"], run["lora_alpha"])
    else:
        model = LlamaForCausalLM(config, pgm)
    ckpt.load_checkpoint(path, model, None, model.pgm)      # resharded to this layout
    return model.eval(), _run_tokenizer(run, tokenizer)


def _run_tokenizer(run: dict, tokenizer: Optional[str]):
    """`tokenizer`'s, else the one the run trained with: its tokenizer_config or base_model, with
    the tokens and chat template it added (data/special_tokens.py), else the byte tokenizer."""
    if not tokenizer and changes_tokenizer(run):
        return run_tokenizer(run)
    tok = tokenizer or run.get("tokenizer_config") or run.get("base_model")
    return load_tokenizer(tok if _has_tokenizer(tok) else None)


def load_composed(path: str, pgm, tokenizer: Optional[str] = None, dtype: str = "float32"):
    """(ParallelModel, compose.Step, tokenizer) on any layout: api.prepare's composition (ZeRO-3, tp,
    cp, pp, ep as pgm asks), the weights from the HF directory or the checkpoint (resharded)."""
    if source(path) == "hf":
        pm, _, step = prepare(path, pgm, dtype=dtype)
        tok = tokenizer or (path if _has_tokenizer(path) else None)
        return pm, step.step, load_tokenizer(tok)
    config, run = checkpoint_config(path)
    if run.get("adapter") == "lora":
        raise ValueError(f"{path} is a LoRA checkpoint (adapters only): export it merged first, "
                         f"python -m minipar.trainer.checkpoint.export {path} HF_DIR, and score HF_DIR")
    pm, _, step = prepare(config, pgm, dtype=dtype)
    ckpt.load_checkpoint(path, pm.model, None, pgm)
    return pm, step.step, _run_tokenizer(run, tokenizer)
