"""minipar's parameter names and the Hugging Face Hub's, which differ for the mixture of experts and
for Phi-3's fused projections.

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

Phi-3 (and Phi-4) store q/k/v as one qkv_proj and gate/up as one gate_up_proj, the parts
concatenated along the output rows; minipar keeps them apart, because tensor parallelism cuts each
one by heads (or MLP columns), and a tp slice of the fused tensor would mix q rows with k rows:

    minipar                              Phi-3 on the Hub (rows, in order)
    self_attn.q_proj  (H*hd, d)          self_attn.qkv_proj   [0, H*hd)
    self_attn.k_proj  (Hkv*hd, d)                             [H*hd, H*hd + Hkv*hd)
    self_attn.v_proj  (Hkv*hd, d)                             [H*hd + Hkv*hd, H*hd + 2*Hkv*hd)
    mlp.gate_proj     (F, d)             mlp.gate_up_proj     [0, F)
    mlp.up_proj       (F, d)                                  [F, 2F)

The reader reads a rank's tp slice of each part straight from its rows of the fused tensor (one
get_slice; nothing else of it is read); the writer concatenates the parts back (hub_tensors: a
part waits until its siblings arrive, which they do at once: they are consecutive parameters).

Every other name is the same. The reader (models/hf_checkpoint.py) stacks the experts a rank
keeps; the writer unstacks them.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

# minipar's projection -> Mixtral's per-expert name (Qwen3-MoE keeps minipar's)
MIXTRAL_EXPERTS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERTS = ".mlp.experts."


# Phi-3's fused tensors: minipar's module -> (the Hub's fused module, the part's index, the parts)
FUSED = {"phi3": {"self_attn.q_proj": ("self_attn.qkv_proj", 0, 3),
                  "self_attn.k_proj": ("self_attn.qkv_proj", 1, 3),
                  "self_attn.v_proj": ("self_attn.qkv_proj", 2, 3),
                  "mlp.gate_proj": ("mlp.gate_up_proj", 0, 2), "mlp.up_proj": ("mlp.gate_up_proj", 1, 2)}}


def fused_part(name: str, model_type: str) -> Optional[Tuple[str, int, int]]:
    """(the Hub's fused tensor, this part's index, the number of parts) of a minipar weight that the
    Hub stores fused (Phi-3's q/k/v, gate/up), else None."""
    for module, (fused, j, count) in FUSED.get(model_type, {}).items():
        suffix = f".{module}.weight"
        if name.endswith(suffix):
            return f"{name[:-len(suffix)]}.{fused}.weight", j, count
    return None


def fused_rows(name: str, config) -> Optional[Tuple[str, int]]:
    """(the Hub's fused tensor, the first row of this part in it) for a fused part of `config`'s
    family (the parts' row counts from the config: H*hd, Hkv*hd, Hkv*hd or F, F), else None."""
    part = fused_part(name, config.model_type)
    if part is None:
        return None
    hub, j, count = part
    q, kv, f = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim, \
        config.intermediate_size
    rows = (q, kv, kv) if count == 3 else (f, f)
    return hub, sum(rows[:j])


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
    part = fused_part(name, model_type)
    if part is not None:
        return part[0]
    if model_type == "mixtral" and name.endswith(".mlp.gate.weight"):
        return name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
    return name


def hub_shapes(name: str, full_shape: Tuple[int, ...], model_type: str) -> List[Tuple[str, tuple]]:
    """The Hub tensors (name, shape) that make up minipar's parameter `name` of `full_shape` (for a
    fused part: the fused tensor's name and the part's shape; hub_shape_map sums the parts)."""
    if stacked_expert(name):
        return [(hub_name(name, model_type, j), tuple(full_shape[1:])) for j in range(full_shape[0])]
    return [(hub_name(name, model_type), tuple(full_shape))]


def hub_shape_map(named_shapes: Iterable[Tuple[str, tuple]], model_type: str) -> Dict[str, tuple]:
    """{Hub name: shape} of minipar's (name, full shape) pairs: a fused tensor's rows summed over
    its parts."""
    want: Dict[str, tuple] = {}
    for name, full_shape in named_shapes:
        for hub, shape in hub_shapes(name, full_shape, model_type):
            if hub in want and fused_part(name, model_type) is not None:
                shape = (want[hub][0] + shape[0],) + tuple(shape[1:])
            want[hub] = tuple(shape)
    return want


def hub_tensors(items: Iterable[Tuple[str, torch.Tensor]], model_type: str):
    """(minipar name, full tensor) -> (Hub name, tensor), one at a time as they come: stacked experts
    cut into one per expert, fused parts held until their siblings arrive and concatenated."""
    pending: Dict[str, Dict[int, torch.Tensor]] = {}
    for name, t in items:
        part = fused_part(name, model_type)
        if stacked_expert(name):
            for j in range(t.shape[0]):
                yield hub_name(name, model_type, j), t[j]
        elif part is not None:
            hub, j, count = part
            parts = pending.setdefault(hub, {})
            parts[j] = t
            if len(parts) == count:
                del pending[hub]
                yield hub, torch.cat([parts[i] for i in range(count)])
            del parts
        else:
            yield hub_name(name, model_type), t
        del t
    if pending:
        raise ValueError(f"export: the parts of {sorted(pending)[:3]} did not all arrive (a fused tensor "
                         f"needs every part: q/k/v or gate/up)")


def to_hub(full: Dict[str, torch.Tensor], model_type: str) -> Dict[str, torch.Tensor]:
    """A full state dict in minipar's names -> the Hub's (stacked experts cut into one per expert,
    Phi-3's parts fused)."""
    return dict(hub_tensors(full.items(), model_type))
