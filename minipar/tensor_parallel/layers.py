"""Tensor parallelism: split the weight matrices of a block over the tp ranks (Megatron-LM).

Shoeybi et al., "Megatron-LM" (2019): an MLP  Y = GeLU(X A) B  is split by columns of A and rows
of B, so each rank computes its slice of the hidden layer without talking, and one all-reduce
sums the partial outputs:

         X (b, s, h) -- replicated on every tp rank
         |  f: identity forward, all-reduce of dX backward
         v
    [ X A_1 | X A_2 ]      ColumnParallelLinear: A = [A_1 | A_2], A_i = A.chunk(tp, dim=out)[i]
         |  act                                   (each rank: (b, s, 4h/tp); nothing sent)
         v
    [ Y_1 B_1 + Y_2 B_2 ]  RowParallelLinear: B = [B_1; B_2], B_i = B.chunk(tp, dim=in)[i]
         |  g: all-reduce forward, identity backward
         v
         Z (b, s, h) -- replicated again

f and g are conjugate: each is the other's backward. Attention splits the same way by heads (q, k,
v column-parallel, each rank keeps heads/tp heads; o row-parallel). Per block: 2 all-reduces of
b*s*h forward (after o_proj and down_proj), 2 backward (the f before q/k/v and before gate/up).
The next rung, async_linear.py (`tp_async_overlap`), fuses f with the column-parallel matmuls and
overlaps that backward all-reduce with the weight-gradient matmul.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation", 2022): between
the tensor-parallel regions the activations are replicated, so the norms and residuals repeat the
same work on every rank. Split them along the sequence instead: g becomes a reduce-scatter along
the sequence (b, s, h) -> (b, s/tp, h), and f becomes an all-gather (b, s/tp, h) -> (b, s, h). An
all-reduce *is* a reduce-scatter plus an all-gather, so the bytes are the same; activations and
norm work outside the matrix products shrink by tp. Weights used on a sequence shard (the norms)
then see only part of the tokens: their gradients are summed over tp by passing the weight
through f (identity forward, all-reduce backward).

The vocabulary is split too: VocabParallelEmbedding keeps rows of the embedding table (ids outside
the local range give zeros, the partial outputs are summed), the lm_head is column-parallel, and
vocab_parallel_cross_entropy computes the loss from the local logits (b, s, V/tp) with two
small all-reduces: the max (b*s numbers), then the sum of exponentials and the target logit
together (2*b*s numbers). The full (b, s, V) logits never exist on one rank (vocab_parallel_loss.py).

Sequence parallelism needs a sequence to split: generation's decode step has one token a row.
`sequence_parallel_off(model)` is a mode the caller sets around such forwards (no gradient):
inside it every layer below built with SP runs its plain-TP path (the residual replicated: the
embedding and row-parallel layers all-reduce instead of reduce-scattering, the column-parallel
ones enter with f instead of all-gathering), the same function of the same weights; the layers
themselves have no generation branch.

The autograd Functions f and g, the sequence-parallel pair and their wrappers are mappings.py
(Megatron's name for them); this file holds the modules that use them. Shard layout
(docs/design.md): column-parallel weight = full.chunk(tp, dim=0)[rank], row-parallel
weight = full.chunk(tp, dim=1)[rank], embedding = full.chunk(tp, dim=0)[rank]. Every parameter
carries `tp_split_dim` (None when replicated) so checkpoints and clipping can find the layout.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from .async_linear import async_column_parallel
from .mappings import (
    enter_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    sequence_parallel_weight,
)


# ------------------------------------------------------------------------- layout helpers
def shard_tensor(full: torch.Tensor, split_dim, tp) -> torch.Tensor:
    """This rank's slice of a full tensor: full.chunk(tp.size, dim=split_dim)[tp.rank]."""
    if split_dim is None or tp.size == 1:
        return full
    if full.shape[split_dim] % tp.size:
        raise ValueError(f"cannot split dim {split_dim} of size {full.shape[split_dim]} "
                         f"over tp_size={tp.size}")
    return full.chunk(tp.size, dim=split_dim)[tp.rank].contiguous()


