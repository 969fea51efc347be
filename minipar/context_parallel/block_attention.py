"""The reference math of one attention block: a query block against one key/value block.

Ring attention (ring_attention.py) never sees the whole score matrix: it attends its queries to
one K/V block at a time and merges the partial results. To merge, each block must hand back not
only its softmax-normalised output but the log of its softmax denominator, per query row:

    q (B, Hq, Tq, D)    k, v (B, Hkv, Tk, D)    Hq = G * Hkv  (grouped-query attention)

    S   = scale * q k^T                       (B, Hq, Tq, Tk)   the scores, -inf where masked
    lse = log sum_j exp S[.., j]              (B, Hq, Tq)       fp32 (fp64 for fp64 inputs)
    out = exp(S - lse) v                      (B, Hq, Tq, D)

A row that sees no key of this block (every score masked) has lse = -inf and out = 0, which the
ring's merge adds as nothing. The backward of a block, given the FINAL out and lse of each row
(after all blocks were merged), is the flash-attention backward restricted to this block (Dao,
"FlashAttention-2", 2023, Algorithm 2), in six steps:

    1. S  = scale * q k^T, masked          recompute the scores: the forward kept only out and lse
    2. P  = exp(S - lse)                   this block's slice of the TRUE softmax of the row
    3. dv = P^T dout                       (B, Hkv, Tk, D), the G query heads of a group summed
    4. dP = dout v^T                       (B, Hq, Tq, Tk)
    5. Di = rowsum(dout * out)             (B, Hq, Tq): sum_j P_ij dP_ij, the softmax's own term
       dS = P * (dP - Di)
    6. dq = scale * dS k      dk = scale * dS^T q

The mask. `allowed(...)` builds which (query, key) pairs may attend: causal on a square block
(query i sees keys 0..i), and, for packed sequences, only pairs of the same document
(document_ids, one id per token, equal within one packed example). The ring schedule asks for a
causal mask only on square blocks, so the diagonal is never ambiguous.

This file is plain torch in fp32 (or fp64), materialising the block's scores: the math to read
and to check against. fused_attention.py sends a block to torch's fused kernels instead, where
they exist; document_attention.py cuts a block by packed documents into per-document
sub-blocks. GQA here broadcasts over the G query heads of a group, (B, Hkv, G, Tq, Tk), and never
copies K/V.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def allowed(tq: int, tk: int, causal: bool, q_doc: Optional[torch.Tensor] = None,
            k_doc: Optional[torch.Tensor] = None, device=None) -> Optional[torch.Tensor]:
    """Which (query, key) pairs attend: (1 or B, Tq, Tk) bool, or None for "all of them".
    q_doc (B, Tq) and k_doc (B, Tk) are the document ids of the rows and columns."""
    mask = None
    if causal:
        mask = torch.ones(tq, tk, dtype=torch.bool, device=device).tril_()[None]
    if q_doc is not None:
        same = q_doc[:, :, None] == k_doc[:, None, :]
        mask = same if mask is None else mask & same
    return mask


def _grouped(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, G*Hkv, T, D) -> (B, Hkv, G, T, D): the query heads that share one K/V head."""
    b, h = x.shape[:2]
    return x.reshape(b, hkv, h // hkv, *x.shape[2:])


def scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Step 1: S = scale * q k^T, -inf where `mask` is False. (B, Hkv, G, Tq, Tk) in acc_dtype."""
    acc = acc_dtype(q)
    s = torch.matmul(_grouped(q.to(acc), k.shape[1]), k.to(acc)[:, :, None].transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # a row with no visible key has lse = -inf; exp(S - 0) = exp(-inf) = 0 keeps its P at zero
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def reference_forward(q, k, v, scale: float, mask: Optional[torch.Tensor] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """-> out (B, Hq, Tq, D) and lse (B, Hq, Tq), both in acc_dtype(q)."""
    b, hq, tq, _ = q.shape
    s = scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)                                  # (B, Hkv, G, Tq)
    p = torch.exp(s - _finite(lse)[..., None])
    out = torch.matmul(p, v.to(s.dtype)[:, :, None])                  # (B, Hkv, G, Tq, D)
    return out.reshape(b, hq, tq, -1), lse.reshape(b, hq, tq)


def reference_backward(dout, q, k, v, out, lse, scale: float, mask: Optional[torch.Tensor] = None
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The six steps of the module docstring, for the FINAL out and lse of the rows.
    -> dq (B, Hq, Tq, D), dk and dv (B, Hkv, Tk, D), in acc_dtype(q)."""
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    s = scores(q, k, scale, mask)                                                       # 1.
    acc = s.dtype
    p = torch.exp(s - _finite(_grouped(lse.to(acc), hkv))[..., None])                  # 2.
    do = _grouped(dout.to(acc), hkv)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)                                  # 3.
    dp = torch.matmul(do, v.to(acc)[:, :, None].transpose(-1, -2))                     # 4.
    di = (do * _grouped(out.to(acc), hkv)).sum(-1, keepdim=True)                       # 5.
    ds = p * (dp - di)
    dq = torch.matmul(ds, k.to(acc)[:, :, None]).reshape(b, hq, tq, d) * scale         # 6.
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(q.to(acc), hkv)).sum(2) * scale
    return dq, dk, dv
