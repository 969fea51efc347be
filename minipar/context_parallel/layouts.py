"""The two ways to cut a sequence over the cp ranks: a rung of the ladder (`cp_layout`).

    T tokens, cp = 2, cut into 2*cp = 4 chunks:   | 0 | 1 | 2 | 3 |
    contiguous   rank 0: [0 1]   rank 1: [2 3]     the textbook split (picotron's)
    zigzag       rank 0: [0 3]   rank 1: [1 2]     chunks c and 2cp-1-c (the default)

Under a causal mask a query sees only earlier keys, so with the contiguous split the last rank
attends to every block of the ring and the first rank to its own only: the ring runs at the pace
of the last rank, about 2cp/(cp+1) times the mean work. Zigzag gives each rank one early and one
late chunk, and every ring step the same work (ring_attention.py explains the block shapes;
ring_schedule counts them; benchmarks/ladder.py measures the two). Both layouts send the same
bytes: the ring passes every K/V block around either way.

zigzag_shard / zigzag_positions cut a full-sequence tensor / its positions; zigzag_unshard puts the
shares back in order. The data split (trainer/data/batches.py local_batch) and the positions for RoPE
(models/llama.py) both go through shard_sequence and sequence_positions, so input ids, labels
and positions always agree with the layout ring attention is told (`ring_attention(...,
layout=...)`). No communication, except in zigzag_unshard (the full sequence back: one
all-gather over cp of the local shares).
"""
from __future__ import annotations

import torch

from .. import comm
from ..config import CP_LAYOUTS, check_sequence_len


def zigzag_shard(x: torch.Tensor, dim: int, cp) -> torch.Tensor:
    """This rank's zigzag share of a full-sequence tensor: chunks c and 2*cp-1-c of 2*cp, concatenated."""
    if cp.size == 1:
        return x
    check_sequence_len(int(x.shape[dim]), cp.size)
    chunks = x.chunk(2 * cp.size, dim=dim)
    return torch.cat([chunks[cp.rank], chunks[2 * cp.size - 1 - cp.rank]], dim=dim)


def zigzag_unshard(x_local: torch.Tensor, dim: int, cp) -> torch.Tensor:
    """The full sequence back in order: all-gather the shares over cp, then undo the zigzag."""
    if x_local.shape[dim] % 2:
        raise ValueError(f"zigzag_unshard: local length {x_local.shape[dim]} along dim {dim} is odd, but a "
                         f"zigzag share holds two equal chunks: pass what zigzag_shard returned")
    n = cp.size
    if n == 1:
        return x_local
    pieces = comm.all_gather(x_local, cp, gather_dim=dim).chunk(2 * n, dim=dim)   # [c0 c2n-1 | c1 c2n-2 | ..]
    ordered = [None] * (2 * n)
    for r in range(n):
        ordered[r], ordered[2 * n - 1 - r] = pieces[2 * r], pieces[2 * r + 1]
    return torch.cat(ordered, dim=dim)


def zigzag_positions(seq_len: int, cp, device=None) -> torch.Tensor:
    """True positions (long, seq_len / cp of them) of this rank's tokens, for rotary embeddings."""
    if cp.size == 1:
        return torch.arange(seq_len, device=device)
    check_sequence_len(int(seq_len), cp.size)
    chunk = seq_len // (2 * cp.size)
    late = 2 * cp.size - 1 - cp.rank
    return torch.cat([torch.arange(cp.rank * chunk, (cp.rank + 1) * chunk, device=device),
                      torch.arange(late * chunk, (late + 1) * chunk, device=device)])


def _check(layout: str) -> None:
    if layout not in CP_LAYOUTS:
        raise ValueError(f"cp_layout must be one of {CP_LAYOUTS}, got {layout!r}")


def shard_sequence(x: torch.Tensor, dim: int, cp, layout: str = "zigzag") -> torch.Tensor:
    """This rank's share of a full-sequence tensor along `dim`, in the given layout."""
    _check(layout)
    if layout == "zigzag" or cp.size == 1:
        return zigzag_shard(x, dim, cp)
    check_sequence_len(int(x.shape[dim]), cp.size)
    return x.chunk(cp.size, dim=dim)[cp.rank]


def sequence_positions(seq_len: int, cp, layout: str = "zigzag", device=None) -> torch.Tensor:
    """The true positions (seq_len / cp of them, long) of this rank's tokens, for RoPE."""
    _check(layout)
    if layout == "zigzag" or cp.size == 1:
        return zigzag_positions(seq_len, cp, device=device)
    check_sequence_len(int(seq_len), cp.size)
    local = seq_len // cp.size
    return torch.arange(cp.rank * local, (cp.rank + 1) * local, device=device)
