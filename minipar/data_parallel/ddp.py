"""Data parallelism: every replica holds the whole model, reads its own samples, and the replicas
sum their gradients, bucket by bucket, while backward is still running. (The rung below it,
naive.py, reduces parameter by parameter after backward; `ddp: naive | bucketed`.)

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020),
the design of torch's DistributedDataParallel. One all-reduce per parameter would pay the
latency of a collective hundreds of times; one all-reduce of everything at the end would not
overlap with backward. So parameters are grouped into buckets of about 25 MB, in REVERSE
registration order (the order backward produces their gradients), and a bucket's all-reduce is
launched, asynchronously, as soon as its last gradient has been accumulated:

    backward:   grads of layer L-1 ... ready -> [bucket 0] all-reduce in flight
                grads of layer L-2 ... ready -> [bucket 1] all-reduce in flight     (compute goes on)
                ...
    end of backward (autograd callback): wait for all buckets, write the sums into p.grad

    bucket k = cat(p.grad.view(-1) for p in bucket)  (bytes_k)  --all-reduce(sum) over dim-->  p.grad

Communication per step and rank: an all-reduce of every gradient, 2 (n-1)/n * G bytes for
gradient bytes G over n replicas. Buckets are launched strictly in index order, the same order
on every rank (collectives must match), even when one becomes ready before the previous one.

Gradients are SUMMED, not averaged: the loss is already divided by the token count of the global
batch, so the sum over replicas is the single-process gradient. `dim` is the group of ranks that
hold the same parameters and see different tokens: pgm.dp_cp when nothing is sharded (replicas and
context-parallel ranks alike), pgm.dp_replicate in general. (HSDP, sharded within a replica and
replicated across, is minipar/zero3/'s business: it all-reduces its shard gradients itself.)

Gradient accumulation: inside `with sync.no_sync():` the hooks do nothing and gradients add up
locally; the backward of the last micro-batch, outside it, reduces the accumulated sum, so a step
communicates once. (Accumulating without no_sync is also right, only slower: a gradient that
already holds a reduced sum R is first divided by n, so that the next reduction gives back R
plus the sum of the new gradients, instead of n R.)

Parameters that get no gradient in a step (a branch not taken) contribute zeros, and their
bucket is launched at the end of backward: no rank waits for a gradient that never comes. (Every
rank must still backpropagate into at least one parameter: the first gradient starts the sync.)
A parameter that NO rank used keeps .grad None, as on one process and under ZeRO-3, so AdamW
skips it (a zero gradient would still decay it). To know "no rank", each bucket carries one used
flag per parameter after its gradients, summed by the same all-reduce (torch DDP's
local_used_map, without a collective of its own): 4 bytes per parameter, next to its gradient.
A rank that had a gradient for every parameter of a bucket knows without looking that some rank
used each; only a bucket with a parameter this rank left unused reads the summed flags back to
the host (a sync on a GPU), so a step of a model whose every parameter trains reads none.

    bucket k = [ grad p0 | grad p1 | ... | used p0, used p1, ... ]   --all-reduce(sum)-->
               p.grad = the summed slice where used > 0, else None

Under torch.compile (compile: true) the hooks stay outside every compiled region: they fire at each
parameter's AccumulateGrad, after the compiled backward of its layer has produced the gradient.
"""
from __future__ import annotations

import contextlib
from typing import List

import torch
import torch.nn as nn

from .. import comm, comm_ledger


class Bucket:
    def __init__(self, params: List[nn.Parameter]):
        self.params = params
        self.ready: set = set()
        self.work = self.flat = None
        self.all_used = True                     # every parameter had a gradient on this rank


