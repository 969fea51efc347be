"""Ulysses attention: the sequence split turned into a head split by an all-to-all, and USP.

Ring attention (ring_attention.py) keeps each rank's queries home and passes K/V round the ring.
DeepSpeed-Ulysses (Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training
of Extreme Long Sequence Transformer Models", 2023) moves the heads instead: attention is
independent per head, so one all-to-all over u ranks trades "my L tokens, all H heads" for "all
u*L tokens, my H/u heads"; each rank then attends its heads over the whole (group's) sequence
locally, and a second all-to-all sends the outputs back to the sequence split:

    x (B, H, L, D)  -> view (B, u, H/u, L, D) -> slots (u, B, H/u, L, D): slot i = heads of rank i
    all_to_all_single: slot i goes to rank i, slot i of the result comes from rank i
    -> (B, H/u, u*L, D): my H/u heads, the tokens of group ranks 0..u-1 one after the other

The backward of an all-to-all is the reverse all-to-all (the gradient of "send slot i to rank i"
is "receive slot i from rank i"), so each direction's hand-written backward is the other one.

USP (Fang and Zhao, "USP: A Unified Sequence Parallelism Approach for Long Context Generative AI",
2024) nests the two: the C cp ranks are R = C/u ring groups of u Ulysses ranks each, cp rank
c = r*u + j (j = rank in the Ulysses group `grp`, r = rank in the ring group `ring`, the R ranks
with the same j). Ulysses runs inside a group (u consecutive ranks: one node when u <= GPUs per
node), ring attention over the R groups on the heads each rank then holds. u = C: pure Ulysses.

The layout after the exchange. With zigzag data over C ranks (rank c holds chunks c and 2C-1-c of
2C), group r holds chunks r*u .. r*u+u-1 and 2C-u-r*u .. 2C-1-r*u: exactly zigzag pair r over 2R
(chunks of u times the size). The all-to-all delivers them in group-rank order [e0 l0 e1 l1 ..],
ring attention wants [e0 e1 .. e(u-1) l(u-1) .. l0]: one fixed reordering (`ring_order`, computed
from the true positions). Contiguous data: group r holds contiguous chunk r over R, in order
already. R = 1: the order is the whole sequence's natural order, and "ring attention" over a
size-1 ring is the plain local causal block (the same block kernels, document masks included).

    C = 4, u = 2, R = 2, zigzag: chunks | 0 1 2 3 4 5 6 7 |
    group 0 = cp ranks 0, 1: receives [0 7 | 1 6] -> ring order [0 1 6 7] = zigzag pair 0 over 4
    group 1 = cp ranks 2, 3: receives [2 5 | 3 4] -> ring order [2 3 4 5] = zigzag pair 1 over 4

Bytes per rank per exchange (e = element size, L = T/C local tokens, Hq, Hkv the local heads after
tp, f the KV repeat below): each all-to-all keeps 1/u of its buffer and sends the rest,

    q, out, dq, dout   buffer B * Hq * L * D * e        wire (u-1)/u of it
    k, v, dk, dv       buffer B * f*Hkv * L * D * e     wire (u-1)/u of it
    forward 4 exchanges (q, k, v, out), backward 4 (dout, dq, dk, dv); document ids (B, L) one
    all-gather of B * u*L ids. USP adds ring attention over R with u*L tokens and f*Hkv/u heads:
    R-1 hops of 2 * B * f*Hkv * L * D * e forward, the same bytes per hop as a C-ring, R-1 hops
    instead of C-1. Against ring's 2(C-1) K/V hops, pure Ulysses' volume per rank does not grow
    with C (DeepSpeed's 4Nh/P per link): the all-to-alls shrink as C grows, the ring's does not.

What must divide what: u divides C; u divides Hq (the heads of this tp rank, num_heads / tp) so
every rank gets whole query heads. K/V heads: if u does not divide Hkv, each KV head is repeated
f = u / gcd(Hkv, u) times (repeat_interleave: q head h still reads kv head h // (Hq/Hkv)), the
fewest copies that make f*Hkv = lcm(Hkv, u) split over u; that needs Hq divisible by lcm(Hkv, u),
which holds exactly when u divides Hq. So a head count is refused only when u does not divide Hq
(ValueError; check_ulysses says so before any collective). The repeats cost f times the K/V bytes
and memory, which is why they are not made when u divides Hkv. The sequence: T divisible by 2C
(zigzag), as for ring attention.

Under torch.compile (compile: true) ulysses_attention is a graph BOUNDARY
(minipar/graph_boundary.py): the all-to-alls and the inner ring run eagerly.
"""
from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import List, Optional

import torch

from .. import comm
from ..config import CP_LAYOUTS
from ..graph_boundary import graph_boundary
from ..mesh import MeshDim
from .block_kernel import BlockKernel
from .fused_attention import default_scale
from .kernel_choice import AttentionLog
from .layouts import sequence_positions
from .ring_attention import RingKnobs, ring_attention

__all__ = ["ulysses_attention", "check_ulysses", "ring_order", "kv_repeats",
           "sequence_to_heads", "heads_to_sequence"]


