"""Column-parallel linears whose backward overlaps the input-gradient collective with the
weight-gradient matmul (Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`,
picotron's async linear).

A column-parallel layer Y_i = X W_i^T (W_i: this rank's rows of W) has a backward of two matmuls
and one collective:

    dX_i = dY_i W_i           (b, s, h)   this rank's part of dX; the true dX sums it over tp
    dW_i = dY_i^T X           (out/tp, h) local, needs no communication
    dX   = all-reduce(dX_i)               Megatron's f backward (layers.py CopyToTPRegion)

Plain TP (layers.py) runs them one after the other: the matmul of dX_i, then the all-reduce
(inside f's backward, which autograd runs after the linear's), and dW_i whenever autograd gets to
it. Nothing depends on dX before dW_i is computed, so this module fuses f and the matmuls in one
autograd.Function and orders the backward so the network and the compute work at once:

    dX_i = sum_j dY_j W_j          (every layer that reads X: q, k, v or gate, up: one collective)
    work = all_reduce(dX_i, async) ---- in flight ----+
    dW_j = dY_j^T X, db_j                             |  compute
    work.wait()                    <------------------+
    return dX

With sequence parallelism (Korthikanti et al., 2022) the input of the region is the sequence
shard X_s (b, s/tp, h): forward all-gathers it to X (b, s, h) and keeps only X_s for backward
(Megatron's choice: a second all-gather in backward is cheaper than holding X), and the input
gradient is reduce-scattered back to (b, s/tp, h). Both collectives overlap with a matmul:

    work = all_gather(X_s, async)  ---- in flight ----+
    dX   = sum_j dY_j W_j                             |  compute
    work.wait(): X                 <------------------+
    work = reduce_scatter(dX, async) -- in flight ----+
    dW_j = dY_j^T X, db_j                             |  compute
    work.wait()                    <------------------+

The bytes are exactly plain TP's (tests/test_ladder.py checks the ledger, the outputs, the
gradients and optimizer steps against plain TP); only the time changes (benchmarks/ladder.py).
Several layers that read the same X (q/k/v, gate/up) go through one Function, so a block keeps
one collective per region, as layers.enter_tp_region does for plain TP.

Before computing dW_j the backward asks the layer's `defer_weight_grad` (layers.py's seams; no by
default). Where the answer is yes, someone else kept (X, dY_j) and computes dW_j later (a zero-bubble
pipeline's W action: minipar/pipeline_parallel/split_backward.py), so the collective has no matmul to
hide behind and is simply waited for (the overlap moves to the pipeline: W fills the bubble instead).

Under autocast the forward's matmuls run in the autocast dtype; the backward, which autocast
does not see, casts W and X to the gradient's dtype itself and returns each gradient in its
input's dtype, as autocast's own backward would.

Under torch.compile (compile: true) async_column_parallel is a graph BOUNDARY
(minipar/graph_boundary.py): its Function, with the async collective and the overlapped backward,
runs eagerly between two compiled graphs.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from .. import comm
from ..graph_boundary import graph_boundary
from .mappings import SEQ_DIM


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    """(b, s, ...) -> (s, b, ...) contiguous: the collectives cut and join along dim 0."""
    return x.movedim(SEQ_DIM, 0).contiguous()


class AsyncColumnParallelLinear(torch.autograd.Function):
    """x -> (x W_j^T + b_j for each j), with the input communication of the tp region inside:
    f (identity forward, all-reduce of dX backward), or under SP the all-gather of the sequence
    (reduce-scatter of dX backward); the backward collective overlaps the weight-gradient matmuls."""

    @staticmethod
    def forward(ctx, x, tp, sequence_parallel, n, defer, *weights_and_biases):
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        ctx.tp, ctx.sp, ctx.n, ctx.defer = tp, sequence_parallel, n, defer
        ctx.weights, ctx.biases = weights, biases          # the objects a deferred W accumulates into
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        total = x
        if sequence_parallel:                              # (b, s/tp, h) -> (b, s, h)
            total = comm.all_gather(x, tp, gather_dim=SEQ_DIM)
        ctx.save_for_backward(x, *weights)
        return tuple(F.linear(total, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        tp, dtype = ctx.tp, grads[0].dtype
        work = None
        if ctx.sp:                                         # re-gather X while dX is computed
            xs = _seq_first(x)
            gathered = xs.new_empty((tp.size * xs.shape[0],) + tuple(xs.shape[1:]))
            work = comm.all_gather_into(gathered, xs, tp, async_op=True)
        grad_in = sum(g.matmul(w.to(dtype)) for g, w in zip(grads, weights))    # (b, s, h), partial
        if ctx.sp:
            work.wait()
            total = gathered.movedim(0, SEQ_DIM)
            g_seq = _seq_first(grad_in)
            grad_x = g_seq.new_empty((g_seq.shape[0] // tp.size,) + tuple(g_seq.shape[1:]))
            work = comm.reduce_scatter_into(grad_x, g_seq, tp, async_op=True)
        else:
            total = x
            grad_x = grad_in                               # a fresh tensor: reducing in place is safe
            work = comm.all_reduce(grad_x, tp, async_op=True)
        need = ctx.needs_input_grad[5:]
        grad_w, grad_b, flat_x = [], [], None
        for j, (g, w, b_dtype) in enumerate(zip(grads, weights, ctx.bias_dtypes)):   # collective in flight
            if ctx.defer is not None and ctx.defer[j](ctx.weights[j] if need[j] else None,
                                                      ctx.biases[j] if need[ctx.n + j] else None, total, g):
                grad_w.append(None)                        # dW_j, db_j: computed later, by who kept them
                grad_b.append(None)
                continue
            if flat_x is None:
                flat_x = total.reshape(-1, total.shape[-1]).to(dtype)
            flat_g = g.reshape(-1, g.shape[-1])
            grad_w.append(flat_g.t().matmul(flat_x).to(w.dtype))
            grad_b.append(None if b_dtype is None else flat_g.sum(0).to(b_dtype))
        work.wait()
        if ctx.sp:
            grad_x = grad_x.movedim(0, SEQ_DIM)
        return (grad_x.to(x.dtype), None, None, None, None, *grad_w, *grad_b)


@graph_boundary
def async_column_parallel(x: torch.Tensor, weights: Sequence[torch.Tensor], tp, sequence_parallel: bool,
                          biases: Optional[Sequence[Optional[torch.Tensor]]] = None,
                          defer: Optional[Sequence[Callable]] = None):
    """The outputs x W_j^T (+ b_j) of column-parallel weights that read the same input, with the
    region's input communication fused in and overlapped in backward. x is (b, s, h), or the
    sequence shard (b, s/tp, h) under sequence parallelism. On tp.size == 1: plain linears (the layers
    never come here then: their async_overlap is off at tp 1). defer: one callable per weight,
    defer(weight, bias, x, dy) -> bool, asked before its dW is computed (the layers' defer_weight_grad);
    None: every dW is computed here."""
    biases = list(biases) if biases is not None else [None] * len(weights)
    if tp.size == 1:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    return AsyncColumnParallelLinear.apply(x, tp, sequence_parallel, len(weights), defer, *weights, *biases)