def gather_tensor(local: torch.Tensor, split_dim, tp) -> torch.Tensor:
    """The full tensor from the slices of all tp ranks (inverse of shard_tensor)."""
    if split_dim is None or tp.size == 1:
        return local
    return comm.all_gather(local.contiguous(), tp, gather_dim=split_dim)


# --------------------------------------------------------------------------------- layers
def _check_divisible(what: str, value: int, tp) -> int:
    if value % tp.size:
        raise ValueError(f"{what}={value} is not divisible by tp_size={tp.size}: "
                         f"choose a tp_size that divides it")
    return value // tp.size


def _param(shape, split_dim, full_shape):
    p = nn.Parameter(torch.empty(shape))
    p.tp_split_dim, p.tp_full_shape = split_dim, tuple(full_shape)
    return p


class _TPLinear(nn.Module):
    """What Column- and RowParallelLinear share: the shard's init, and the three seams through which
    another technique changes the layer without the layer knowing it (each set on the instance):

        local_linear(x, weight, bias)       this rank's matmul x W_t^T (+ b_t): F.linear. Replaced
                                            where the weight must enter it otherwise or its gradient
                                            be computed otherwise (a zero-bubble pipeline's deferred
                                            dW, split_backward.py; a tied lm_head, models/tied_weights.py)
        defer_weight_grad(weight, bias, x, dy) -> bool
                                            asked by the fused column backward (async_linear.py) before
                                            it computes dW = dy^T x: True means the caller kept (x, dy)
                                            and computes dW itself later; here, False: compute it now
        output_addends                      callables x -> tensor, each added to this rank's local
                                            output (row-parallel: to the partial sum, BEFORE the
                                            reduction, so it rides the layer's one collective); x is
                                            the local input (lora/adapter.py's adapters)

    With no seam touched the layer is plain TP: the same operations, in the same order."""

    def local_linear(self, x, weight, bias):
        return F.linear(x, weight, bias)

    def defer_weight_grad(self, weight, bias, x, dy) -> bool:
        return False

    def _local_output(self, x, bias):
        """x W_t^T (+ b_t) plus every addend, in this rank's coordinates (a partial sum when row-parallel)."""
        y = self.local_linear(x, self.weight, bias)
        for addend in self.output_addends:
            y = y + addend(x)
        return y

    def reset_parameters(self, std: float = 0.02, generator=None):
        """Draw the full weight (same on every rank for the same generator state), keep the slice."""
        with torch.no_grad():
            for p in self.parameters():
                if p.is_meta:                # built on the meta device: filled later, by a weight source
                    continue
                # on the CPU, where `generator` lives (a CUDA default device would refuse it)
                full = torch.empty(p.tp_full_shape, device="cpu")
                if p.dim() == 1 and p is getattr(self, "bias", None):
                    full.zero_()
                else:
                    full.normal_(0.0, std, generator=generator)
                p.copy_(shard_tensor(full, p.tp_split_dim, self.tp))

    def extra_repr(self):
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_TPLinear):
    """Y_i = X A_i^T (+ b_i): the weight (out/tp, in) is full.chunk(tp, dim=0)[rank]."""

    def __init__(self, in_features, out_features, tp, bias=False, gather_output=False,
                 sequence_parallel=False, async_overlap=False):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel and tp.size > 1
        self.async_overlap = async_overlap and tp.size > 1    # async_linear.py: overlapped backward
        local_out = _check_divisible("out_features", out_features, tp)
        self.weight = _param((local_out, in_features), 0, (out_features, in_features))
        self.bias = _param((local_out,), 0, (out_features,)) if bias else None
        self.output_addends = []     # added to y_i (_TPLinear's seams)
        self.reset_parameters()

    def forward(self, x, skip_input_comm: bool = False):
        """skip_input_comm: x has already entered the tp region (column_parallel_group did it once
        for every layer that reads x)."""
        if self.async_overlap and not skip_input_comm:
            y, = _async_group(x, (self,))
        else:
            if not skip_input_comm:   # (b, s/tp, h) -> (b, s, h) under SP; f otherwise
                x = enter_tp_region(x, self.tp, self.sequence_parallel)
            y = self._local_output(x, self.bias)
        return gather_from_tp_region(y, self.tp, dim=-1) if self.gather_output else y


