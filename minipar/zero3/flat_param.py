"""The flat buffer of a ZeRO-3 unit: how a unit's parameters lie end to end, padded, cut into shards.

ZeRO-3 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", 2020) keeps 1/N of every parameter on each of the N ranks of the shard group. Sharding
tensor by tensor would cost one collective per tensor; FSDP (Zhao et al., "PyTorch FSDP", 2023)
instead concatenates all parameters of a unit (a decoder layer, say) into ONE flat buffer, so a
unit costs one all-gather and one reduce-scatter. This file is that bookkeeping, with no hooks and
no communication except the tp gathers of the state-dict helpers:

    unit parameters (TP-local)  q (4, 8)      norm (8,)    k (2, 8)          56 elements
    flat buffer                 [ q.view(-1) | norm       | k.view(-1) | pad ] 60 = 4 shards x 15
    offsets                      0            32           40           56
    shard r of N = 4            flat[15 r : 15 (r + 1)]     what rank r of dp_shard_cp keeps

Padding makes every shard the same length (collectives need equal pieces); its values and
gradients are zero. A shard may start or end in the middle of a tensor: it is only ever read as
flat numbers (the optimizer is elementwise), and the whole buffer is rebuilt before use.

Metadata carried for the optimizer and clipping (element ranges inside THIS rank's shard):
    tp_split_segments   ranges of TP-split tensors (tp_split_dim 0/1): their squares are summed
                        over tp for the global norm; the rest is TP-replicated (norms) or padding
    no_decay_segments   ranges of 1-D tensors (norm weights): AdamW does not decay them

A unit's experts (parameters with ep_split_dim, expert_parallel/sharding.py) are split over ep and
lie in a second FlatLayout of their own, sharded over edp (the ranks holding the same experts): their
slots carry ep_split_dim, and full_shape is the whole (E, ...) tensor.

A sharded state dict is the shard plus this layout (name, TP-local shape, offset, tp_split_dim,
full shape per tensor), enough to rebuild full tensors from the shards of any other layout:
trainer/checkpoint/save_load.py writes it as segments and reshards on load (state_dicts.py builds it).
Here too: `plan_units`, which parameters go into which unit's flat buffer.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..expert_parallel.sharding import ep_block, ep_gather, ep_shard
from ..tensor_parallel.layers import gather_tensor, shard_tensor


@dataclass(frozen=True)
class Slot:
    """Where one original parameter lives in the flat buffer."""
    name: str                        # HF name (the first name of a tied parameter)
    local_shape: Tuple[int, ...]     # what this tp rank holds
    offset: int                      # first element in the (unsharded) flat buffer
    tp_split_dim: Optional[int]      # None: replicated over tp
    full_shape: Tuple[int, ...]      # after gathering over tp (and over ep: an expert's (E, ...))
    ep_split_dim: Optional[int] = None   # experts: split over ep too (expert_parallel/sharding.py)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


def _full_shape(p: torch.Tensor, split_dim, tp_size: int) -> Tuple[int, ...]:
    shape = getattr(p, "tp_full_shape", None)
    if shape is not None:
        return tuple(shape)
    shape = list(p.shape)
    if split_dim is not None:
        shape[split_dim] *= tp_size
    return tuple(shape)


class FlatLayout:
    """The layout of one unit: slots, padded length, and the [start, stop) of this rank's shard."""

    def __init__(self, slots: Sequence[Slot], shard_count: int, shard_rank: int):
        self.slots = list(slots)
        self.numel = sum(s.numel for s in self.slots)
        self.shard_count, self.shard_rank = shard_count, shard_rank
        self.shard_numel = -(-self.numel // shard_count)          # ceil: equal pieces for the collectives
        self.padded_numel = self.shard_numel * shard_count
        self.start = shard_rank * self.shard_numel
        self.stop = self.start + self.shard_numel

    @classmethod
    def build(cls, named_params, shard_count: int, shard_rank: int, tp_size: int) -> "FlatLayout":
        slots, offset = [], 0
        for name, p in named_params:
            split = getattr(p, "tp_split_dim", None)
            slots.append(Slot(name, tuple(p.shape), offset, split, _full_shape(p, split, tp_size),
                              getattr(p, "ep_split_dim", None)))
            offset += p.numel()
        return cls(slots, shard_count, shard_rank)

    # ------------------------------------------------------------------ flat <-> tensors
    def flatten(self, tensors: Sequence[torch.Tensor], dtype=None) -> torch.Tensor:
        """The padded flat buffer (padded_numel,) from TP-local tensors in slot order."""
        dtype = dtype or tensors[0].dtype
        device = tensors[0].device if tensors else torch.device("cpu")
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        for s, t in zip(self.slots, tensors):
            flat[s.offset:s.offset + s.numel].copy_(t.reshape(-1))
        return flat

    def shard_from_source(self, source, dtype, device, ep=None) -> torch.Tensor:
        """This rank's shard (shard_numel,), filled from a weight source (models/llama_init.py)
        without building the flat buffer: only the tensors that overlap [start, stop) are asked
        for (their TP slice), each copied in and dropped, so the peak is the shard plus one tensor."""
        shard = torch.zeros(self.shard_numel, dtype=dtype, device=device)
        for s in self.slots:
            a, b = max(s.offset, self.start), min(s.offset + s.numel, self.stop)
            if b <= a:
                continue                                  # lies in another rank's shard
            # an expert asks for this ep member's block of experts only (a dense source never sees it)
            block = {} if s.ep_split_dim is None else dict(experts=ep_block(s.full_shape[s.ep_split_dim], ep))
            t = source.tp_local(s.name, s.full_shape, s.tp_split_dim, **block)
            if tuple(t.shape) != tuple(s.local_shape):
                raise ValueError(f"{s.name}: the weight source gave shape {tuple(t.shape)}, this rank's "
                                 f"slice is {tuple(s.local_shape)}")
            shard[a - self.start:b - self.start].copy_(t.reshape(-1)[a - s.offset:b - s.offset])
        return shard

    def views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """One view per slot, shaped like the original parameter. A single torch.split (not one
        slice per tensor) so that autograd's backward of it is ONE concatenation into a flat
        gradient; the padding piece gets no gradient, which the concatenation fills with zeros."""
        sizes = [s.numel for s in self.slots]
        if self.padded_numel > self.numel:
            sizes.append(self.padded_numel - self.numel)
        pieces = torch.split(flat, sizes) if sizes else ()
        return [piece.view(s.local_shape) for piece, s in zip(pieces, self.slots)]

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.stop]

    # ------------------------------------------------------------------ metadata
    def _segments(self, pick) -> List[Tuple[int, int]]:
        """[start, stop) ranges, in THIS shard's coordinates, of the slots with pick(slot)."""
        out: List[Tuple[int, int]] = []
        for s in self.slots:
            a, b = max(s.offset, self.start), min(s.offset + s.numel, self.stop)
            if b > a and pick(s):
                a, b = a - self.start, b - self.start
                if out and out[-1][1] == a:                   # merge neighbours
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
        return out

    def tp_split_segments(self) -> List[Tuple[int, int]]:
        return self._segments(lambda s: s.tp_split_dim is not None)

    def no_decay_segments(self) -> List[Tuple[int, int]]:
        return self._segments(lambda s: len(s.local_shape) < 2)

    def metadata(self) -> dict:
        """Plain Python values (JSON-friendly): where each tensor lies, and where this shard lies."""
        params = [dict(asdict(s), local_shape=list(s.local_shape), full_shape=list(s.full_shape),
                       numel=s.numel) for s in self.slots]
        return dict(start=self.start, stop=self.stop, numel=self.numel, padded_numel=self.padded_numel,
                    shard_count=self.shard_count, params=params)

    # ------------------------------------------------------------------ full tensors
    def to_full(self, flat: torch.Tensor, tp, ep=None) -> Dict[str, torch.Tensor]:
        """{name: full tensor} from the (gathered, unsharded) flat buffer; all-gathers over tp, and
        the experts over ep (collective: every tp and ep rank must call it)."""
        return dict(self.full_items(flat, tp, ep))

    def full_items(self, flat: torch.Tensor, tp, ep=None):
        """to_full one tensor at a time: (name, full tensor), each gathered only when asked for
        (collective: every tp and ep rank must take every item). A full tensor never shares the
        flat buffer's memory (a slot nothing was gathered for is copied out), so keeping one does not
        keep the unit alive."""
        for s in self.slots:
            local = flat[s.offset:s.offset + s.numel].view(s.local_shape)
            full = ep_gather(gather_tensor(local.contiguous(), s.tp_split_dim, tp), s.ep_split_dim, ep)
            if full.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                full = full.clone()
            yield s.name, full
            del full                         # not alive while the next one is gathered

    def from_full(self, full: Dict[str, torch.Tensor], tp, dtype, device, source: str,
                  ep=None) -> torch.Tensor:
        """This rank's shard from full tensors (no communication: the slices are cut locally)."""
        missing = [s.name for s in self.slots if s.name not in full]
        if missing:
            raise ValueError(f"{source} lacks {len(missing)} parameters of this model, e.g. {missing[:3]}")
        tensors = []
        for s in self.slots:
            t = full[s.name]
            if tuple(t.shape) != tuple(s.full_shape):
                raise ValueError(f"{source}: {s.name} has shape {tuple(t.shape)}, this model expects "
                                 f"{tuple(s.full_shape)}: the checkpoint is of another model shape")
            local = shard_tensor(t.to(device=device, dtype=dtype), s.tp_split_dim, tp)
            tensors.append(ep_shard(local, s.ep_split_dim, ep))
        if not tensors:
            return torch.zeros(self.shard_numel, dtype=dtype, device=device)
        return self.shard(self.flatten(tensors, dtype)).clone()