# ------------------------------------------------------------------------------- the exchanges
def _to_heads(x: torch.Tensor, grp, order) -> torch.Tensor:
    """(B, H, L, D) sequence split -> (B, H/u, u*L, D) head split, tokens reordered by `order`."""
    u = grp.size
    b, h, n, d = x.shape
    slots = x.reshape(b, u, h // u, n, d).transpose(0, 1).contiguous()      # (u, B, H/u, L, D)
    got = comm.all_to_all(torch.empty_like(slots), slots, grp)              # slot i from rank i
    y = got.permute(1, 2, 0, 3, 4).reshape(b, h // u, u * n, d)
    return y if order is None else y.index_select(2, order)


def _to_sequence(y: torch.Tensor, grp, order) -> torch.Tensor:
    """The inverse of _to_heads: (B, H/u, u*L, D) in `order` -> (B, H, L, D)."""
    u = grp.size
    b, hu, un, d = y.shape
    if order is not None:                     # back to group-rank order: position order[k] <- k
        y = torch.empty_like(y).index_copy_(2, order, y)
    slots = y.reshape(b, hu, u, un // u, d).permute(2, 0, 1, 3, 4).contiguous()   # slot i = rank i's tokens
    got = comm.all_to_all(torch.empty_like(slots), slots, grp)              # slot i: rank i's heads
    return got.transpose(0, 1).reshape(b, hu * u, un // u, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grp, order):
        ctx.grp, ctx.order = grp, order
        return _to_heads(x, grp, order)

    @staticmethod
    def backward(ctx, dy):
        return _to_sequence(dy.contiguous(), ctx.grp, ctx.order), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, grp, order):
        ctx.grp, ctx.order = grp, order
        return _to_sequence(y, grp, order)

    @staticmethod
    def backward(ctx, dx):
        return _to_heads(dx.contiguous(), ctx.grp, ctx.order), None, None


def _check_heads(x: torch.Tensor, grp, what: str) -> None:
    if x.dim() != 4 or x.shape[1] % grp.size:
        raise ValueError(f"{what}: x must be (B, H, L, D) with H divisible by the {grp.name} size "
                         f"{grp.size}, got {tuple(x.shape)}")


def sequence_to_heads(x: torch.Tensor, grp, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, H, L, D), this rank's L tokens and all H heads -> (B, H/u, u*L, D), this rank's H/u heads
    and the u*L tokens of `grp` in group-rank order (or `order`: token k is gathered token order[k]).
    One all_to_all; the backward is heads_to_sequence's exchange."""
    _check_heads(x, grp, "sequence_to_heads")
    return _SequenceToHeads.apply(x, grp, order)


def heads_to_sequence(y: torch.Tensor, grp, order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The inverse: (B, H/u, u*L, D) -> (B, H, L, D). `order` as given to sequence_to_heads."""
    if y.dim() != 4 or y.shape[2] % grp.size:
        raise ValueError(f"heads_to_sequence: y must be (B, H/u, u*L, D), got {tuple(y.shape)} over "
                         f"{grp.name} of size {grp.size}")
    return _HeadsToSequence.apply(y, grp, order)


# ------------------------------------------------------------------------------- layout and heads
def ring_order(local_len: int, u: int, ring_size: int, ring_rank: int, layout: str = "zigzag",
               device=None) -> Optional[torch.Tensor]:
    """The reordering of the u*local_len gathered tokens (group-rank order) into the layout ring
    rank `ring_rank` of `ring_size` holds: token k of the ring's share is gathered token order[k].
    None when no reordering is needed (contiguous data, or u = 1)."""
    order = _ring_order(local_len, u, ring_size, ring_rank, layout)
    return None if order is None else order.to(device)


@functools.lru_cache(maxsize=64)
def _ring_order(local_len: int, u: int, ring_size: int, ring_rank: int, layout: str):
    c_size = u * ring_size
    seq = local_len * c_size

    def positions(rank, size):
        return sequence_positions(seq, SimpleNamespace(rank=rank, size=size), layout)

    gathered = torch.cat([positions(ring_rank * u + j, c_size) for j in range(u)])
    target = positions(ring_rank, ring_size)
    where = torch.full((seq,), -1, dtype=torch.long)
    where[gathered] = torch.arange(gathered.numel())
    order = where[target]
    if bool((order < 0).any()):      # cannot happen for the two layouts: the union is the ring's share
        raise AssertionError(f"ring_order: the group's tokens are not ring rank {ring_rank}'s {layout} share")
    return None if torch.equal(order, torch.arange(order.numel())) else order


def kv_repeats(num_heads: int, num_kv_heads: int, u: int) -> int:
    """How often each KV head is repeated so that the KV heads split over u (module docstring)."""
    if num_heads % u or num_heads % num_kv_heads:
        raise ValueError(_heads_problem(num_heads, num_kv_heads, u))
    return u // math.gcd(num_kv_heads, u)


def _heads_problem(hq: int, hkv: int, u: int, cp: Optional[int] = None) -> str:
    fits = [n for n in range(1, (cp or hq) + 1) if hq % n == 0 and (cp is None or cp % n == 0)]
    return (f"ulysses: the {hq} query heads of a tp rank ({hkv} KV heads) do not split over the ulysses "
            f"group of {u} ranks: u must divide the query heads (KV heads are repeated as needed) and the "
            f"KV heads must divide the query heads; ulysses sizes that would work: {fits}, or cp_impl ring "
            f"(any head count)")


def check_ulysses(num_heads: int, num_kv_heads: int, tp: int, cp: int, u: int) -> List[str]:
    """The problems (empty when none) of splitting attention heads over a ulysses group of u ranks
    inside cp, after tp: for config validation, before any collective."""
    problems = []
    if u < 1 or cp % u:
        problems.append(f"cp_ulysses_size {u} must be a positive divisor of context_parallel_size {cp}: "
                        f"use one of {[n for n in range(1, cp + 1) if cp % n == 0]}")
    if tp < 1 or num_heads % tp or num_kv_heads % tp:
        problems.append(f"num_attention_heads {num_heads} and num_key_value_heads {num_kv_heads} must divide "
                        f"by tp_size {tp} before ulysses can split them")
        return problems
    hq, hkv = num_heads // tp, num_kv_heads // tp
    if u >= 1 and (hq % u or hq % hkv):
        problems.append(_heads_problem(hq, hkv, u, cp).replace(
            "ulysses:", f"ulysses: num_attention_heads {num_heads} / tp_size {tp} = {hq}:", 1))
    return problems


# ------------------------------------------------------------------------------- attention
@graph_boundary
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grp, ring=None, *,
                      layout: str = "zigzag", causal: bool = True,
                      document_ids=None, scale: Optional[float] = None,
                      impl: str = "auto", knobs: Optional[RingKnobs] = None,
                      log: Optional[AttentionLog] = None) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence, Ulysses over `grp`, ring over `ring`.

    q (B, Hq, L, D), k and v (B, Hkv, L, D), document_ids (B, L): this cp rank's share in `layout`
    over the whole cp group, cp rank c = ring.rank * u + grp.rank (u = grp.size). ring None or of
    size 1: pure Ulysses. Returns (B, Hq, L, D) in q's dtype. impl, scale, the documents and log
    make the inner ring's block kernel (block_kernel.py's BlockKernel: the kernel asked for, noted in
    log); knobs go to ring_attention (RingKnobs: score counts of the heads and tokens this rank
    attends, the inner ring's overlap).
    document_ids: a `Documents` (the host's boundaries of the whole sequence: the inner ring asks it
    for its ring rank's share, no exchange of ids) or this rank's (B, L) device ids (all-gathered
    over the group and reordered, then masked densely).
    """
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"ulysses_attention: q must be (B, Hq, L, D) and k, v (B, Hkv, L, D) of one shape; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if layout not in CP_LAYOUTS:
        raise ValueError(f"ulysses_attention: layout must be one of {CP_LAYOUTS}, got {layout!r}")
    u, hq, hkv, n = grp.size, q.shape[1], k.shape[1], q.shape[2]
    if ring is None:
        ring = MeshDim("cp_ring", [grp.global_rank], grp.global_rank, None)
    if u == 1:
        return ring_attention(q, k, v, ring, BlockKernel(impl, document_ids, scale, log), causal,
                              layout=layout, knobs=knobs)
    f = kv_repeats(hq, hkv, u)
    if (q.shape[0], n, q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"ulysses_attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, "
                         f"local length and head_dim")
    if causal and layout == "zigzag" and n % 2:
        raise ValueError(f"ulysses_attention: the local length {n} is odd, but a zigzag share is two equal "
                         f"chunks: shard a sequence divisible by 2 * cp_size = {2 * u * ring.size}")
    if torch.is_tensor(document_ids) and (tuple(document_ids.shape) != (q.shape[0], n)
                                          or document_ids.dtype.is_floating_point):
        raise ValueError(f"ulysses_attention: document_ids must be integer ids of shape (B, L) = "
                         f"{(q.shape[0], n)}, got {document_ids.dtype} {tuple(document_ids.shape)}")
    if f > 1:                                  # kv head i -> copies f*i .. f*i+f-1, next to each other
        k, v = k.repeat_interleave(f, dim=1), v.repeat_interleave(f, dim=1)
    order = ring_order(n, u, ring.size, ring.rank, layout, q.device)
    qh, kh, vh = (sequence_to_heads(x, grp, order) for x in (q, k, v))
    docs = document_ids                      # Documents: the ring reads its share from the host ids
    if torch.is_tensor(document_ids):
        docs = comm.all_gather(document_ids.to(q.device).contiguous(), grp, gather_dim=1)
        docs = docs if order is None else docs.index_select(1, order)
    kernel = BlockKernel(impl, docs, default_scale(q.shape[-1], scale), log)
    out = ring_attention(qh, kh, vh, ring, kernel, causal, layout=layout, knobs=knobs)
    return heads_to_sequence(out, grp, order)
