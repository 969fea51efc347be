"""Packed documents as boundaries: which attention blocks they empty, leave whole, or cut, on the host.

A packed row holds several examples; attention must stay inside each (document_ids, one id per
token, packing.py). The dense way is a (T, T) boolean mask per row, and fp32 (B, H, T, T) scores
to apply it to: O(T^2) memory, and no flash kernel takes such a mask. But packed ids are runs
(0 0 0 1 1 2 2 2 ...), so the mask is block-diagonal and the host can describe it by its
boundaries, the cumulative lengths of the runs, once per micro-batch, before any kernel runs:

    ids      0 0 0 1 1 2 2 2          runs [0, 3) [3, 5) [5, 8)
    cu_seq   0 3 5 8                  what a varlen kernel takes (flash-attention's cu_seqlens)

Every attention block (a query slice against a key slice: the ring's blocks, or the whole
sequence at cp 1) is then classified from the ids of its rows and columns:

    empty     no row shares a document with a column: skipped, nothing computed or merged
    plain     one document covers the whole block (in every batch row): the kernel runs as without
              documents
    segments  the documents cut the block: for each document d present on both sides, the rows
              [qs, qe) of d attend the columns [ks, ke) of d (causally on the square diagonal
              block, whose two sides are the same tokens), as one dense sub-block each
    dense     some id is not one run on a side (not packed data): the (Tq, Tk) mask, as before

    block (q rows x k cols), ids 0 0 1 1 2 | 0 0 1 1 2:    segments (0,2,0,2) (2,4,2,4) (4,5,4,5)
    causal square:  x . . . .                            each a causal square of its own
                    x x . . .
                    . . x . .
                    . . x x .
                    . . . . x

The sum of the segments' areas is what attention really computes: about T * doc_len per row
instead of T^2 / 2, linear in T for a fixed document length. A segment block runs a dense kernel
(the CPU flash kernel, or the reference math) once per document, or one varlen flash call on
CUDA for all of them (fused_attention.py); either way no (T x T) tensor exists.

`Documents` holds the full sequence's ids on the host (B, T) and the cp layout, so a rank can
name the ids of ANY rank's share without communication: ring attention asks for the ids of the
K/V block it holds at each step, Ulysses' inner ring for the share of its ring rank. It is built
once per micro-batch (`Documents.gather`: one all-gather of the (B, L) ids over cp and one copy to
the host, in LlamaModel.run_layers) and memoises the classification of each block shape, so the
layers after the first find it ready: no host synchronisation per block or per layer.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch

from .. import comm
from .layouts import shard_sequence, zigzag_unshard

__all__ = ["Documents", "BlockDocuments", "runs", "cumulative_lengths", "classify_block"]


def runs(ids: torch.Tensor) -> Optional[List[Tuple[int, int, int]]]:
    """The runs of one row of ids (1-D, host): [(id, start, end), ...] in order, or None when some
    id appears in two runs (not packed data)."""
    n = int(ids.numel())
    if n == 0:
        return []
    change = (ids[1:] != ids[:-1]).nonzero().flatten().add_(1).tolist()
    starts = [0] + change
    ends = change + [n]
    values = ids[starts].tolist()
    if len(set(values)) != len(values):
        return None
    return list(zip(values, starts, ends))


def cumulative_lengths(ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of a (B, T) batch of packed rows, the rows one after the other: (n_docs + 1,)
    int32, what a varlen kernel takes for the sequence (B*T tokens) flattened row by row."""
    cu = [0]
    for row in ids:
        r = runs(row)
        if r is None:
            raise ValueError("cumulative_lengths: a document id appears in two runs of a row; packed "
                             "rows hold each document as one run of ids")
        base = cu[-1]
        cu.extend(base + end for _, _, end in r)
    return torch.tensor(cu, dtype=torch.int32)


class BlockDocuments:
    """A block's classification: kind (empty, plain, segments, dense) and, for segments, the
    (batch row, qs, qe, ks, ke) sub-blocks of each document, in order. `cache` keeps what a kernel
    derives from them per device (the varlen layout), made once per micro-batch."""

    def __init__(self, kind: str, segments: Tuple[Tuple[int, int, int, int, int], ...] = ()):
        self.kind, self.segments = kind, tuple(segments)
        self.cache: Dict[str, tuple] = {}

    def __repr__(self):
        return f"BlockDocuments({self.kind!r}, {self.segments!r})"


