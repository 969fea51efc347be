r"""Export a minipar checkpoint (sharded or full, from any layout) as a Hugging Face directory.

    python -m minipar.trainer.checkpoint.export out/default/step-300 out/default/hf-step-300
    python -m minipar.trainer.checkpoint.export out/finetune/step-100 out/finetune/hf-100 \
        --tokenizer out/example/model

Runs on one process: the checkpoint's manifest holds the model config, every shard file is read,
the full tensors are rebuilt by HF name (save_load.py does the resharding), and
`models/hf_checkpoint.py:save_pretrained` writes config.json + model.safetensors (or shards of
--max-shard-bytes, 5 GB by default, with their index: models/hf_shards.py), which
`transformers.LlamaForCausalLM.from_pretrained` loads. Training runs export at the end by
themselves (`export_hf: true`); this is the same, on request, for any saved step.

A LoRA checkpoint (`adapter: lora`) holds the adapters only: the base is rebuilt from the run's
base_model (or its seed), the adapters loaded, and the MERGED model written, W0 + (alpha / r) B A,
which transformers loads alone (what `merge_lora: true` writes at the end of a run).

The tokenizer beside it: --tokenizer DIR copies that directory's tokenizer files; without it, the
run's own (the checkpoint's saved config: tokenizer_config, else base_model, with the special
tokens, tokens and chat template the run added: trainer/data/special_tokens.py), and for a byte-level
run (neither set) the byte tokenizer that `AutoTokenizer.from_pretrained(hf_dir)` loads
(tokenizer.py: save_byte_tokenizer).
"""
from __future__ import annotations

import argparse
import os

from minipar.lora import add_lora, check_targets, lora_targets, merge
from minipar.trainer.checkpoint import files as ck_files
from minipar.trainer.checkpoint import save_load as ckpt
from minipar.trainer.checkpoint.verify import read_manifest
from minipar.trainer.data.special_tokens import changes_tokenizer, run_tokenizer
from minipar.trainer.data.tokenizer import save_byte_tokenizer
from models.hf_checkpoint import save_pretrained
from models.hf_shards import MAX_SHARD_BYTES
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig


def _lora_base(run: dict, config: LlamaConfig):
    """The frozen base a LoRA checkpoint was trained on (it holds the adapters only): base_model's
    weights, or the run's seeded initialisation; with the run's adapters added, still at their init."""
    if run.get("base_model"):                  # its vocabulary resized as the run's (tokens it added)
        model = LlamaForCausalLM.from_pretrained(run["base_model"], vocab_size=config.vocab_size,
                                                 mean_resizing=bool(run.get("mean_resizing_embeddings")),
                                                 seed=run.get("seed", 0))
    else:
        model = LlamaForCausalLM(config, seed=run["seed"])
    targets = check_targets(run.get("lora_target_modules"), run.get("lora_target_linear"),
                            lora_targets(model))
    add_lora(model, targets, run["lora_r"], run["lora_alpha"])
    return model


def export_checkpoint(checkpoint_dir: str, hf_dir: str, tokenizer: str = None,
                      max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    manifest = read_manifest(checkpoint_dir)     # refuses a partial or foreign directory, naming it
    config = manifest.get("model_config")
    if not config:
        raise ValueError(f"{checkpoint_dir}: the manifest has no model_config, cannot rebuild the model")
    state = ck_files.load(os.path.join(checkpoint_dir, ckpt.TRAINER_STATE))
    run = (state.get("extra") or {}).get("config") or {}     # the run's config, as train.py saved it
    lora = run.get("adapter") == "lora"
    config = LlamaConfig.from_dict(config)
    model = _lora_base(run, config) if lora else LlamaForCausalLM(config)
    extra = ckpt.load_checkpoint(checkpoint_dir, model, None, model.pgm)   # verifies sizes and checksums
    if lora:                                     # merged: W0 + (alpha / r) B A, a plain model
        full = model.full_state_dict()
        adapters = {n: t for n, t in full.items() if ".lora." in n}
        base = {n: t for n, t in full.items() if ".lora." not in n}
        merged = merge(base, adapters, run["lora_alpha"] / run["lora_r"])
        save_pretrained(model, hf_dir, merged, max_shard_bytes)
    else:
        save_pretrained(model, hf_dir, max_shard_bytes=max_shard_bytes)
    saved = (extra or {}).get("config") or {}   # the run's config, as train.py saved it
    if not tokenizer and changes_tokenizer(saved):   # the tokens and chat template the run added
        run_tokenizer(saved).save_pretrained(hf_dir)
        return hf_dir
    tokenizer = tokenizer or saved.get("tokenizer_config") or saved.get("base_model")
    if tokenizer:                                # e.g. the base_model the run fine-tuned
        ckpt.copy_tokenizer(tokenizer, hf_dir)
    elif saved:                                  # a byte-level run: its 256-id tokenizer
        save_byte_tokenizer(hf_dir)
    return hf_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description="Export a minipar checkpoint as a Hugging Face directory.")
    parser.add_argument("checkpoint", help="a step-N checkpoint directory")
    parser.add_argument("hf_dir", help="where to write config.json and model.safetensors")
    parser.add_argument("--tokenizer",
                        help="a directory whose tokenizer files to copy beside (default: the run's "
                        "tokenizer_config or base_model; a byte-level run gets its byte tokenizer)")
    parser.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES,
                        help="the most bytes of tensors in one safetensors file: more are written as shards "
                        "with model.safetensors.index.json (default: the Hub's 5 GB)")
    args = parser.parse_args(argv)
    if args.max_shard_bytes < 1:
        parser.error(f"--max-shard-bytes must be at least 1, got {args.max_shard_bytes}")
    out = export_checkpoint(args.checkpoint, args.hf_dir, args.tokenizer, args.max_shard_bytes)
    print(f"exported {args.checkpoint} to {out}")


if __name__ == "__main__":
    main()