def plan_units(model, unit_classes, ignored=()):
    """Which parameters go into which flat buffer: [(unit name, module, [(HF name, param)],
    [[(module, attr), ...] per param])], the root unit ("") first. `ignored` parameters (LoRA's
    adapters) go into none: they stay plain parameters of their modules. A unit is an outermost module
    of `unit_classes`; the root takes every parameter outside them. A unit that shares a parameter
    with the root (a tied embedding: lm_head.weight is embed_tokens.weight) joins the root, since
    one parameter lives in one flat buffer. Every place a (tied or shared) parameter is referenced
    is listed, so all of them can be pointed at the gathered view."""
    unit_names: List[str] = []
    for name, m in model.named_modules():
        inside = any(name.startswith(u + ".") for u in unit_names)   # nested: part of the outer unit
        if m is not model and isinstance(m, unit_classes) and not inside:
            unit_names.append(name)
    skip = {id(p) for p in ignored}
    names = {id(p): n for n, p in model.named_parameters() if id(p) not in skip}   # tied: its first name
    params = {id(p): p for _, p in model.named_parameters() if id(p) not in skip}
    while True:
        refs: Dict[int, list] = {i: [] for i in names}
        owner: Dict[int, set] = {i: set() for i in names}
        for mname, m in model.named_modules(remove_duplicate=False):    # a shared module: every path
            unit = next((u for u in unit_names if mname == u or mname.startswith(u + ".")), "")
            for attr, p in m._parameters.items():
                if p is not None and id(p) not in skip:
                    if not any(m is m2 and attr == a2 for m2, a2 in refs[id(p)]):
                        refs[id(p)].append((m, attr))
                    owner[id(p)].add(unit)
        tied_to_root = {u for units_of in owner.values() if "" in units_of for u in units_of} - {""}
        if not tied_to_root:
            break
        unit_names = [u for u in unit_names if u not in tied_to_root]
    for i, units_of in owner.items():
        if len(units_of) > 1:
            raise ValueError(f"fully_shard: parameter {names[i]} is shared by units {sorted(units_of)}; "
                             f"tied parameters must live in one unit (leave them in the root)")
        p, first = params[i], params[next(j for j in names if owner[j] == units_of)]
        if p.dtype != first.dtype or p.device != first.device or p.requires_grad != first.requires_grad:
            raise ValueError(f"fully_shard: {names[i]} is {p.dtype} on {p.device} (requires_grad="
                             f"{p.requires_grad}) but its unit also holds {first.dtype} on {first.device} "
                             f"(requires_grad={first.requires_grad}): one flat buffer needs one dtype, one "
                             f"device, and all or none of its parameters trainable")
    modules = dict(model.named_modules())
    plan = []
    for uname in [""] + unit_names:
        ids = [i for i in names if owner[i] == {uname}]
        plan.append((uname, modules[uname], [(names[i], params[i]) for i in ids], [refs[i] for i in ids]))
    return plan

