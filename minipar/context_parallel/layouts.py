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

The data split (training/data.py local_batch) and the positions for RoPE (models/llama.py) both
go through these two functions, so input ids, labels and positions always agree with the layout
ring attention is told (`ring_attention(..., layout=...)`). No communication.
"""
from __future__ import annotations

import torch

from ..config import CP_LAYOUTS, check_sequence_len
from .ring_attention import zigzag_positions, zigzag_shard


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
