"""Data parallelism, the textbook version: after backward, one all-reduce per parameter.

Every replica holds the whole model and reads its own samples; the gradient of the global batch
is the SUM of the replicas' gradients (the loss is already divided by the token count of the
global batch, see trainer/data/batches.py). The simplest code that gets there:

    loss.backward()                                   every p.grad holds this replica's gradient
    for p in model.parameters():                      then, one by one, blocking:
        all_reduce(p.grad, dim)                       2 (n-1)/n * bytes(p) on the wire

(plus one all-reduce of a used flag per parameter first, so that a parameter no rank used keeps
no gradient, as on one process: ddp.py sends the same flags inside its buckets.)

That is all `NaiveGradSync` does, from an end-of-backward callback so that `loss.backward()`
returns with the sums in place, exactly as ddp.py's bucketed version does (the trainer swaps one
for the other with the config key `ddp: naive | bucketed`).

What it costs, and why ddp.py exists: the bytes are the same as the bucketed version's, but

  - each parameter pays the latency of one collective (a 4-layer Llama has ~40 parameters, a
    real one hundreds; the bucketed version makes a handful of ~25 MB calls);
  - nothing overlaps: the network idles during backward and the compute idles during the
    reductions. The bucketed version launches a bucket's all-reduce as soon as backward has
    produced its last gradient, so most of the communication hides behind the rest of backward.

benchmarks/ladder.py measures the two side by side (calls, bytes, step time); tests/test_ladder.py
proves both equal to one process.

Gradient accumulation: inside `with sync.no_sync():` nothing is reduced; the backward of the last
micro-batch, outside it, reduces the accumulated sum, once. (A gradient that already holds a
reduced sum R is divided by n before the next backward adds to it, so accumulating without no_sync
is right too, only slower, as in ddp.py.)
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm, comm_ledger
from .ddp import ReplicaSync, attach


class NaiveGradSync(ReplicaSync):
    """One blocking all-reduce per parameter at the end of backward, over the MeshDim `dim`. (The
    hooks, no_sync() and the R / n rule of accumulation are ddp.py's ReplicaSync, shared by both rungs.)"""

    def __init__(self, model: nn.Module, dim):
        super().__init__(model, dim)
        self._register_hooks()

    def _after_accumulate(self, p):
        if self._sync:
            self._queue_finish()                 # reduce once, when autograd is done

    def _finish(self):
        comm_ledger.mark("grad_sync.end_of_backward")
        # Which parameters some rank used: a branch not taken here may be taken elsewhere. One small
        # all-reduce of a flag per parameter (ddp.py packs the same flags into its buckets); a
        # parameter no rank used keeps .grad None, as on one process, so AdamW skips it.
        used = torch.tensor([float(p.grad is not None) for p in self.params], dtype=self.params[0].dtype,
                            device=self.params[0].device)
        comm.all_reduce(used, self.dim)
        for p, u in zip(self.params, used.tolist()):   # the same order on every rank: collectives match
            if u == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            comm.all_reduce(p.grad, self.dim)
            self._holds_sum.add(id(p))
        self._callback_queued = False


def replicate_naive(model: nn.Module, dim) -> NaiveGradSync:
    """Sum the gradients of `model` over `dim` after backward, one all-reduce per parameter.
    Same contract as ddp.replicate (same starting weights on every rank; attached as
    `model.grad_sync`)."""
    return attach(model, NaiveGradSync(model, dim), "replicate_naive")
