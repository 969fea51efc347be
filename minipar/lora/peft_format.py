"""LoRA adapters as people exchange them: PEFT's adapter directory, and the merged plain model.

An Axolotl LoRA run leaves what PEFT's `save_pretrained` writes, and `lora_model_dir` reads it back:

    adapter_config.json          {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules":
                                  [...], "base_model_name_or_path": ..., "task_type": "CAUSAL_LM"}
    adapter_model.safetensors    one FULL tensor per piece, fp32, under PEFT's names:
        minipar  model.layers.0.self_attn.q_proj.lora.lora_A                 (r, in)
        PEFT     base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight

(the adapter name `default` is left out of the file, as PEFT saves it). A run that resized the
vocabulary (tokens added: trainer/data/special_tokens.py) also stores the resized base tensors,
`base_model.model.model.embed_tokens.weight` (and an untied `base_model.model.lm_head.weight`), as
PEFT's save_embedding_layers does: PEFT loads them once the base is resized to the saved tokenizer
(AutoPeftModelForCausalLM does that itself). Reading an adapter back skips them: a run rebuilds
them from its base and its own tokens. No rank holds a full piece
under tp: full_adapters() gathers the split ones over tp (column B along dim 0, row A along dim 1,
adapter.py) and the stages' over pp: a one-off all-gather of the adapters' size. Reading back is
local: every rank reads the file and keeps its slices (load_adapters), after check_adapter has
compared every name and shape with the model, so a wrong adapter is refused before any collective.

Merging (`merge_lora`, or the export command on a checkpoint) folds the update into the base once:
W = W0 + (alpha / r) B A, a plain Hugging Face model that transformers loads alone, and as fast as
the base (PEFT's merge_and_unload does the same).
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, List, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..pipeline_parallel.stage import gather_over_stages
from ..tensor_parallel.layers import gather_tensor, shard_tensor

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
OURS = ".lora.lora_"                      # minipar's names: <linear>.lora.lora_A / lora_B


def peft_key(name: str) -> str:
    """minipar's adapter name -> PEFT's key in adapter_model.safetensors."""
    module, piece = name.split(OURS)
    return f"{PEFT_PREFIX}{module}.lora_{piece}.weight"


def is_base_key(key: str) -> bool:
    """A base weight stored beside the adapters (a resized embedding or lm_head), not an adapter."""
    return key.startswith(PEFT_PREFIX) and ".lora_" not in key


def minipar_name(key: str) -> str:
    """PEFT's key -> minipar's adapter name (inverse of peft_key); ValueError if it is no LoRA piece."""
    body = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else None
    for piece in ("A", "B"):
        tail = f".lora_{piece}.weight"
        if body is not None and body.endswith(tail):
            return f"{body[:-len(tail)]}{OURS}{piece}"
    raise ValueError(f"{key!r} is not a LoRA weight under PEFT's names "
                     f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")


def adapter_shapes(model) -> Dict[str, tuple]:
    """{adapter name: full shape} of a model with adapters (add_lora), whatever its layout."""
    return {n: tuple(p.tp_full_shape) for n, p in model.named_parameters() if OURS in n}


# ------------------------------------------------------------------------------------------ out
def full_adapters(model, pgm) -> Dict[str, torch.Tensor]:
    """{adapter name: full CPU tensor}: gathered over tp, then over the pipeline stages. Collective
    over tp and pp (every rank calls it)."""
    mine = {n: gather_tensor(p.detach(), p.tp_split_dim, pgm.tp).float().cpu().clone()
            for n, p in model.named_parameters() if OURS in n}
    return gather_over_stages(mine, pgm)


def adapter_config(r: int, alpha: float, dropout: float, targets: Iterable[str],
                   base_model: Optional[str]) -> dict:
    """PEFT's LoraConfig as JSON, with the fields PEFT reads (the rest take PEFT's defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(r), "lora_alpha": alpha,
            "lora_dropout": float(dropout), "target_modules": sorted(targets), "bias": "none",
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "use_rslora": False, "use_dora": False,
            "base_model_name_or_path": base_model}


