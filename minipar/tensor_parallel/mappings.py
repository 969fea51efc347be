"""Megatron's conjugate communication functions f and g, and sequence parallelism's pair: the
autograd Functions that are all the communication of tensor parallelism (layers.py uses them).

Each is an operation in forward whose backward is its conjugate (Shoeybi et al., 2019; SP:
Korthikanti et al., 2022); activations are (b, s, h), SEQ_DIM = 1:

    f   copy_to_tp_region          forward identity          backward all-reduce of dX
    g   reduce_from_tp_region      forward all-reduce        backward identity
        gather_from_tp_region      forward all-gather(dim)   backward keep this rank's slice
        scatter_to_tp_region       forward keep the slice    backward all-gather(dim)
    SP's f  gather_from_sequence_parallel_region      (b, s/tp, h) -> (b, s, h) all-gather forward,
                                                      reduce-scatter of the gradient backward
    SP's g  reduce_scatter_to_sequence_parallel_region  (b, s, h) partial sums -> (b, s/tp, h)
                                                      reduce-scatter forward, all-gather backward

Each moves b*s*h elements per call; an all-reduce is a reduce-scatter plus an all-gather, so
SP's pair puts on the wire exactly the bytes of the all-reduces it replaces.
With tp = 1 every function is the identity and sends nothing.

enter_tp_region is the input communication of column-parallel layers (f, or SP's all-gather),
done once for the q, k, v (or gate, up) that read the same x; sequence_parallel_weight passes a
replicated weight used on a sequence shard (a norm's) through f, so that its gradient, computed
from s/tp tokens per rank, is summed over tp. The all-reduces work in place, so f's backward and
g's forward reduce a copy: autograd may hand the same buffer to another branch, or have saved it.

Under torch.compile (compile: true, minipar/regional_compile.py) each of these Functions is a
deliberate graph BOUNDARY, not traced: `_boundary` (minipar/graph_boundary.py) runs the
Function eagerly between two compiled graphs, forward and backward.
Tracing them would need functional collectives in place of comm.py's (the ledger, the named
failures, the profiler spans are host-side Python); a layer at tp > 1 costs two graph breaks per
collective point instead (tp 1 calls nothing, so it breaks nothing).
"""
from __future__ import annotations

import torch

from .. import comm
from ..graph_boundary import graph_boundary

SEQ_DIM = 1   # activations are (batch, seq, hidden)


def _split(x: torch.Tensor, dim: int, tp) -> torch.Tensor:
    return x.chunk(tp.size, dim=dim)[tp.rank].contiguous()


class CopyToTPRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        # A copy, not grad.contiguous(): autograd may hand the same gradient buffer to a sibling
        # branch (z = f(x) + w gives dz to both), and an in-place all-reduce would corrupt it.
        return comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.tp), None


class ReduceFromTPRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        # A copy: all_reduce works in place, and x may be saved by the op that made it
        # (x = a.exp() keeps x for its backward), so reducing x itself would corrupt that gradient.
        return comm.all_reduce(x.clone(memory_format=torch.contiguous_format), tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherFromTPRegion(torch.autograd.Function):
    """All-gather along `dim` forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp, dim=-1):
        ctx.tp, ctx.dim = tp, dim
        return comm.all_gather(x, tp, gather_dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.tp), None, None


class ScatterToTPRegion(torch.autograd.Function):
    """Keep this rank's slice along `dim` forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp, dim=-1):
        ctx.tp, ctx.dim = tp, dim
        return _split(x, dim, tp)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.tp, gather_dim=ctx.dim), None, None


class GatherFromSequenceParallelRegion(torch.autograd.Function):
    """SP's f: all-gather along the sequence forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        # contiguous once here: the gathered (b, s, h) is a movedim view, and each of the linears
        # it feeds (q, k, v; gate, up) would otherwise save its own contiguous copy for backward
        return comm.all_gather(x, tp, gather_dim=SEQ_DIM).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter(grad, ctx.tp, scatter_dim=SEQ_DIM), None


class ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """SP's g: reduce-scatter along the sequence forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return comm.reduce_scatter(x, tp, scatter_dim=SEQ_DIM)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.tp, gather_dim=SEQ_DIM), None


@graph_boundary
def _boundary(function, *args):
    """function.apply(*args), never traced by torch.compile: a graph break (module docstring)."""
    return function.apply(*args)


def copy_to_tp_region(x, tp):
    return _boundary(CopyToTPRegion, x, tp) if tp.size > 1 else x


def reduce_from_tp_region(x, tp):
    return _boundary(ReduceFromTPRegion, x, tp) if tp.size > 1 else x


def gather_from_tp_region(x, tp, dim=-1):
    return _boundary(GatherFromTPRegion, x, tp, dim) if tp.size > 1 else x


def scatter_to_tp_region(x, tp, dim=-1):
    return _boundary(ScatterToTPRegion, x, tp, dim) if tp.size > 1 else x


def gather_from_sequence_parallel_region(x, tp):
    return _boundary(GatherFromSequenceParallelRegion, x, tp) if tp.size > 1 else x


def reduce_scatter_to_sequence_parallel_region(x, tp):
    return _boundary(ReduceScatterToSequenceParallelRegion, x, tp) if tp.size > 1 else x


def enter_tp_region(x, tp, sequence_parallel: bool):
    """The input communication of column-parallel layers: f, or SP's all-gather. Done once by a
    caller whose input feeds several column-parallel layers (q, k, v; gate, up), so a block costs
    one collective here, not three; those layers then run with skip_input_comm=True."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, tp)
    return copy_to_tp_region(x, tp)


def sequence_parallel_weight(weight, tp, sequence_parallel: bool):
    """A replicated weight used on a sequence shard sees only part of the tokens: pass it through
    f so that its gradient is summed over tp and stays identical on every tp rank."""
    return copy_to_tp_region(weight, tp) if sequence_parallel else weight
