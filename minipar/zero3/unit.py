"""One ZeRO-3 unit: its parameters as one flat buffer, this rank's fp32 shard of it, and the
all-gather that makes the buffer whole for a while and the free that makes it empty again.

    fully_shard's units: the embedding, each decoder layer, the root (final norm, lm_head)

    shard   (B/N,) fp32 nn.Parameter: rank r's slice of the padded flat buffer, what the optimizer
            steps (B = ceil(numel / N) * N, N = dp_shard_cp size; flat_param.py's FlatLayout)
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
wire (N-1)/N of that; nothing else. (An experts unit: over edp, N its size; see
expert_parallel/sharding.py.) When a unit gathers (the hooks, the prefetch, the learned
orders) is shard_manager.py's. An embedding's backward never reads its weight (LOOKUPS), so such a
unit is not gathered for backward.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm, comm_ledger
from ..tensor_parallel.layers import VocabParallelEmbedding
from .flat_param import FlatLayout

# modules whose backward never reads their weight (an embedding's gradient is a scatter-add of the
# output gradient at the looked-up rows): a unit that is exactly one of them is not gathered again
# for backward. Exact types only: a subclass may compute something else with its weight.
LOOKUPS = (nn.Embedding, VocabParallelEmbedding)


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
        self.gather_for_backward = type(module) not in LOOKUPS

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
