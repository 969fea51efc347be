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

The autograd Functions f and g, the sequence-parallel pair and their wrappers are mappings.py
(Megatron's name for them); this file holds the modules that use them. Shard layout
(docs/design.md): column-parallel weight = full.chunk(tp, dim=0)[rank], row-parallel
weight = full.chunk(tp, dim=1)[rank], embedding = full.chunk(tp, dim=0)[rank]. Every parameter
carries `tp_split_dim` (None when replicated) so checkpoints and clipping can find the layout.
"""
from __future__ import annotations

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


class _SummableGrad(torch.autograd.Function):
    """Identity on a weight; its backward hands the weight's gradient on as a tensor of its own.

    F.linear's weight gradient is a view (autograd computes it transposed and transposes it back),
    and a view shares its storage with its base. When the weight is also used elsewhere (lm_head
    tied to the embedding) autograd must sum the two gradients, and it adds in place only into a
    tensor that holds its storage alone, so it allocated a third (V/tp, d) buffer for the sum.
    detach() lets go of the view's base: the embedding's gradient is then added into lm_head's, the
    same additions in the same order (bitwise equal), one vocabulary-sized buffer less."""

    @staticmethod
    def forward(ctx, weight):
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad.detach()


class _TPLinear(nn.Module):
    # where the weight gradient goes: None computes it in backward, as F.linear does; a pipeline
    # running a zero-bubble schedule sets a WeightGradStore (minipar/pipeline_parallel/
    # split_backward.py) whose linear() defers dW from the backward (B) to a later W action
    weight_grad_store = None
    # True when the weight is shared with another module (lm_head tied to the embedding): its
    # gradient is handed on so that the two are summed in place (_SummableGrad)
    tied = False

    def _linear(self, x, bias):
        weight = _SummableGrad.apply(self.weight) if self.tied else self.weight
        if self.weight_grad_store is None:
            return F.linear(x, weight, bias)
        return self.weight_grad_store.linear(x, weight, bias)

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
        self.lora = None             # a LoRA adapter (minipar/lora/adapter.py) adds to y_i
        self.reset_parameters()

    def forward(self, x, skip_input_comm: bool = False):
        if self.async_overlap and not skip_input_comm:
            y, = async_column_parallel(x, [self.weight], self.tp, self.sequence_parallel, [self.bias],
                                       self.weight_grad_store)
        else:
            if not skip_input_comm:   # (b, s/tp, h) -> (b, s, h) under SP; f otherwise
                x = enter_tp_region(x, self.tp, self.sequence_parallel)
            y = self._linear(x, self.bias)
            if self.lora is not None:
                y = y + self.lora(x)
        return gather_from_tp_region(y, self.tp, dim=-1) if self.gather_output else y


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
        return async_column_parallel(x, [l.weight for l in layers], first.tp, first.sequence_parallel,
                                     [l.bias for l in layers], first.weight_grad_store)
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
        self.lora = None             # a LoRA adapter adds to the partial sum, before its reduction
        self.reset_parameters()

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp, dim=-1)
        partial = self._linear(x, None)
        if self.lora is not None:    # reduced together with x W^T: no collective of its own
            partial = partial + self.lora(x)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.tp)
        else:
            out = reduce_from_tp_region(partial, self.tp)
        if self.bias is not None:   # added once, after the reduction
            out = out + sequence_parallel_weight(self.bias, self.tp, self.sequence_parallel)
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/tp, (rank+1) * V/tp) of the table; the partial lookups are summed over tp."""

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
