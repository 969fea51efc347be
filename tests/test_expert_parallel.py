"""Expert parallelism's token exchange (minipar/expert_parallel/dispatch.py) against one process, in
fp64, on a forked gloo world of 4 ranks running an ep group of 4 and two of 2: each rank routes its
own number of rows with one expert taking most of them and the last expert none; a linear expert per
expert id runs between dispatch and combine. Forward rows, the input and expert-weight gradients,
and the ledger's bytes against the docstring's."""
import torch
import torch.distributed as dist
from harness import run_world

from minipar import comm_ledger
from minipar.expert_parallel import combine, dispatch
from minipar.mesh import MeshDim

E, D = 8, 4


def _rows(rank):
    """Rank r's rows sorted by expert and their counts: expert 1 takes about 3/4, expert E-1 none."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 6 + 3 * rank
    ids = torch.where(torch.rand(n, generator=g) < 0.75, torch.ones(n, dtype=torch.long),
                      torch.randint(0, E - 1, (n,), generator=g))
    ids = ids.sort().values
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    return x, ids, torch.bincount(ids, minlength=E), torch.randn(n, D, generator=g, dtype=torch.float64)


def _weights():
    return torch.randn(E, D, D, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def _ep_group(world, n):
    rank, mine = dist.get_rank(), None
    for start in range(0, world, n):
        ranks = list(range(start, start + n))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = MeshDim("ep", ranks, rank, group)
    return mine


def _experts(local, local_counts, w_local):
    """Local expert e on its contiguous run of rows: a loop over the runs."""
    runs = local.split(local_counts.tolist())
    return torch.cat([run @ w for run, w in zip(runs, w_local)]) if runs else local


def _case(world, n):
    ep = _ep_group(world, n)
    rank = dist.get_rank()
    x, ids, counts, dout = _rows(rank)
    w = _weights()
    w_local = w.chunk(n)[ep.rank].clone().requires_grad_()
    x = x.clone().requires_grad_()
    with comm_ledger.ledger() as led:
        local, local_counts, handle = dispatch(x, counts, ep)
        out = combine(_experts(local, local_counts, w_local), handle)
        out.backward(dout)
    name = f"ep {n} rank {rank}"
    # one process: every rank's rows, each through its own expert
    peers = [_rows(r) for r in ep.ranks]
    wf = w.clone().requires_grad_()
    xs = [p[0].clone().requires_grad_() for p in peers]
    ref = [torch.einsum("nd,nde->ne", xi, wf[p[1]]) for xi, p in zip(xs, peers)]
    sum((o * p[3]).sum() for o, p in zip(ref, peers)).backward()
    me = ep.rank
    L = E // n
    mine = range(me * L, (me + 1) * L)
    want_local = torch.cat([p[0][p[1] == e] for e in mine for p in peers])
    assert torch.equal(local.detach(), want_local), f"{name}: dispatched rows"
    assert local_counts.tolist() == [sum(int(p[2][e]) for p in peers) for e in mine], name
    torch.testing.assert_close(out, ref[me], rtol=1e-12, atol=1e-12, msg=f"{name}: out")
    torch.testing.assert_close(x.grad, xs[me].grad, rtol=1e-12, atol=1e-12, msg=f"{name}: dx")
    torch.testing.assert_close(w_local.grad, wf.grad.chunk(n)[me], rtol=1e-12, atol=1e-12, msg=f"{name}: dW")
    # the ledger: counts once; dispatch sends the rows for other members, combine returns the
    # rows other members sent; the backward repeats both
    sent = sum(int(counts.view(n, L)[j].sum()) for j in range(n) if j != me)
    got = sum(int(p[2].view(n, L)[me].sum()) for i, p in enumerate(peers) if i != me)
    counts_rec = led.filter("all_to_all", "ep")
    assert [(r.bytes, r.wire_bytes) for r in counts_rec] == [(E * 8, (n - 1) / n * E * 8)], name
    wire = sorted(r.wire_bytes for r in led.filter("all_to_all_uneven", "ep"))
    assert wire == sorted([sent * D * 8, got * D * 8] * 2), f"{name}: exchange wire bytes {wire}"
    assert led.count() == 5, f"{name}: {led.summary()}"
    return local_counts.tolist()


def _world(world):
    return [_case(world, n) for n in (4, 2)]


def test_exchange_matches_one_process_fp64():
    results = run_world(_world, 4, 4, timeout=120)
    # expert E-1 received nothing, expert 1 the most, on its holder at every ep size
    assert results[3][0][-1] == 0 and results[0][0][1] == max(results[0][0])
    assert results[3][1][-1] == 0 and results[0][1][1] == max(results[0][1])


def test_single_rank_is_identity():
    x, ids, counts, _ = _rows(0)
    for ep in (None, MeshDim("ep", [0], 0, None)):
        with comm_ledger.ledger() as led:
            local, local_counts, handle = dispatch(x, counts, ep)
            out = combine(local * 2, handle)
        assert local is x and local_counts is counts and torch.equal(out, 2 * x) and led.count() == 0
