"""Tied input and output embeddings (`tie_word_embeddings`): the lm_head's weight IS the embedding's
table, one Parameter used twice, and its gradient the sum of the two uses'.

    embed_tokens   VocabParallelEmbedding   weight E (V/tp, d)   h = E[ids]           (rows of E)
    lm_head        ColumnParallelLinear     weight E, the same   logits_t = h E_t^T   (b, s, V/tp)
    dE = dE_head + dE_embed       dE_head = dlogits^T h (a matmul), dE_embed a scatter-add of dh

Both tensor-parallel layers keep the same vocabulary rows, E.chunk(tp, dim=0)[rank], so tying holds
on every layout with no communication. It costs nothing but the order of the sum: backward reaches
the lm_head first, so its gradient is what autograd holds when the embedding's arrives, and autograd
adds the second in place only into a tensor that holds its storage alone. F.linear's weight gradient
is a view (computed transposed, transposed back), so autograd would allocate a third (V/tp, d)
buffer for the sum. SummableGrad hands the head's gradient on detached, and the embedding's is then
added into it: the same additions in the same order (bitwise equal), one vocabulary-sized buffer less
(tests/test_llama.py counts the add_; the planner's peak, minipar/plan/peak.py, assumes it).

How: the lm_head's matmul seam (`local_linear`, minipar/tensor_parallel/layers.py's _TPLinear) is
set to summable_linear on that one instance; the layer itself knows nothing of tying.

Under pipeline parallelism the two ends usually sit on different ranks: each then holds a copy of E
(the last stage keeps the embedding module for its lm_head, never calling it, so it has no embedding
gradient to add), and the copies' gradients are summed once per step over the first and last stage
(minipar/pipeline_parallel/tied_ends.py). Where both ends share a rank (zbv's rank 0) the pair stays
one Parameter, as here; a zero-bubble schedule splits the lm_head's matmul instead of summing in place.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SummableGrad(torch.autograd.Function):
    """Identity on a weight; its backward hands the weight's gradient on as a tensor of its own
    (detach() lets go of the view's base)."""

    @staticmethod
    def forward(ctx, weight):
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad.detach()


def summable_linear(x, weight, bias=None):
    """F.linear whose weight gradient can take another gradient in place (a tied lm_head's matmul)."""
    return F.linear(x, SummableGrad.apply(weight), bias)


def tie_weights(lm_head: nn.Module, embedding: nn.Module, sum_in_place: bool = True) -> None:
    """lm_head.weight = embedding.weight (the same Parameter: state dicts keep both names), and,
    with sum_in_place, the head's matmul set to summable_linear; without, its plain matmul (the
    gradients are the same bits, one buffer more: what tests/test_llama.py compares against)."""
    lm_head.weight = embedding.weight
    if sum_in_place:
        lm_head.local_linear = summable_linear
    else:
        vars(lm_head).pop("local_linear", None)          # back to the class's F.linear
