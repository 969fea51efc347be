"""Ulysses and USP attention (minipar/context_parallel/ulysses.py) against one process, in fp64, on
forked gloo worlds: one world of 2 ranks (Ulysses u = 2) and one of 4 (Ulysses u = 4, and USP u = 2
x ring 2), each running every case: both layouts, GQA 8 query heads over 4 and 2 KV heads (u = 4
over 2 KV heads repeats each twice), packed documents, and the ledger against the docstring's bytes."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from harness import run_world

from minipar import comm, comm_ledger
from minipar.context_parallel import (
    check_ulysses,
    ring_order,
    sequence_positions,
    sequence_to_heads,
    shard_sequence,
    ulysses_attention,
)
from minipar.mesh import MeshDim

B, D, CHUNK = 2, 8, 2


def _reference(q, k, v, causal, docs):
    """Attention of the whole sequence in one process, written out: softmax(q k^T / sqrt(D)) v."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / D ** 0.5
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool)
    if causal:
        mask = mask.tril()
    mask = mask[None] if docs is None else mask & (docs[:, :, None] == docs[:, None, :])
    return torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), -1) @ v


def _packed(t, g):
    """Row 0: documents of random lengths (some of one token); row 1: one document."""
    ids = torch.zeros(B, t, dtype=torch.long)
    for c in sorted(set(torch.randint(1, t, (t // 3,), generator=g).tolist()) | {1, t - 1}):
        ids[0, c:] += 1
    return ids


def _groups(world, u):
    """Every rank creates every group in the same order; returns this rank's (ulysses, ring)."""
    rank, mine = dist.get_rank(), {}
    for r in range(world // u):
        ranks = list(range(r * u, r * u + u))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine["u"] = MeshDim("cp_ulysses", ranks, rank, group)
    for j in range(u):
        ranks = list(range(j, world, u))
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            mine["r"] = MeshDim("cp_ring", ranks, rank, group) if group is not None else None
    return mine["u"], mine["r"]


def _cases(world, usizes, extra=()):
    """On every rank: each ulysses size u of `usizes` over this world, each case; failure messages."""
    failures = []
    for u in usizes:
        grp, ring = _groups(world, u)
        big_r = 1 if ring is None else ring.size
        c_rank = (0 if ring is None else ring.rank) * u + grp.rank
        cp = SimpleNamespace(rank=c_rank, size=world)
        cases = [(lay, hkv, docs, True) for lay in ("zigzag", "contiguous") for hkv in (4, 2)
                 for docs in (False, True)] + list(extra)
        for n, (layout, hkv, with_docs, causal) in enumerate(cases):
            name = f"rank {c_rank} u={u} R={big_r} {layout} Hkv={hkv} docs={with_docs} causal={causal}"
            g = torch.Generator().manual_seed(10 * n + u)          # the same full tensors on every rank
            t, hq = 2 * world * CHUNK, 8
            q, k, v, dout = (torch.randn(B, h, t, D, generator=g, dtype=torch.float64)
                             for h in (hq, hkv, hkv, hq))
            docs = _packed(t, g) if with_docs else None
            full = [x.clone().requires_grad_() for x in (q, k, v)]
            ref = _reference(*full, causal, docs)
            ref.backward(dout)
            local = [shard_sequence(x, 2, cp, layout).clone().requires_grad_() for x in (q, k, v)]
            local_docs = None if docs is None else shard_sequence(docs, 1, cp, layout)
            try:
                # the head split holds this rank's heads at the true positions of ring rank r's share
                order = ring_order(t // world, u, big_r, c_rank // u, layout)
                pos = sequence_positions(t, SimpleNamespace(rank=c_rank // u, size=big_r), layout)
                heads = slice(grp.rank * hq // u, (grp.rank + 1) * hq // u)
                got = sequence_to_heads(local[0].detach(), grp, order)
                assert torch.equal(got, q[:, heads][:, :, pos]), f"{name}: head split layout"
                with comm_ledger.ledger() as led:
                    out = ulysses_attention(*local, grp, ring, layout=layout, causal=causal,
                                            document_ids=local_docs)
                    out.backward(shard_sequence(dout, 2, cp, layout))
                for got, want, what in zip([out] + [x.grad for x in local], [ref] + [x.grad for x in full],
                                           ("out", "dq", "dk", "dv")):
                    torch.testing.assert_close(got, shard_sequence(want.detach(), 2, cp, layout), atol=1e-10,
                                               rtol=1e-10, msg=f"{name} {what}")
                _check_ledger(led, name, u, big_r, hq, hkv, t // world, with_docs)
            except AssertionError as err:
                failures.append(str(err))
    return failures


def _check_ledger(led, name, u, big_r, hq, hkv, n, with_docs):
    """The docstring's bytes: 4 all-to-alls forward (q, k, v, out) and 4 backward, K/V with f = u /
    gcd(Hkv, u) repeats; one all-gather of the ids; USP's ring R-1 hops of K/V forward, of K/V and
    dK/dV backward (fp64 here), and 2(R-1) of the ids."""
    f = u // math.gcd(hkv, u)
    qb, kb = B * hq * n * D * 8, B * hkv * f * n * D * 8
    a2a = led.filter("all_to_all", "cp_ulysses")
    assert sorted(r.bytes for r in a2a) == sorted([qb, kb, kb, qb] * 2), f"{name}: {[r.bytes for r in a2a]}"
    assert all(r.wire_bytes == (u - 1) / u * r.bytes for r in a2a), f"{name}: all_to_all wire bytes"
    gathers = [r.bytes for r in led.filter("all_gather", "cp_ulysses")]
    assert gathers == ([B * u * n * 8] if with_docs else []), f"{name}: ids all-gather {gathers}"
    hops = sorted(r.bytes for r in led.filter("send_recv", "cp_ring"))
    want = [2 * B * hkv * f * n * D * 8] * (3 * (big_r - 1)) + [B * u * n * 8] * (2 * (big_r - 1) * with_docs)
    assert hops == sorted(want), f"{name}: ring hops {hops}"
    assert led.count() == len(a2a) + len(gathers) + len(hops), f"{name}: other collectives {led.summary()}"


@pytest.mark.parametrize("world,usizes,extra", [
    (2, [2], []),
    # pure Ulysses over 4 and USP 2 x ring 2, and both without the causal mask
    (4, [4, 2], [("zigzag", 2, False, False), ("contiguous", 4, True, False)]),
], ids=["cp2-ulysses", "cp4-ulysses-and-usp"])
def test_ulysses_matches_one_process_fp64(world, usizes, extra):
    failures = [f for r in run_world(_cases, world, world, usizes, extra, timeout=180) for f in r]
    assert not failures, "\n".join(failures[:4])


@pytest.mark.parametrize("u,big_r,layout", [(u, r, lay) for u in (1, 2, 4) for r in (1, 2, 4)
                                            for lay in ("zigzag", "contiguous")])
def test_ring_order_gives_the_ring_share(u, big_r, layout):
    """The u group ranks' shares, reordered, are exactly ring rank r's share over R (contiguous: no
    reordering), and for R = 1 the whole sequence in order."""
    c, n = u * big_r, 4
    t = c * n
    for r in range(big_r):
        gathered = torch.cat([sequence_positions(t, SimpleNamespace(rank=r * u + j, size=c), layout)
                              for j in range(u)])
        order = ring_order(n, u, big_r, r, layout)
        assert (order is None) == (layout == "contiguous" or u == 1), order
        got = gathered if order is None else gathered[order]
        want = sequence_positions(t, SimpleNamespace(rank=r, size=big_r), layout)
        assert torch.equal(got, want), (r, got, want)
        if big_r == 1:
            assert torch.equal(got, torch.arange(t))


def test_head_counts_are_checked_before_any_collective():
    grp = MeshDim("cp_ulysses", [0, 1, 2, 3], 0, None)      # no process group: a collective would crash
    q, k = torch.zeros(1, 6, 4, 8), torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"6 query heads .*2 KV heads.* 4 ranks.* work: \[1, 2, 3, 6\]"):
        ulysses_attention(q, k, k, grp)
    assert check_ulysses(8, 4, 1, 4, 4) == [] and check_ulysses(8, 2, 1, 4, 4) == []   # the latter repeats KV
    assert check_ulysses(16, 4, 2, 4, 2) == [] and check_ulysses(32, 8, 4, 8, 8) == []
    (msg,) = check_ulysses(6, 2, 1, 4, 4)
    assert "num_attention_heads 6 / tp_size 1 = 6" in msg and "would work: [1, 2]" in msg, msg
    (msg,) = check_ulysses(8, 8, 2, 8, 8)
    assert "= 4" in msg and "8 ranks" in msg and "[1, 2, 4]" in msg, msg
    assert any("divisor of context_parallel_size 4" in p for p in check_ulysses(8, 2, 1, 4, 3))
    assert any("tp_size 3" in p for p in check_ulysses(8, 2, 3, 4, 2))


def test_all_to_all_on_one_rank_copies_without_recording():
    one = MeshDim("cp_ulysses", [0], 0, None)
    x = torch.arange(6.0).reshape(3, 2)
    with comm_ledger.ledger() as led:
        out = comm.all_to_all(torch.empty_like(x), x, one)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr() and led.count() == 0
    with pytest.raises(ValueError, match="divisible"):
        comm.all_to_all(torch.empty(3, 2), x, MeshDim("cp_ulysses", [0, 1], 0, None))
