"""Attention under a dense boolean mask: SDPA's, or explicit scores when the logits are soft-capped.

The masked paths (a sliding window's band and packed documents at cp 1, the all-gather form of
context parallelism in window_attention.py, generation's KV cache in models/kv_cache.py) hand one
boolean mask, True where a query may see a key, broadcastable to (b, H, Lq, Lk). Gemma 2 also
soft-caps the attention logits, so that no score grows past a cap c (attn_logit_softcapping, 50):

    s   = q k^T / sqrt(D)             (b, H, Lq, Lk)   the layer's q already carries Gemma's
                                                        query_pre_attn_scalar (LlamaConfig.query_scale)
    s   = c * tanh(s / c)             smooth, |s| < c; d/ds = 1 - tanh(s / c)^2
    p   = softmax(s where mask, else -inf)     in fp32, then the input's dtype (transformers' eager)
    out = p v                         (b, H, Lq, D)

No fused kernel (flash, memory-efficient, cuDNN, the CPU flash kernel) takes a function of the
scores between the matmul and the softmax: they never hold the scores, and their online softmax
rescales partial sums by the running maximum, which a tanh in between does not commute with. So a
capped layer materializes them: O(b H Lq Lk) memory (fp32 probabilities plus the scores and their
tanh in the input dtype) and the math kernel's time, the price transformers' eager path pays too;
sequences long enough to make it matter are where Gemma 2's 4096-token windows are what binds.
Without a cap this is one SDPA call with the mask (its kernel as SDPA chooses for a masked call).
GQA: SDPA broadcasts the KV heads to their query groups (enable_gqa, torch >= 2.5: no copy, what
the KV cache's decode step wants); the capped path, and torch 2.4, repeat K/V to the query heads
(b, H, Lk, D).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["masked_attention"]

_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)   # SDPA's enable_gqa


def masked_attention(q, k, v, mask, softcap: Optional[float] = None) -> torch.Tensor:
    """q (b, H, Lq, D), k and v (b, Hkv, Lk, D), mask bool broadcastable to (b, H, Lq, Lk) (every
    row with at least one True); softcap: the logit cap c, or None. -> (b, H, Lq, D)."""
    groups = q.shape[1] // k.shape[1]
    if softcap is None and groups > 1 and _ENABLE_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)
