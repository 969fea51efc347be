"""ZeRO-3's gradient side: reduce-scatter each unit's gradient into its shard, or hold it unsharded
while gradients accumulate over micro-batches without communicating.

After a unit's backward its flat gradient (P_u elements, the whole padded buffer) is summed over
the N ranks of dp_shard_cp and cut into shards in one collective, the reduce-scatter:

    flat.grad (P_u,) reduce_dtype --reduce-scatter over dp_shard_cp--> shard grad (P_u/N,)
                                  [--all-reduce over dp_replicate (HSDP)--> summed over replicas]
                                  --> += shard.grad (fp32, like the shard)

Gradient accumulation over M micro-batches, two policies (FSDP2's `set_requires_gradient_sync`,
accelerate's `sync_each_batch`; the trainer's `fsdp.sync_each_batch`):

    sync every micro-batch (default)   M reduce-scatters of G per step; between micro-batches only
                                       the shard gradients are held: G/N
    no_sync() for micro-batches 1..M-1 flat gradients are ADDED into an unsharded accumulator per
                                       unit (reduce_dtype, the padded P_u elements), no communication;
                                       the last micro-batch (sync on) reduce-scatters the sum once:
                                       1 reduce-scatter of G per step, at the cost of holding the
                                       whole unsharded gradient, G bytes, from the first micro-batch's
                                       backward to the last one's (`accumulated_grad_bytes()`)

(G = sum over units of padded P_u x bytes of reduce_dtype.) Sums are exact reorderings of the
same additions, so both policies equal one process up to float rounding.

The reduce-scatters are asynchronous: one is waited for when the next one starts (so it overlaps
the next unit's backward), and the end-of-backward callback waits for what is still in flight. A
unit that accumulated under no_sync but took no part in the syncing backward is reduce-scattered
there, so no accumulated gradient is ever lost.
"""
from __future__ import annotations

import contextlib
from typing import List

import torch

from .. import comm, comm_ledger
from .unit import Unit


class GradientReduction:
    """The gradient side of one fully_shard'ed model, given its units and its ProcessGroupManager.

    Owns the switch `requires_gradient_sync` (True: the next backward reduce-scatters; False: it
    accumulates unsharded, set by set_requires_gradient_sync or no_sync), the reduce-scatters in
    flight (_pending: unit, work, shard-sized output, the reduce_dtype source the collective reads)
    and the HSDP all-reduces in flight (_replica_pending). The unsharded sums under no_sync live on
    each unit (Unit.accumulated_grad), next to the buffers they mirror.

    shard_manager.Zero3 calls post_backward(u) from u's post-accumulate-grad hook and
    finish_backward() from its end-of-backward callback; after that every gradient is in its
    shard's .grad and nothing is in flight."""

    def __init__(self, units: List[Unit], pgm):
        self.units, self.pgm = units, pgm
        self.requires_gradient_sync = True
        self._pending = []                       # (unit, work, out, src): src kept alive until waited
        self._replica_pending = []               # (unit, work, out): HSDP all-reduces in flight

    # ------------------------------------------------------------------ the public switch
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: the next backwards accumulate unsharded gradients locally (no communication);
        True (the default): the next backward reduce-scatters (everything accumulated so far too)."""
        if not isinstance(requires_gradient_sync, bool):
            raise ValueError(f"set_requires_gradient_sync: expected True or False, "
                             f"got {requires_gradient_sync!r}")
        self.requires_gradient_sync = requires_gradient_sync

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside accumulate gradients without communicating (DDP's and FSDP1's name):

            for m in range(M):
                with (model.zero3.no_sync() if m < M - 1 else contextlib.nullcontext()):
                    model(batch[m]).backward()
        """
        before = self.requires_gradient_sync
        self.requires_gradient_sync = False
        try:
            yield
        finally:
            self.requires_gradient_sync = before

    def accumulated_grad_bytes(self) -> int:
        """Bytes of the unsharded gradients held under no_sync (0 when none)."""
        return sum(u.accumulated_grad.numel() * u.accumulated_grad.element_size()
                   for u in self.units if u.accumulated_grad is not None)

    # ------------------------------------------------------------------ the hooks' work
    def post_backward(self, u: Unit):
        """All of u's gradient is in u.flat.grad (its post-accumulate-grad hook): add it to what
        no_sync accumulated, then hold the sum (no sync) or reduce-scatter it. A backward can reach
        the buffer with no gradient for it (autograd still runs the hook): the B of a split backward
        for a unit whose every weight gets its gradient in W (the tied copy of E alone in a last
        stage's root, pipeline_parallel/tied_ends.py); nothing is added then, W brings it."""
        if u.flat.grad is None:
            return
        grad, u.flat.grad = u.flat.grad, None    # the next backward must start from no .grad
        if u.accumulated_grad is not None:                 # earlier micro-batches under no_sync
            u.accumulated_grad.add_(grad)
            grad = u.accumulated_grad
        if not self.requires_gradient_sync:
            if u.accumulated_grad is None:                 # ours (flat.grad let go of it), in
                u.accumulated_grad = grad.to(u.reduce_dtype)   # reduce_dtype: fp32 sums under bf16
            return
        u.accumulated_grad = None
        self._reduce_scatter(u, grad)

    def finish_backward(self):
        """End of backward: reduce-scatter what only no_sync backwards touched, then wait for all."""
        self._sync_leftovers()
        self._drain(keep=0)

    def _reduce_scatter(self, u: Unit, grad):
        src = grad.to(u.reduce_dtype)
        out = torch.empty(u.layout.shard_numel, dtype=u.reduce_dtype, device=grad.device)
        comm_ledger.mark(f"zero3.reduce_scatter {u.name}")
        work = comm.reduce_scatter_into(out, src, u.dim, async_op=True)
        self._pending.append((u, work, out, src))
        self._drain(keep=1)                      # finish the previous unit's while this one runs

    def _sync_leftovers(self):
        """At the end of a syncing backward: units that accumulated under no_sync but were not
        used in this backward still hold an unsharded gradient; reduce-scatter it now."""
        if self.requires_gradient_sync:
            for u in self.units:
                if u.accumulated_grad is not None:
                    grad, u.accumulated_grad = u.accumulated_grad, None
                    self._reduce_scatter(u, grad)

    def _drain(self, keep: int = 0):
        replicate = self.pgm.dp_replicate
        while len(self._pending) > keep:
            u, work, out, _ = self._pending.pop(0)
            work.wait()
            if replicate.size > 1:               # HSDP: the replicas sum their shard gradients
                self._replica_pending.append((u, comm.all_reduce(out, replicate, async_op=True), out))
            else:
                self._accumulate(u, out)
        if keep == 0:
            for u, work, out in self._replica_pending:
                work.wait()
                self._accumulate(u, out)
            self._replica_pending = []

    @staticmethod
    def _accumulate(u, out: torch.Tensor):
        g = out.to(u.shard.dtype)
        if u.shard.grad is None:                 # gradient accumulation adds into the shard grad
            u.shard.grad = g
        else:
            u.shard.grad.add_(g)
