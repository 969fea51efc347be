"""One ZeRO-3 unit: its parameters laid end to end in one flat buffer, this rank's fp32 shard of it,
and the all-gather that makes the buffer whole for a while and the free that makes it empty again.

    fully_shard's units (wrap.py): the embedding, each decoder layer, the root (final norm, lm_head)

The flat buffer. Sharding tensor by tensor would cost one collective per tensor; FSDP (Zhao et
al., "PyTorch FSDP", 2023) instead concatenates all parameters of a unit into ONE flat buffer, so a
unit costs one all-gather and one reduce-scatter. FlatLayout is where everything lies:

    unit parameters (TP-local)  q (4, 8)      norm (8,)    k (2, 8)          56 elements
    flat buffer                 [ q.view(-1) | norm       | k.view(-1) | pad ] 60 = 4 shards x 15
    offsets                      0            32           40           56
    shard r of N = 4            flat[15 r : 15 (r + 1)]     what rank r of dp_shard_cp keeps

Padding makes every shard the same length (collectives need equal pieces); its values and
gradients are zero. A shard may start or end in the middle of a tensor: it is only ever read as
flat numbers (the optimizer is elementwise), and the whole buffer is rebuilt before use. Each slot
keeps what the parameter carried (tp_split_dim, its full shape; ep_split_dim for an expert: the
layers that made them set these, tensor_parallel/layers.py, models/moe.py), so the shard's metadata
is enough to rebuild full tensors from the shards of any layout (state_dicts.py does, for the
checkpoint). For the optimizer and clipping, element ranges inside THIS rank's shard:
    tp_split_segments   ranges of TP-split tensors: their squares are summed over tp for the global
                        norm; the rest is TP-replicated (norms) or padding
    no_decay_segments   ranges of 1-D tensors (norm weights): AdamW does not decay them
A unit's experts (parameters with ep_split_dim) lie in a second FlatLayout of their own, sharded
over edp (the ranks holding the same experts: expert_parallel/sharding.py); full_shape is the
whole (E, ...) tensor.

The unit's buffers:

    shard   (B/N,) fp32 nn.Parameter: rank r's slice of the padded flat buffer, what the optimizer
            steps (B = ceil(numel / N) * N, N = dp_shard_cp size)
    buffer  (B,) in the compute dtype (param_dtype): all_gather_into(buffer, shard) fills it;
            free() releases its STORAGE (untyped_storage().resize_(0)), so the module attributes
            (q_proj.weight, ... views of it) and the tensors autograd saved keep their shapes
            but hold no memory until the next gather refills the same storage in place
    flat    the autograd leaf over the same memory (buffer.data): the views come from it, so
            every gradient of the unit accumulates in flat.grad (B,), which grad_reduce.py
            reduce-scatters. Written through an alias with its own version counter: refilling
            it before backward is not an in-place change of what autograd saved, it restores it

    state   "sharded" -> start_gather() -> "gathering" (async all-gather in flight)
            -> wait_gather() -> "gathered" -> free() -> "sharded"

Communication: one all-gather of B elements in param_dtype over dp_shard_cp per start_gather,
wire (N-1)/N of that; nothing else. (An experts unit: over edp, N its size.) When a unit gathers
(the hooks, the prefetch, the learned orders) is shard_manager.py's. A module whose backward never
reads its weight (an embedding: backward_reads_weight) is not gathered for backward.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .. import comm, comm_ledger


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
            # an expert asks for this ep member's block of experts only (a dense source never sees it):
            # member j of n holds experts [j E/n, (j + 1) E/n) (expert_parallel/sharding.py)
            block = {} if s.ep_split_dim is None else dict(experts=_expert_block(s, ep))
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


def backward_reads_weight(module) -> bool:
    """Whether a unit that is exactly `module` must be gathered again for its backward. Not for an
    embedding: its gradient is a scatter-add of the output gradient at the looked-up rows, which
    never reads the weight. torch's nn.Embedding, and a module class that says so in its own body
    (`backward_reads_weight = False`: tensor_parallel/layers.py's VocabParallelEmbedding), are
    asked; declared, not inherited, since a subclass may compute something else with its weight."""
    cls = type(module)
    return cls is not nn.Embedding and cls.__dict__.get("backward_reads_weight", True) is not False


def _expert_block(slot, ep) -> Tuple[int, int]:
    """(first, count): the experts this ep member holds of an expert slot."""
    count = slot.local_shape[slot.ep_split_dim]
    return (0 if ep is None else ep.rank) * count, count


class Unit:
    """One unit: its module, flat layout, shard (the nn.Parameter) and gathered buffer."""

    def __init__(self, name, module, params, refs, pgm, param_dtype, reduce_dtype, init=None,
                 experts: bool = False):
        # a unit's experts (expert_parallel/sharding.py) shard over edp, the ranks holding the same
        # experts, and gather over ep for full tensors; everything else over dp_shard_cp
        self.name, self.module, self.refs = name or "<root>", module, refs
        self.dim, self.ep = (pgm.edp, pgm.ep) if experts else (pgm.dp_shard_cp, None)
        self.layout = FlatLayout.build(params, self.dim.size, self.dim.rank, pgm.tp.size)
        tensors = [p.detach() for _, p in params]
        dtype = tensors[0].dtype if tensors else torch.float32
        device = tensors[0].device if tensors else torch.device("cpu")
        trainable = any(p.requires_grad for _, p in params)
        with torch.no_grad():
            if init is not None:             # a meta-built model: fill only this rank's shard
                device = init.device
                shard = self.layout.shard_from_source(init, dtype, device, self.ep)
            else:
                flat = self.layout.flatten(tensors, dtype) if tensors else torch.zeros(0)
                shard = self.layout.shard(flat).clone()
            self.shard = nn.Parameter(shard, requires_grad=trainable)
        self.shard.zero3_shard, self.shard.zero3_unit = True, self.name
        self.shard.tp_split_segments = self.layout.tp_split_segments()
        self.shard.no_decay_segments = self.layout.no_decay_segments()
        self.compute_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.compute_dtype
        # buffer: what the all-gather writes; flat: the autograd leaf over the same memory
        self.buffer = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=device)
        self.flat = self.buffer.data.requires_grad_(trainable)
        with torch.no_grad():                # attributes exist (shapes right) even while sharded
            self.point_params_at(self.layout.views(self.flat))
        self.buffer.untyped_storage().resize_(0)
        self.work = self.work_src = None
        self.state = "sharded"               # -> "gathering" -> "gathered" -> "sharded"
        self.in_backward = False
        self.accumulated_grad = None         # the unsharded gradient summed under no_sync
        self.gather_for_backward = backward_reads_weight(module)

    @property
    def empty(self) -> bool:
        return self.layout.padded_numel == 0

    def point_params_at(self, views):
        for view, refs in zip(views, self.refs):
            for module, attr in refs:        # a tied parameter: every module that uses it
                setattr(module, attr, view)

    def start_gather(self):
        if self.state != "sharded" or self.empty:
            return
        if self.shard.device != self.buffer.device:
            raise RuntimeError(f"zero3 unit {self.name}: the shard moved to {self.shard.device} after "
                               f"fully_shard (buffers are on {self.buffer.device}); move the model first")
        self.buffer.untyped_storage().resize_(self.layout.padded_numel * self.buffer.element_size())
        self.work_src = self.shard.detach().to(self.compute_dtype)      # the masters stay fp32
        comm_ledger.mark(f"zero3.gather {self.name}")
        self.work = comm.all_gather_into(self.buffer, self.work_src, self.dim, async_op=True)
        self.state = "gathering"

    def wait_gather(self):
        if self.state == "gathering":
            self.work.wait()
            self.work = self.work_src = None
            self.state = "gathered"

    def free(self):
        self.wait_gather()
        if self.state == "gathered":
            self.buffer.untyped_storage().resize_(0)
            self.state = "sharded"

    @property
    def gathered_bytes(self) -> int:
        return self.buffer.untyped_storage().nbytes()


class AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients are complete, i.e. when
    the unit's backward is done, and calls `done` (frees a frozen unit, which has no gradient hook)."""

    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.done()
        return (None, *grads)
