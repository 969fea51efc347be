"""Context parallelism: the sequence split over cp ranks, attention as ring attention, zigzag balanced.

Everything in a decoder but attention works token by token, so splitting the sequence over the cp
ranks splits its work for free. Attention needs every query to see every (earlier) key: ring
attention (Liu et al., "Ring Attention with Blockwise Transformers", 2023) keeps each rank's
queries at home and passes the key/value blocks around the ring, one neighbour per step:

    step 0: rank r attends its own K/V block       and sends it to r+1, receives r-1's
    step i: rank r attends the block of rank r-i   while the block of rank r-i-1 is in flight
    after cp steps every query has seen every key; no rank ever holds more than two K/V blocks

    q (B, Hq, T/cp, D) stays           k, v (B, Hkv, T/cp, D) travel      out (B, Hq, T/cp, D)

The zigzag layout. Cut the sequence into 2*cp chunks; rank c keeps chunks c and 2cp-1-c:

    cp = 4, T = 8 chunks:  | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |
    rank 0: [0 7]   rank 1: [1 6]   rank 2: [2 5]   rank 3: [3 4]

With a contiguous split under a causal mask, rank 0 attends one block and rank cp-1 attends cp of
them: the last rank computes 2cp/(cp+1) times the mean and everybody waits for it. In zigzag every
rank holds one early and one late chunk, and the causal work per step is the same everywhere
(Brandon et al., "Striped Attention", 2023; the zigzag variant of zhuzilin/ring-flash-attention,
used by Megatron-LM and torchtitan). With local halves [a b] (a early, b late) and a block [k0 k1]
from rank s, three block shapes occur: the local square, and half a block off the diagonal:

    s == r  the local square, causal mask            q [a b] x k [a b], lower triangle
    s <  r  every local query, the first half keys   q [a b] x k0        (k1 lies in everyone's future)
    s >  r  the second half queries, all keys        q [b]   x [k0 k1]   (a lies before both chunks)

The merge. Each block returns its normalised output o_b and per-row log-sum-exp l_b (fp32); the
running (o, l) is updated with the numerically safe rule, never forming an exp of a large number:

    l' = log(exp(l) + exp(l_b))  = logaddexp(l, l_b)
    o' = exp(l - l') * o + exp(l_b - l') * o_b

The backward (hand-written; flash-attention backward per block, with the FINAL o and l): K/V go
round the ring again; each block's dK/dV are added into an fp32 buffer that travels with the
block's owner's K/V, one hop behind, and arrives home after cp-1 hops; dQ stays local. The forward
keeps nothing of the ring: only the local q, k, v, o and l.

Cost per step of one layer, per rank, bytes on the wire (L = T/cp local tokens, e = element size):

    forward   cp-1 hops of K and V                     2 * B * Hkv * L * D * e each
    backward  cp-1 hops of K and V again, plus cp-1 hops of fp32 dK and dV (2 * B * Hkv * L * D * 4)
    compute   per step B * Hq * L * L/2 scores (the diagonal step L * L), overlapped with the hop

The block kernel is the caller's (block_kernel.py's BlockKernel, handed in): what attends one
query block to one visiting K/V block and returns (o_b, l_b), and its backward. This file only
runs the schedule, moves K/V, merges and sends the dK/dV home; which kernel runs (fused or the
reference math), the softmax scale, and packed documents (a query sees a key only within its
example: each block classified on the host and skipped, run whole or cut per document; or device
ids that travel round the ring with K/V, `kernel.travelling`) are the kernel's. The causal schedule
is the same either way: it works on sequence order, and documents only remove pairs from it.

GQA: K/V travel with their Hkv heads; the kernel folds or broadcasts the Hq/Hkv query heads of a
group per block, so repeated K/V never cross the ring. Non-causal attention: every step is a full
unmasked block. cp.size == 1: just the local causal block, no communication (how packed documents
run at cp 1: a ring of one rank whose one block the documents cut).

The call takes its tensors, its group, its kernel and the layout; what a benchmark or a test turns
or reads (overlap off, the score counts) goes in one optional RingKnobs.

Under torch.compile (compile: true) ring_attention is a graph BOUNDARY (minipar/graph_boundary.py):
the hops, the per-block kernels, the host-side document schedule and the hand-written backward run
eagerly between the compiled graphs of the layer before and after attention.
"""
from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import List, Optional

import torch

from .. import comm
from ..config import CP_LAYOUTS
from ..graph_boundary import graph_boundary

__all__ = ["ring_attention", "ring_schedule", "schedule_score_elements", "Block", "RingKnobs"]