def save_adapter(directory: str, full: Dict[str, torch.Tensor], config: dict,
                 base: Optional[Dict[str, torch.Tensor]] = None) -> str:
    """Write the adapter directory (one process writes: the caller picks the rank); `base`: full
    base tensors {HF name: tensor} stored beside them (a resized vocabulary's)."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, WEIGHTS_FILE + ".tmp")
    tensors = {peft_key(n): t.contiguous().float() for n, t in full.items()}
    tensors.update({PEFT_PREFIX + n: t.contiguous().float() for n, t in (base or {}).items()})
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    return directory


def merge(base: Dict[str, torch.Tensor], adapters: Dict[str, torch.Tensor], scaling: float) -> dict:
    """{HF name: W0 + scaling * B @ A} for the adapted weights, the others as they are (full tensors)."""
    out = dict(base)
    for name in adapters:
        if name.endswith(OURS + "A"):
            module = name[:-len(OURS + "A")]
            a, b = adapters[name].double(), adapters[f"{module}{OURS}B"].double()
            w = base[f"{module}.weight"]
            out[f"{module}.weight"] = (w.double() + scaling * (b @ a)).to(w.dtype)
    return out


# ------------------------------------------------------------------------------------------- in
def read_adapter_config(directory: str) -> dict:
    """adapter_config.json of a PEFT adapter directory; FileNotFoundError / ValueError saying what."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
        raise FileNotFoundError(f"lora_model_dir {directory!r} is not a PEFT adapter directory: it needs "
                                f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    with open(path) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"lora_model_dir {directory!r}: peft_type {config.get('peft_type')!r}, "
                         f"only LORA adapters are read")
    return config


def adapter_file_shapes(directory: str) -> Dict[str, tuple]:
    """{minipar name: shape} from the safetensors header, without reading the tensors."""
    with safe_open(os.path.join(directory, WEIGHTS_FILE), framework="pt") as f:
        return {minipar_name(k): tuple(f.get_slice(k).get_shape()) for k in f.keys() if not is_base_key(k)}


def check_adapter(directory: str, expected: Dict[str, tuple], r: int, alpha: float) -> List[str]:
    """Every way the adapter directory disagrees with the model that will load it (empty: none):
    r and lora_alpha of its config, and each tensor's name and shape. Reads headers only."""
    config = read_adapter_config(directory)
    problems = []
    for key, ours in (("r", r), ("lora_alpha", alpha)):
        if config.get(key) != ours:
            ours_key = "lora_" + key.split("_")[-1]
            problems.append(f"its {key} is {config.get(key)!r}, this run's {ours_key} {ours!r}")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            problems.append(f"{key}: true is not supported")
    try:
        shapes = adapter_file_shapes(directory)
    except ValueError as err:
        return problems + [str(err)]
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    wrong = [f"{n} {shapes[n]} (the model's {expected[n]})" for n in sorted(set(shapes) & set(expected))
             if tuple(shapes[n]) != tuple(expected[n])]
    if missing:
        problems.append(f"{len(missing)} adapters of this run are missing, e.g. {missing[:2]} (check "
                        f"lora_target_modules against its target_modules {config.get('target_modules')})")
    if extra:
        problems.append(f"{len(extra)} tensors name no adapter of this model, e.g. {extra[:2]}")
    if wrong:
        problems.append(f"shapes differ (an adapter of another base model?): {'; '.join(wrong[:3])}")
    return problems


@torch.no_grad()
def load_adapters(model, directory: str, tp) -> int:
    """Copy this rank's slices of the adapter file into the model's adapters (local reads, no
    collective); returns how many tensors were loaded. check_adapter must have passed."""
    params = {n: p for n, p in model.named_parameters() if OURS in n}
    with safe_open(os.path.join(directory, WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            if is_base_key(key):             # a resized vocabulary: the run rebuilds it from its base
                continue
            name = minipar_name(key)
            if name in params:               # a pipeline stage holds its layers' adapters only
                p = params[name]
                p.copy_(shard_tensor(f.get_tensor(key).to(p.dtype), p.tp_split_dim, tp))
    return len(params)
