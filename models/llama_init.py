"""Where a rank's weights come from: weight sources, and turning a meta-built model into a real one.

A model built with `LlamaForCausalLM(config, pgm, device="meta")` has every parameter's shape (its
TP-local shape, plus `tp_full_shape` and `tp_split_dim`) but no storage, so building it costs no
memory whatever its size. A *weight source* then answers one question, for one parameter at a time:

    source.tp_local(hf_name, full_shape, tp_split_dim) -> this rank's TP slice (a real tensor)
                        = full.chunk(tp, dim=tp_split_dim)[tp_rank]     (the whole tensor if None)
    source.tp_local(..., experts=(first, count))        -> full[first:first + count] of a stacked
                                                           expert weight (an ep rank's experts)

Two sources answer it: `SeededInit` below (random initialisation) and the Hugging Face checkpoint
reader (models/hf_checkpoint.py, which reads the slice straight from the safetensors
files). Two consumers ask it:

    materialize(model, source)               no ZeRO-3: every parameter becomes its TP slice
    fully_shard(model, pgm, init=source)     ZeRO-3: unit by unit, only the tensors that overlap
                                             this rank's flat shard are asked for, cut, and dropped

so a rank never holds more than what it keeps plus one tensor in flight (the memory picture and its
measurement: docs/finetuning.md, benchmarks/bench_load.py).

Random initialisation stays layout-independent. The values are those of a single generator seeded
with `seed` drawing every FULL tensor in parameter order (normal(0, initializer_range) for
matrices, ones for norms -- zeros for Gemma's, which scale by 1 + weight -- zeros for biases),
each then sliced for this rank; every layout therefore starts from the same weights. A rank may
ask in another order (ZeRO-3's root unit holds the embedding AND the lm_head, drawn first and
last): SeededInit records the generator state at the
start of every tensor it has passed, and to reach a later tensor it draws (and drops) the ones in
between, one full tensor at a time; a tensor before the frontier is redrawn from its recorded state.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from minipar.expert_parallel.sharding import ep_block
from minipar.tensor_parallel import shard_tensor


class SeededInit:
    """The weight source of random initialisation (see the module docstring)."""

    def __init__(self, model: nn.Module, seed: int, tp=None, device=None):
        self.tp = tp if tp is not None else model.pgm.tp
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.std = model.config.initializer_range
        # a norm's identity: weight 1, or 0 where it scales by (1 + weight) (Gemma's norm_offset)
        self.norm_fill = "zeros" if getattr(model.config, "norm_offset", False) else "ones"
        self.order: Sequence[Tuple[str, tuple]] = [(n, tuple(p.tp_full_shape))
                                                   for n, p in model.named_parameters()]   # tied once
        self.index = {n: i for i, (n, _) in enumerate(self.order)}
        self.gen = torch.Generator().manual_seed(seed)   # on the CPU, whatever the default device
        self.next = 0                                    # the tensor self.gen would draw next
        self.states: Dict[int, torch.Tensor] = {0: self.gen.get_state()}

    def _kind(self, name: str, shape) -> str:
        if name.endswith(".bias"):
            return "zeros"
        return self.norm_fill if len(shape) == 1 else "normal"   # 1-D weights are the RMSNorm scales

    def _draw(self, i: int, gen: torch.Generator) -> torch.Tensor:
        full = torch.empty(self.order[i][1], device="cpu")
        return full.normal_(0.0, self.std, generator=gen)

    def full(self, name: str) -> torch.Tensor:
        """The full tensor `name`, exactly as one pass in parameter order draws it."""
        if name not in self.index:
            raise KeyError(f"SeededInit: {name} is not a parameter of this model")
        i = self.index[name]
        shape = self.order[i][1]
        kind = self._kind(name, shape)
        if kind != "normal":                     # draws nothing from the generator
            return torch.ones(shape) if kind == "ones" else torch.zeros(shape)
        if i < self.next:                        # passed already: redraw from its recorded state
            gen = torch.Generator()
            gen.set_state(self.states[i])
            return self._draw(i, gen)
        while self.next < i:                     # advance the frontier, one full tensor at a time
            if self._kind(*self.order[self.next]) == "normal":
                self._draw(self.next, self.gen)
            self.next += 1
            self.states[self.next] = self.gen.get_state()
        full = self._draw(i, self.gen)
        self.next = i + 1
        self.states[self.next] = self.gen.get_state()
        return full

    def tp_local(self, name: str, full_shape, tp_split_dim: Optional[int], experts=None) -> torch.Tensor:
        """This rank's TP slice of `name`; experts=(first, count): only those experts (dim 0) of a
        stacked expert weight, an expert-parallel rank's share (drawn whole, then cut)."""
        full = self.full(name)
        if tuple(full.shape) != tuple(full_shape):
            raise ValueError(f"SeededInit: {name} has shape {tuple(full.shape)}, "
                             f"asked for {tuple(full_shape)}")
        if experts is not None:
            full = full[experts[0]:experts[0] + experts[1]]
        return shard_tensor(full, tp_split_dim, self.tp).to(self.device)


def local_from_source(source, name: str, p, ep=None) -> torch.Tensor:
    """`source`'s slice of parameter `p` (meta or real): its TP slice, and for an expert weight
    split over the ep group `ep` only this member's block of experts (expert_parallel/sharding.py)."""
    if getattr(p, "ep_split_dim", None) is None:
        return source.tp_local(name, p.tp_full_shape, p.tp_split_dim)
    return source.tp_local(name, p.tp_full_shape, p.tp_split_dim,
                           experts=ep_block(p.tp_full_shape[p.ep_split_dim], ep))


@torch.no_grad()
def materialize(model: nn.Module, source) -> nn.Module:
    """Replace every meta parameter of `model` by its TP slice from `source`, on source.device,
    one tensor at a time; tied parameters stay tied (one new Parameter for all their places)."""
    new: Dict[int, nn.Parameter] = {}
    ep = getattr(getattr(model, "pgm", None), "ep", None)
    for name, p in model.named_parameters():     # tied weights once
        if not p.is_meta:                        # already real (LoRA's adapters): kept as they are
            continue
        t = local_from_source(source, name, p, ep)
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{name}: the weight source gave shape {tuple(t.shape)}, this rank's slice "
                             f"is {tuple(p.shape)}")
        q = nn.Parameter(t.to(dtype=p.dtype).contiguous(), requires_grad=p.requires_grad)
        q.tp_split_dim, q.tp_full_shape = p.tp_split_dim, p.tp_full_shape
        if hasattr(p, "ep_split_dim"):           # an expert weight: split over ep too
            q.ep_split_dim, q.ep_full_shape = p.ep_split_dim, p.ep_full_shape
        new[id(p)] = q
    for m in model.modules():
        for attr, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[attr] = new[id(p)]
    return model