# Local slices [q0, q1) of the queries and [k0, k1) of the visiting K/V block, and the mask.
Block = namedtuple("Block", "q0 q1 k0 k1 causal")


@dataclass
class RingKnobs:
    """What a benchmark or a test may turn or read; none changes the result."""
    overlap: bool = True                   # each hop runs while the block computes (False: wait first)
    stats: Optional[dict] = None           # gets "score_elements" (and "backward_score_elements") added


# ----------------------------------------------------------------------------------- the schedule
def _size(cp) -> int:
    return getattr(cp, "size", cp)


def ring_schedule(local_len: int, cp, rank: int, causal: bool = True,
                  layout: str = "zigzag") -> List[List[Block]]:
    """The blocks rank `rank` computes at each ring step (step i holds the K/V of rank rank - i).
    The single source of truth: ring_attention runs exactly these, and the balance is counted here."""
    n, L, h = _size(cp), local_len, local_len // 2
    steps = []
    for i in range(n):
        src = (rank - i) % n
        if not causal:
            steps.append([Block(0, L, 0, L, False)])
        elif i == 0:
            steps.append([Block(0, L, 0, L, True)])
        elif layout == "zigzag":
            steps.append([Block(0, L, 0, h, False)] if src < rank else [Block(h, L, 0, L, False)])
        else:   # contiguous: earlier ranks fully visible, later ranks all in the future
            steps.append([Block(0, L, 0, L, False)] if src < rank else [])
    return steps