def classify_block(q_ids: torch.Tensor, k_ids: torch.Tensor, causal: bool) -> BlockDocuments:
    """Classify one block from the host ids of its rows (B, Tq) and columns (B, Tk). A causal block is
    the square diagonal one (q_ids and k_ids the same tokens)."""
    tq, tk = q_ids.shape[1], k_ids.shape[1]
    if causal and (tq != tk or not torch.equal(q_ids, k_ids)):
        raise ValueError(f"classify_block: a causal block is the square diagonal block, its rows and "
                         f"columns the same tokens; got {tq} rows and {tk} columns")
    segments, whole = [], True
    for b in range(q_ids.shape[0]):
        q_runs = runs(q_ids[b])
        k_runs = q_runs if causal else runs(k_ids[b])
        if q_runs is None or k_runs is None:
            return BlockDocuments("dense")
        cols = {d: (s, e) for d, s, e in k_runs}
        row = [(b, s, e) + cols[d] for d, s, e in q_runs if d in cols]
        whole = whole and row == [(b, 0, tq, 0, tk)]
        segments.extend(row)
    if not segments:
        return BlockDocuments("empty")
    if whole:
        return BlockDocuments("plain")
    return BlockDocuments("segments", tuple(segments))


class Documents:
    """The document ids of one packed micro-batch: the full sequence on the host (B, T), in natural
    order, and the cp layout its shares are cut in (layouts.py). `local` is this rank's share on the
    device, the (B, L) ids the model was given (for the dense fallback)."""

    def __init__(self, full: torch.Tensor, layout: str = "zigzag", local: Optional[torch.Tensor] = None):
        if full.dim() != 2 or full.dtype.is_floating_point:
            raise ValueError(f"Documents: the ids must be an integer (B, T) tensor, got {full.dtype} "
                             f"{tuple(full.shape)}")
        self.full = full.detach().to("cpu", torch.long)
        self.layout, self.local = layout, local
        self._shares: Dict[Tuple[int, int], torch.Tensor] = {}
        self._blocks: Dict[tuple, BlockDocuments] = {}

    @classmethod
    def gather(cls, local: torch.Tensor, cp, layout: str = "zigzag") -> "Documents":
        """From this rank's (B, L) share: one all-gather over cp (every cp rank calls it) and one copy
        to the host."""
        if cp.size == 1:
            full = local
        elif layout == "zigzag":
            full = zigzag_unshard(local.contiguous(), 1, cp)
        else:
            full = comm.all_gather(local.contiguous(), cp, gather_dim=1)
        return cls(full, layout, local)

    @property
    def shape(self):
        return self.full.shape

    def share(self, rank: int, size: int) -> torch.Tensor:
        """The host ids (B, T/size) of rank `rank`'s share of the sequence cut over `size` ranks."""
        key = (rank, size)
        if key not in self._shares:
            cut = SimpleNamespace(rank=rank, size=size)
            self._shares[key] = shard_sequence(self.full, 1, cut, self.layout)
        return self._shares[key]

    def device_share(self, rank: int, size: int, device) -> torch.Tensor:
        """The same ids on `device` (the dense fallback's masks)."""
        key = ("device", rank, size, str(device))
        if key not in self._shares:
            self._shares[key] = self.share(rank, size).to(device)
        return self._shares[key]

    def block(self, q_rank: int, k_rank: int, size: int, q0: int, q1: int, k0: int, k1: int,
              causal: bool) -> BlockDocuments:
        """The classification of rows [q0, q1) of rank q_rank's share against columns [k0, k1) of
        rank k_rank's, memoised (every layer asks the same)."""
        key = (q_rank, k_rank, size, q0, q1, k0, k1, causal)
        if key not in self._blocks:
            self._blocks[key] = classify_block(self.share(q_rank, size)[:, q0:q1],
                                               self.share(k_rank, size)[:, k0:k1], causal)
        return self._blocks[key]