def _async_group(x, layers):
    """The layers' outputs through async_linear.py's one fused Function (the input collective inside,
    overlapped in backward), which computes their matmuls itself: no local_linear, no addends."""
    with_addends = [type(l).__name__ for l in layers if l.output_addends]
    if with_addends:
        raise ValueError(f"{with_addends} with async_overlap carry output_addends (a LoRA adapter?), which "
                         f"the fused column-parallel backward does not compute; set tp_async_overlap: false")
    return async_column_parallel(x, [l.weight for l in layers], layers[0].tp, layers[0].sequence_parallel,
                                 [l.bias for l in layers], [l.defer_weight_grad for l in layers])


def column_parallel_group(x, layers):
    """The outputs of column-parallel layers that read the same x (q, k, v; gate, up), with ONE
    input collective for all of them: enter_tp_region then the layers, or, with async_overlap,
    one async_linear Function whose backward overlaps that collective with the weight gradients."""
    first = layers[0]
    if any((l.tp, l.sequence_parallel, l.async_overlap)
           != (first.tp, first.sequence_parallel, first.async_overlap) for l in layers):
        raise ValueError("column_parallel_group: the layers must share tp, sequence_parallel "
                         "and async_overlap")
    if first.async_overlap:
        return _async_group(x, layers)
    x = enter_tp_region(x, first.tp, first.sequence_parallel)
    return tuple(l(x, skip_input_comm=True) for l in layers)


class RowParallelLinear(_TPLinear):
    """Z = sum_i Y_i B_i^T (+ b): the weight (out, in/tp) is full.chunk(tp, dim=1)[rank]."""

    def __init__(self, in_features, out_features, tp, bias=False, input_is_parallel=True,
                 sequence_parallel=False):
        super().__init__()
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel and tp.size > 1
        local_in = _check_divisible("in_features", in_features, tp)
        self.weight = _param((out_features, local_in), 1, (out_features, in_features))
        self.bias = _param((out_features,), None, (out_features,)) if bias else None
        self.output_addends = []     # added to the partial sum, before its reduction (_TPLinear's seams)
        self.reset_parameters()

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp, dim=-1)
        partial = self._local_output(x, None)   # addends reduced with x W^T: no collective of their own
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp)
        else:
            out = reduce_from_tp_region(partial, self.tp)
        if self.bias is not None:   # added once, after the reduction
            out = out + sequence_parallel_weight(self.bias, self.tp, self.sequence_parallel)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/tp, (rank+1) * V/tp) of the table; the partial lookups are summed over tp."""

    # a lookup: its weight's gradient is a scatter-add of the output gradient, never reading the
    # weight, so ZeRO-3 need not gather it again for backward (zero3/unit.py asks)
    backward_reads_weight = False

    def __init__(self, num_embeddings, embedding_dim, tp, sequence_parallel=False):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.sequence_parallel = sequence_parallel and tp.size > 1
        local = _check_divisible("num_embeddings (vocab_size)", num_embeddings, tp)
        self.vocab_start, self.vocab_end = tp.rank * local, (tp.rank + 1) * local
        self.weight = _param((local, embedding_dim), 0, (num_embeddings, embedding_dim))
        with torch.no_grad():
            self.weight.copy_(shard_tensor(torch.randn(num_embeddings, embedding_dim), 0, tp))

    def forward(self, ids):
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp)
        return reduce_from_tp_region(partial, self.tp)

    def extra_repr(self):
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size}, "
                f"rows=[{self.vocab_start}, {self.vocab_end})")


@contextlib.contextmanager
def sequence_parallel_off(module: nn.Module):
    """Inside: the layers of `module` built with sequence parallelism run their plain-TP path (the
    module docstring), restored after. For forwards without gradient only: the replicated weights
    used on a sequence shard (norms, an MoE's router and experts) keep their SP wiring, which sums
    their gradients over tp, right only when each rank saw part of the sequence."""
    if torch.is_grad_enabled():
        raise RuntimeError("sequence_parallel_off is for forwards without gradient (torch.no_grad())")
    kinds = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    switched = [m for m in module.modules() if isinstance(m, kinds) and m.sequence_parallel]
    for m in switched:
        m.sequence_parallel = False
    try:
        yield
    finally:
        for m in switched:
            m.sequence_parallel = True
