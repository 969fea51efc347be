"""minipar's parameter names and the Hugging Face Hub's, which differ only for the mixture of experts.

minipar stores each MoE layer's experts stacked, one tensor per projection with the expert as dim 0
(models/moe.py), so that expert parallelism splits them as tensor parallelism splits a weight. The
Hub stores one tensor per expert and projection (and transformers 5, which fuses them in memory,
still reads and writes that layout):

    minipar (stacked)                    Mixtral on the Hub (one per expert j)
    layers.i.mlp.gate.weight  (E, d)     layers.i.block_sparse_moe.gate.weight
    ...mlp.experts.gate_proj  (E, F, d)  layers.i.block_sparse_moe.experts.j.w1.weight  (F, d)
    ...mlp.experts.up_proj    (E, F, d)  ...experts.j.w3.weight                         (F, d)
    ...mlp.experts.down_proj  (E, d, F)  ...experts.j.w2.weight                         (d, F)

    Qwen3-MoE on the Hub: layers.i.mlp.gate.weight, and layers.i.mlp.experts.j.gate_proj.weight,
    .up_proj.weight and .down_proj.weight

Every other name is the same. The reader (models/hf_checkpoint.py) stacks the experts a rank
keeps; the writer unstacks them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

# minipar's projection -> Mixtral's per-expert name (Qwen3-MoE keeps minipar's)
MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERTS = ".mlp.experts."


def stacked_expert(name: str) -> bool:
    """Whether `name` is a stacked expert weight (E, ...) of minipar's."""
    return _EXPERTS in name and name.rsplit(".", 1)[-1] in MIXTRAL_EXPERTS


def hub_name(name: str, model_type: str, expert: Optional[int] = None) -> str:
    """The Hub's name of a minipar parameter (of one expert of it, for a stacked expert weight)."""
    if expert is not None:
        layer, proj = name.rsplit(_EXPERTS, 1)
        if model_type == "mixtral":
            return f"{layer}.block_sparse_moe.experts.{expert}.{MIXTRAL_EXPERTS[proj]}.weight"
        return f"{layer}{_EXPERTS}{expert}.{proj}.weight"
    if model_type == "mixtral" and name.endswith(".mlp.gate.weight"):
        return name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
    return name


def hub_shapes(name: str, full_shape: Tuple[int, ...], model_type: str) -> List[Tuple[str, tuple]]:
    """The Hub tensors (name, shape) that make up minipar's parameter `name` of `full_shape`."""
    if stacked_expert(name):
        return [(hub_name(name, model_type, j), tuple(full_shape[1:])) for j in range(full_shape[0])]
    return [(hub_name(name, model_type), tuple(full_shape))]


def to_hub(full: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
    """A full state dict in minipar's names -> the Hub's (stacked experts cut into one per expert)."""
    out = {}
    for name, t in full.items():
        if stacked_expert(name):
            for j in range(t.shape[0]):
                out[hub_name(name, model_type, j)] = t[j]
        else:
            out[hub_name(name, model_type)] = t
    return out