class ReplicaSync:
    """What both rungs of the DDP ladder share (naive.py's per-parameter version and the bucketed
    GradSync below): the parameters, the two gradient hooks, no_sync(), and the rule that a gradient
    already holding a reduced sum R becomes R / n before the next backward adds to it. Subclasses
    say what happens when a gradient is ready (`_after_accumulate`) and at the end of backward."""

    def __init__(self, model: nn.Module, dim):
        self.dim = dim
        self.params = [p for p in model.parameters() if p.requires_grad]    # tied parameters once
        self._sync = True
        self._callback_queued = False
        self._holds_sum: set = set()             # ids of params whose .grad is an already-reduced sum

    def _register_hooks(self):
        if self.dim.size > 1:
            for p in self.params:
                p.register_hook(lambda grad, p=p: self._before_accumulate(p))
                p.register_post_accumulate_grad_hook(self._after_accumulate)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally, without communicating."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _before_accumulate(self, p):
        if id(p) in self._holds_sum:
            self._holds_sum.discard(id(p))
            if p.grad is not None:               # R / n now, so that the next sum gives R back
                p.grad.div_(self.dim.size)

    def _after_accumulate(self, p):
        raise NotImplementedError

    def _queue_finish(self):
        """Once per backward: run _finish when autograd is done."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self):
        raise NotImplementedError


def attach(model: nn.Module, sync: ReplicaSync, who: str) -> ReplicaSync:
    """Attach `sync` as model.grad_sync, refusing a model ZeRO-3 already reduces. A ZeRO-3 model
    whose shards are all frozen (LoRA's base) reduces nothing: the trainable parameters it left
    out of its flat buffers (the adapters, whole on every rank) are all-reduced here."""
    zero3 = getattr(model, "zero3", None)
    if zero3 is not None and any(s.requires_grad for s in zero3.shards):
        raise ValueError(f"{who}: the model is sharded by ZeRO-3, which already reduces over "
                         "dp_replicate (HSDP); use one of the two, not both")
    model.grad_sync = sync
    return sync


class GradSync(ReplicaSync):
    """The gradient all-reduce of a replicated model; what `replicate` returns (and attaches as
    `model.grad_sync`). After loss.backward() returns, every p.grad holds the sum over `dim`."""

    def __init__(self, model: nn.Module, dim, bucket_size_mb: float = 25):
        if not bucket_size_mb > 0:
            raise ValueError(f"replicate: bucket_size_mb must be > 0, got {bucket_size_mb!r}")
        super().__init__(model, dim)
        self.buckets: List[Bucket] = []
        current, nbytes, limit = [], 0, bucket_size_mb * 2 ** 20
        for p in reversed(self.params):
            if current and (nbytes + p.numel() * p.element_size() > limit or p.dtype != current[0].dtype
                            or p.device != current[0].device):
                self.buckets.append(Bucket(current))
                current, nbytes = [], 0
            current.append(p)
            nbytes += p.numel() * p.element_size()
        if current:
            self.buckets.append(Bucket(current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0                           # the next bucket to launch (index order)
        self._register_hooks()

    # ------------------------------------------------------------------ hooks
    def _after_accumulate(self, p):
        if not self._sync:
            return
        self._queue_finish()
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        self._launch_ready()

    def _launch_ready(self, force: bool = False):
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if not force and len(bucket.ready) < len(bucket.params):
                return                           # strictly in order, the same on every rank
            # the used flags are made on the device (a fill, not a copy from the host, which would
            # stop the autograd thread until the GPU drained): ones, with a zero for each parameter
            # this rank has no gradient for
            first = bucket.params[0]
            used = torch.ones(len(bucket.params), dtype=first.dtype, device=first.device)
            for i, p in enumerate(bucket.params):
                if p.grad is None:
                    used[i] = 0.0
            bucket.all_used = all(p.grad is not None for p in bucket.params)
            bucket.flat = torch.cat([self._contribution(p).reshape(-1) for p in bucket.params] + [used])
            bucket.work = comm.all_reduce(bucket.flat, self.dim, async_op=True)
            self._next += 1

    def _contribution(self, p):
        if p.grad is None:
            return torch.zeros_like(p)
        if id(p) in self._holds_sum:           # no new gradient since the last sum R: send R / n, the
            return p.grad / self.dim.size      # same share as every other rank, so the sum stays R
        return p.grad

    def _finish(self):
        comm_ledger.mark("grad_sync.end_of_backward")
        self._launch_ready(force=True)           # buckets holding parameters that got no gradient
        for bucket in self.buckets:
            bucket.work.wait()
            # used by this rank -> used by some rank: the flags are read (a device-to-host copy,
            # a sync on a GPU) only when this rank left a parameter of the bucket without gradient
            offset, used = 0, [1.0] * len(bucket.params)
            if not bucket.all_used:
                used = bucket.flat[-len(bucket.params):].tolist()
            for p, u in zip(bucket.params, used):
                if u > 0:                        # some rank used it; else it stays None everywhere
                    p.grad = bucket.flat[offset:offset + p.numel()].view_as(p)
                    self._holds_sum.add(id(p))
                offset += p.numel()
            bucket.ready, bucket.work, bucket.flat = set(), None, None
        self._next, self._callback_queued = 0, False


def replicate(model: nn.Module, dim, bucket_size_mb: float = 25) -> GradSync:
    """Sum gradients of `model` over the MeshDim `dim` (pgm.dp_replicate, or pgm.dp_cp when nothing
    is sharded), overlapped with backward. Every rank must start from the same weights (minipar's
    seeded initialisation gives that). Returns the GradSync, also attached as `model.grad_sync`."""
    return attach(model, GradSync(model, dim, bucket_size_mb), "replicate")
