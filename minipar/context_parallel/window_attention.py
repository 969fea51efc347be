"""Sliding-window (or soft-capped) attention across cp ranks: the keys and values all-gathered, one mask.

A sliding window W (Mistral, Phi-3, Qwen2's and Gemma's windowed layers) lets the query at position
i see the keys at max(0, i-W+1)..i only. The ring (ring_attention.py) and Ulysses schedule whole
blocks of the causal triangle and merge them by log-sum-exp; their blocks know documents, not
distances, and their merge cannot hold Gemma 2's soft-capped logits (masked_attention.py: the cap
sits between the scores and the softmax, where no fused block kernel lets anything in). So when a
window binds (W < the sequence length T), or a layer caps its logits, the layer takes the simplest
exact route instead,
the all-gather form of context parallelism (Llama 3's, for its document masks): each rank gathers
every rank's K/V and attends its own L = T/cp queries against all T keys with one dense mask.

    q (B, Hq, L, D) stays          k, v (B, Hkv, L, D) -> all-gathered over cp -> (B, Hkv, T, D)
    keys arrive in rank order: [rank 0's share | rank 1's | ...], each share in the cp layout
    (zigzag: chunks c and 2cp-1-c), so the mask is built from the TRUE positions of both sides:

        mask[i, j] = pos_k[j] <= pos_q[i]  and  pos_k[j] > pos_q[i] - W   (and the same document)
                     (no window, W None: the causal part alone)

    out (B, Hq, L, D) = softmax(q k^T / sqrt(D) + mask) v           one SDPA call, GQA broadcast
                        (soft-capped: explicit scores, masked_attention.py)

Packed documents (`Documents`, documents.py) add their block-diagonal mask from the host's ids of
every share (no communication: Documents holds the whole sequence). The positions are the sequence
indices, not the position_ids that restart per document: a window counts tokens of the row, as
transformers' sliding-window mask does.

Cost per windowed layer and rank: forward one all-gather of K and V ((cp-1)/cp * 2 * B * Hkv * T *
D elements on the wire, Llama 3's figure), backward one reduce-scatter of dK and dV of the same size
(tensor_parallel's sequence-parallel gather, reused over the cp group); memory an fp32-or-input
(B, Hq, L, T) score matrix and (B, 2Hkv, T, D) of gathered K/V: O(L T), not the ring's O(L^2).
The window's saving (only W keys per query) is not taken here: exactness first.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from ..tensor_parallel.mappings import gather_from_sequence_parallel_region
from .documents import Documents
from .layouts import shard_sequence
from .masked_attention import masked_attention

__all__ = ["window_positions", "window_attention"]


def window_positions(seq_len: int, cp_size: int, layout: str, device=None) -> torch.Tensor:
    """The true positions of every rank's share, in rank order: what the all-gather lines up (T,)."""
    full = torch.arange(seq_len, device=device)[None]
    return torch.cat([shard_sequence(full, 1, SimpleNamespace(rank=r, size=cp_size), layout)[0]
                      for r in range(cp_size)])


def window_attention(q, k, v, cp, window: Optional[int], layout: str = "zigzag", documents=None,
                     softcap: Optional[float] = None) -> torch.Tensor:
    """Causal attention with a sliding `window` (None: none) of this rank's queries q (B, Hq, L, D)
    over the whole sequence, whose K/V k, v (B, Hkv, L, D) are split over `cp` in `layout`.
    documents: a `Documents` of the packed micro-batch, or None; softcap: the attention-logit cap
    (Gemma 2), or None. Collective over cp (every rank calls it)."""
    L = q.shape[2]
    n = cp.size
    # (B, L, 2, Hkv, D): the sequence on dim 1, where the sequence-parallel gather concatenates
    kv = torch.stack([k, v], dim=2).permute(0, 3, 2, 1, 4)
    kv = gather_from_sequence_parallel_region(kv.contiguous(), cp)         # (B, T, 2, Hkv, D)
    keys, values = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    pos_k = window_positions(L * n, n, layout, q.device)
    pos_q = pos_k[cp.rank * L:(cp.rank + 1) * L]
    mask = pos_k[None] <= pos_q[:, None]                                                  # (L, T)
    if window is not None:
        mask = mask & (pos_k[None] > pos_q[:, None] - window)
    if documents is not None:
        if not isinstance(documents, Documents):
            raise ValueError("window_attention: documents must be a Documents (documents.py) under cp")
        ids = torch.cat([documents.device_share(r, n, q.device) for r in range(n)], dim=1)   # (B, T)
        mask = mask[None] & (ids[:, cp.rank * L:(cp.rank + 1) * L, None] == ids[:, None, :])
    else:
        mask = mask[None]
    return masked_attention(q, keys, values, mask[:, None], softcap)
