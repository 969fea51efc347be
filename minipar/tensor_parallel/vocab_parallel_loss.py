"""Cross-entropy over a vocabulary split across the tp ranks, without gathering the logits.

The lm_head is column-parallel, so rank r holds the logits of vocabulary rows
[r*V/tp, (r+1)*V/tp): local_logits (N, V/tp). The loss of token n is

    loss_n = log sum_v exp(z_nv) - z_n,target
           = log sum_r sum_{v in rank r} exp(z_nv - m_n) + m_n - z_n,target

Each piece reduces over tp as N numbers, never N x V: the max m_n (all-reduce MAX, for
stability), then the sum of exponentials and the target logit (only its owner holds it; the others
add 0), both in one all-reduce SUM of 2N numbers. The backward needs no communication:
d loss_n / d z_nv = softmax_nv - [v == target], and each rank holds its slice of the softmax.
Megatron-LM's vocab-parallel cross-entropy (Shoeybi et al., 2019).

Under torch.compile (compile: true) the loss is in no compiled region: the regions are the decoder
layers (minipar/regional_compile.py), and the loss runs eagerly after them, its all-reduces as written.
"""
from __future__ import annotations

import torch

from .. import comm


# ------------------------------------------------------------------- vocab-parallel loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss log(sum_v exp(z_v)) - z_target from logits split over the vocabulary."""

    @staticmethod
    def forward(ctx, local_logits, labels, tp, vocab_start, ignore_index):
        z = local_logits.to(torch.promote_types(local_logits.dtype, torch.float32))   # fp32 at least
        z_max = z.max(dim=-1).values
        comm.all_reduce(z_max, tp, op="max")                 # (N,) numbers, not (N, V)
        z = z - z_max.unsqueeze(-1)                          # stable: the global max is 0
        exp = z.exp()
        sum_exp = exp.sum(dim=-1)
        local_v = z.shape[-1]
        target = labels - vocab_start
        inside = (target >= 0) & (target < local_v) & (labels != ignore_index)
        target = target.masked_fill(~inside, 0)
        z_target = z.gather(-1, target.unsqueeze(-1)).squeeze(-1) * inside
        both = torch.stack([sum_exp, z_target])               # one all-reduce for the two sums
        comm.all_reduce(both, tp)
        sum_exp, z_target = both[0], both[1]
        valid = labels != ignore_index
        loss = (sum_exp.log() - z_target) * valid
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), target, inside, valid)
        ctx.in_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, target, inside, valid = ctx.saved_tensors
        grad = softmax                                        # d loss / d z = softmax - onehot(target)
        grad.scatter_add_(-1, target.unsqueeze(-1), -inside.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(local_logits, labels, tp, ignore_index=-100, reduction="mean"):
    """Cross-entropy of logits (..., V/tp) split over tp by vocabulary rows (rank r holds ids
    [r*V/tp, (r+1)*V/tp)); labels (...). reduction "mean" (over non-ignored tokens), "sum" or "none"."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    vocab_start = tp.rank * local_logits.shape[-1]
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    loss = _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1), tp, vocab_start, ignore_index)
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum().clamp(min=1)