def schedule_score_elements(seq_len: int, cp, rank: int, causal: bool = True, zigzag: bool = True,
                            count_masked: bool = True) -> int:
    """Attention scores (q x k pairs, per batch row and head) rank `rank` computes in the forward.
    Counted per block, a causal square in full, as the plain kernel computes it (count_masked=True);
    or only its unmasked pairs, what a tiled kernel that skips masked tiles approaches."""
    n = _size(cp)
    steps = ring_schedule(seq_len // n, n, rank, causal, "zigzag" if zigzag else "contiguous")
    return sum(_block_elements(b, count_masked) for blocks in steps for b in blocks)


def _block_elements(b: Block, count_masked: bool = True) -> int:
    rows, cols = b.q1 - b.q0, b.k1 - b.k0
    return rows * (rows + 1) // 2 if b.causal and not count_masked else rows * cols


# ----------------------------------------------------------------------------------- ring attention
def _merge(out, lse, out_b, lse_b):
    """In place on the running (out, lse) views: the log-sum-exp update of the module docstring."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(torch.exp(lse_b - new).unsqueeze(-1) * out_b.to(out.dtype))
    lse.copy_(new)


def _finish(works):
    """Wait once: a gloo send waited on a second time blocks for a send that never comes."""
    comm.wait_all(works)
    works.clear()


def _count(stats, key, steps):
    if stats is not None:
        stats[key] = stats.get(key, 0) + sum(_block_elements(b) for blocks in steps for b in blocks)


def _hop(kv, ids, cp, overlap):
    """Start the next hop of the K/V message (and of the kernel's travelling ids): (next kv, next ids,
    works)."""
    nxt = torch.empty_like(kv)
    nxt_ids = None if ids is None else torch.empty_like(ids)
    works = list(comm.ring_shift([kv] if ids is None else [kv, ids],
                                 [nxt] if ids is None else [nxt, nxt_ids], cp))
    if not overlap:
        _finish(works)
    return nxt, nxt_ids, works


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, blocks, causal: bool, layout: str, knobs: RingKnobs):
        n = cp.size
        steps = ring_schedule(q.shape[2], n, cp.rank, causal, layout)
        acc = torch.promote_types(q.dtype, torch.float32)      # fp32, or fp64 for fp64 inputs
        out = q.new_zeros(q.shape, dtype=acc)
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=acc)
        kv, ids = torch.stack([k, v]), blocks.travelling      # one message per hop (and ids beside it)
        kernel_ctx = []
        for i, step in enumerate(steps):
            works, nxt, nxt_ids = [], None, None
            if i + 1 < n:                        # the next block's hop runs while this one computes
                nxt, nxt_ids, works = _hop(kv, ids, cp, knobs.overlap)
            step_ctx = []
            for b in step:
                o_b, l_b, kc = blocks.forward(q[:, :, b.q0:b.q1], kv[0, :, :, b.k0:b.k1],
                                              kv[1, :, :, b.k0:b.k1], b, (cp.rank - i) % n, ids)
                if o_b is not None:              # None: no pair of this block may attend
                    _merge(out[:, :, b.q0:b.q1], lse[:, :, b.q0:b.q1], o_b, l_b)
                step_ctx.append(kc)
            kernel_ctx.append(step_ctx)
            _finish(works)
            if nxt is not None:
                kv, ids = nxt, nxt_ids
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.steps, ctx.blocks, ctx.kernel_ctx, ctx.knobs = cp, steps, blocks, kernel_ctx, knobs
        _count(knobs.stats, "score_elements", steps)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp, n, steps, blocks = ctx.cp, ctx.cp.size, ctx.steps, ctx.blocks
        dout = dout.contiguous()
        acc = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        home = torch.zeros((2,) + tuple(k.shape), dtype=acc, device=k.device)   # my dK, dV
        kv, ids = torch.stack([k, v]), blocks.travelling
        incoming, in_works = None, []            # the travelling dK/dV of the block held, one hop behind
        for i, step in enumerate(steps):
            works, nxt, nxt_ids = [], None, None
            if i + 1 < n:
                nxt, nxt_ids, works = _hop(kv, ids, cp, ctx.knobs.overlap)
            part = home if i == 0 else torch.zeros_like(home)
            for b, kc in zip(step, ctx.kernel_ctx[i]):
                grads = blocks.backward(
                    kc, dout[:, :, b.q0:b.q1], q[:, :, b.q0:b.q1], kv[0, :, :, b.k0:b.k1],
                    kv[1, :, :, b.k0:b.k1], out[:, :, b.q0:b.q1], lse[:, :, b.q0:b.q1], b, (cp.rank - i) % n,
                    ids)
                if grads is None:                # an empty block: no gradient
                    continue
                dq[:, :, b.q0:b.q1] += grads[0]
                part[0, :, :, b.k0:b.k1] += grads[1]
                part[1, :, :, b.k0:b.k1] += grads[2]
            if i > 0:
                # add my share to the buffer that came from rank r-1 (it hopped while I computed),
                # then pass it on; after the last step it lands at the block's owner
                _finish(in_works)
                sending = part if incoming is None else incoming.add_(part)   # held until its hop ends
                incoming = torch.empty_like(home)
                in_works = list(comm.ring_shift([sending], [incoming], cp))
                if not ctx.knobs.overlap:
                    _finish(in_works)
            _finish(works)
            if nxt is not None:
                kv, ids = nxt, nxt_ids
        if n > 1:
            _finish(in_works)
            home.add_(incoming)
        _count(ctx.knobs.stats, "backward_score_elements", steps)
        return (dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)) + (None,) * 5


@graph_boundary
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp, kernel, causal: bool = True, *,
                   layout: str = "zigzag", knobs: Optional[RingKnobs] = None) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, which is split over `cp` (pgm.cp).

    q (B, Hq, L, D), k and v (B, Hkv, L, D) with Hkv dividing Hq, L = T / cp.size tokens in the
    zigzag layout (zigzag_shard), or contiguous chunks with layout="contiguous" (for comparison).
    Returns (B, Hq, L, D) in q's dtype. kernel: what attends each block (block_kernel.py's
    BlockKernel: the kernel asked for, the scale, packed documents, the log it notes its choice
    in), bound here to this call. knobs (RingKnobs): overlap=False waits for each hop before
    computing (for the benchmark); a dict as `stats` gets "score_elements" (and
    "backward_score_elements") added, per batch row and head (the schedule's blocks, counted
    whether or not documents empty them).
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"ring_attention: q must be (B, Hq, L, D) and k, v (B, Hkv, L, D) of one shape; got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (b, hq, n, d), hkv = q.shape, k.shape[1]
    if (b, n, d) != (k.shape[0], k.shape[2], k.shape[3]) or hq % hkv:
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, local "
                         f"length and head_dim, and kv heads ({hkv}) must divide q heads ({hq})")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"ring_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if layout not in CP_LAYOUTS:
        raise ValueError(f"ring_attention: layout must be one of {CP_LAYOUTS}, got layout={layout!r}")
    if causal and layout == "zigzag" and cp.size > 1 and q.shape[2] % 2:
        raise ValueError(f"ring_attention: the local length {q.shape[2]} is odd, but a zigzag share is two "
                         f"equal chunks: shard a sequence of length divisible by 2 * cp_size = {2 * cp.size} "
                         f"with zigzag_shard")
    blocks = kernel.bind(q, cp, layout)          # its own checks (the documents), its kernel chosen
    return _RingAttention.apply(q, k, v, cp, blocks, causal, layout, RingKnobs() if knobs is None else knobs)
