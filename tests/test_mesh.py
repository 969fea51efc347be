"""The grid and its groups (minipar/mesh.py) and the collectives with their ledger (minipar/comm.py)."""

import pytest
import torch
import torch.distributed as dist
from harness import run_world

import minipar
from minipar import ParallelismConfig, comm, comm_ledger
from minipar.mesh import DIMENSIONS, all_groups, coords_of, describe_grid, main, rank_of

LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 2), (2, 2, 2, 2), (1, 2, 1, 4), (1, 1, 8, 1),
           (4, 1, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 1)]


def _expected_members(rank, shape, name):
    """Members of `rank`'s group of dimension `name`, straight from the grid formula."""
    varying = DIMENSIONS[name]
    mine = coords_of(rank, shape)
    names = ("dp_replicate", "dp_shard", "cp", "tp")
    members = []
    for other in range(shape[0] * shape[1] * shape[2] * shape[3]):
        oc = coords_of(other, shape)
        if all(oc[i] == mine[i] for i in range(4) if names[i] not in varying):
            members.append(other)
    return members


def _check_groups(shape):
    pgm = minipar.init(ParallelismConfig(*shape))
    rank = dist.get_rank()
    out = {}
    for name, d in pgm.dims.items():
        assert d.ranks == _expected_members(rank, shape, name), name
        assert d.size == len(d.ranks) and d.ranks[d.rank] == rank
        # an all-reduce over the group sums exactly its members (2^rank makes each sum unique)
        t = torch.tensor([2.0 ** rank], dtype=torch.float64)
        with comm_ledger.ledger() as led:
            comm.all_reduce(t, d)
        assert t.item() == sum(2.0 ** m for m in d.ranks), name
        if d.size == 1:
            assert led.count() == 0, "a size-1 dim must not communicate"
        out[name] = d.ranks
    assert pgm.cp.next_rank == pgm.cp.ranks[(pgm.cp.rank + 1) % pgm.cp.size]
    assert pgm.cp.prev_rank == pgm.cp.ranks[(pgm.cp.rank - 1) % pgm.cp.size]
    assert "ProcessGroupManager(rank" in repr(pgm)
    return out


# dp_replicate x dp_shard x cp x tp = 2x2x2x2, written out by hand (tp fastest), not derived from
# mesh.py's DIMENSIONS or coords_of: the groups _expected_members computes must be these
GROUPS_2x2x2x2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "dp_shard": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp_replicate": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "dp_shard_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "dp": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "dp_cp": [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]],
    "pp": [[r] for r in range(16)],
}


@pytest.mark.parametrize("shape", LAYOUTS, ids=lambda s: "x".join(map(str, s)))
def test_groups_match_grid(shape):
    world = shape[0] * shape[1] * shape[2] * shape[3]
    results = run_world(_check_groups, world, shape, timeout=120)
    assert len(results) == world
    if shape == (2, 2, 2, 2):
        for rank, groups in enumerate(results):
            assert sorted(groups) == sorted(GROUPS_2x2x2x2), sorted(groups)
            for name, members in groups.items():
                want = [g for g in GROUPS_2x2x2x2[name] if rank in g]
                assert [members] == want, (rank, name, members)


def test_grid_formula_roundtrip():
    shape = (2, 3, 2, 2)
    for rank in range(24):
        assert rank_of(coords_of(rank, shape), shape) == rank
    assert coords_of(5, (2, 2, 2, 2)) == (0, 1, 0, 1)


def test_describe_grid_cli(capsys):
    main(["--dp-replicate", "2", "--dp-shard", "2", "--cp", "2", "--tp", "2"])
    text = capsys.readouterr().out
    assert "16 ranks" in text and "dp_shard_cp groups" in text and "[4, 5]" in text
    assert describe_grid(ParallelismConfig(tp_size=2)).count("\n") > 5


def _pgm_without_world():
    try:
        minipar.ProcessGroupManager(ParallelismConfig())
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_pgm_needs_initialised_world():
    assert "minipar.init" in run_world(_pgm_without_world, 1, init=False)[0]


def _collectives():
    pgm = minipar.init(ParallelismConfig(dp_shard_size=4))
    d, r = pgm.dp_shard, pgm.dp_shard.rank
    with comm_ledger.ledger() as led:
        x = torch.arange(8.0) + 10 * r
        gathered = comm.all_gather(x.view(2, 4), d, gather_dim=1)       # (2, 16)
        scattered = comm.reduce_scatter(torch.ones(8, 3) * (r + 1), d)   # (2, 3) of 1+2+3+4
        recv = torch.empty(3)
        comm.wait_all(comm.ring_shift([torch.full((3,), float(r))], [recv], d))
        comm_ledger.mark("end")
    assert gathered.shape == (2, 16) and gathered[0, 4:8].tolist() == [10.0, 11, 12, 13]
    assert scattered.shape == (2, 3) and scattered.eq(10).all()
    assert recv.eq((r - 1) % 4).all()
    assert [e.op for e in led.records] == ["all_gather", "reduce_scatter", "send_recv"]
    assert led.events[-1] == "end"
    assert led.records[0].bytes == 32 * 4 and led.records[0].wire_bytes == 32 * 4 * 3 / 4
    return True


def test_collectives_and_ledger():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(run_world(_collectives, 4))


# ------------------------------------------------------------------ the fifth dimension: pp outermost
def _check_pp_groups(shape):
    """shape (P, R, S, C, T): every group against the 5D formula, the pp chain, a send along it."""
    pgm = minipar.init(ParallelismConfig(*shape[1:], pp_size=shape[0]))
    rank, (P, R, S, C, T) = dist.get_rank(), shape
    p = rank // (R * S * C * T)
    assert pgm.coords["pp"] == p and rank_of(coords_of(rank, shape), shape) == rank
    assert coords_of(rank, shape)[1:] == coords_of(rank % (R * S * C * T), shape[1:])   # a 4D grid per stage
    for name, d in pgm.dims.items():
        assert d.ranks == _expected_members_5d(rank, shape, name), name
    # every group except pp lies inside this stage; pp holds one rank per stage, same 4D coordinates
    stage = range(p * R * S * C * T, (p + 1) * R * S * C * T)
    assert all(set(d.ranks) <= set(stage) for n, d in pgm.dims.items() if n != "pp")
    assert pgm.pp.ranks == [rank % (R * S * C * T) + q * R * S * C * T for q in range(P)]
    assert pgm.is_first_stage == (p == 0) and pgm.is_last_stage == (p == P - 1)
    assert pgm.pp.next_rank == pgm.pp.ranks[(p + 1) % P] and pgm.pp.prev_rank == pgm.pp.ranks[(p - 1) % P]
    # an activation forward along the chain: stage p sends its rank to stage p + 1
    got = torch.full((2,), -1.0)
    sends = [(torch.full((2,), float(rank)), pgm.pp.next_rank, 7)] if not pgm.pp.is_last else []
    recvs = [(got, pgm.pp.prev_rank, 7)] if not pgm.pp.is_first else []
    with comm_ledger.ledger() as led:
        comm.wait_all(comm.send_recv(sends, recvs, pgm.pp))
    assert got.tolist() == ([-1.0, -1.0] if pgm.pp.is_first else [float(pgm.pp.prev_rank)] * 2)
    assert led.count("send") == len(sends) and led.total_bytes("send") == 8 * len(sends)
    return True


def _expected_members_5d(rank, shape, name):
    names, mine = ("pp", "dp_replicate", "dp_shard", "cp", "tp"), coords_of(rank, shape)
    n = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
    return [o for o in range(n) if all(coords_of(o, shape)[i] == mine[i]
                                       for i in range(5) if names[i] not in DIMENSIONS[name])]


@pytest.mark.parametrize("shape", [(2, 1, 1, 1, 1), (4, 1, 1, 1, 1), (2, 1, 2, 1, 2), (2, 2, 1, 2, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_pp_is_the_outermost_dimension(shape):
    assert all(run_world(_check_pp_groups, shape[0] * shape[1] * shape[2] * shape[3] * shape[4], shape,
                         timeout=120))


def test_pp_size_from_env_cli_and_grid_text(capsys, monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_PP_SIZE", "2")
    config = ParallelismConfig.from_env(tp_size=2)
    assert config.pp_size == 2 and config.resolve(8).dp_shard_size == 2     # the remainder after pp x tp
    with pytest.raises(ValueError, match="pp_size x dp_replicate_size x cp_size x tp_size = 4 "
                                         "does not divide 6"):
        config.resolve(6)
    main(["--pp", "2", "--dp-shard", "2", "--cp", "2", "--tp", "2"])
    text = capsys.readouterr().out
    assert "pp x dp_replicate x dp_shard x cp x tp = 2x1x2x2x2 = 16 ranks" in text
    assert "pp groups (size 2, varying pp):\n  [0, 8] [1, 9]" in text
    # pp 1: the same grid, the same groups as before the fifth dimension existed
    assert rank_of((0, 1, 0, 1), (2, 2, 2, 2)) == rank_of((0, 0, 1, 0, 1), (1, 2, 2, 2, 2)) == 5


def _usp_groups():
    pgm = minipar.init(ParallelismConfig(cp_size=4, tp_size=2, cp_impl="usp", cp_ulysses_size=2))
    return pgm.cp_ulysses.ranks, pgm.cp_ring.ranks, pgm.cp_ulysses.rank, pgm.cp_ring.rank


def test_usp_splits_each_cp_group_into_ulysses_and_ring_groups():
    """cp 4 x tp 2 with u = 2: the cp groups are [0 2 4 6] and [1 3 5 7]; Ulysses takes consecutive
    cp ranks (cp rank c = r * u + j), the ring every u-th. Written out by hand, not computed."""
    ulysses = {0: [0, 2], 2: [0, 2], 4: [4, 6], 6: [4, 6], 1: [1, 3], 3: [1, 3], 5: [5, 7], 7: [5, 7]}
    ring = {0: [0, 4], 4: [0, 4], 2: [2, 6], 6: [2, 6], 1: [1, 5], 5: [1, 5], 3: [3, 7], 7: [3, 7]}
    for rank, (u, r, j, i) in enumerate(run_world(_usp_groups, 8, timeout=120)):
        assert (u, r) == (ulysses[rank], ring[rank]), rank
        assert (j, i) == (u.index(rank), r.index(rank))
    ring_only = ParallelismConfig(cp_size=4).resolve(4)
    assert all_groups(ring_only)["cp_ring"] == [[0, 1, 2, 3]]      # ring: the ring is the cp group
    with pytest.raises(ValueError, match="cp_impl usp needs cp_ulysses_size dividing"):
        ParallelismConfig(cp_size=4, cp_impl="usp", cp_ulysses_size=3).resolve(4)


def _ep_groups():
    pgm = minipar.init(ParallelismConfig(dp_shard_size=4, ep_size=2))
    t = torch.tensor([2.0 ** dist.get_rank()], dtype=torch.float64)
    comm.all_reduce(t, pgm.edp)
    return pgm.ep.ranks, pgm.edp.ranks, pgm.dp_shard_cp.ranks, t.item()


def test_ep_borrows_dp_shard_cp_ranks():
    """ep consecutive ranks of each dp_shard_cp group, edp every ep-th (the same experts); the grid and
    every other group unchanged. Written out by hand, not computed."""
    for rank, (ep, edp, shard, total) in enumerate(run_world(_ep_groups, 4, timeout=120)):
        assert ep == [[0, 1], [2, 3]][rank // 2] and edp == [[0, 2], [1, 3]][rank % 2], rank
        assert shard == [0, 1, 2, 3] and total == sum(2.0 ** m for m in edp)
    # 2x2x2x2 (dp_replicate, dp_shard, cp, tp): dp_shard_cp groups [0 2 4 6] [1 3 5 7] [8 ..] [9 ..]
    grid = ParallelismConfig(2, 2, 2, 2, ep_size=4).resolve(16)
    assert all_groups(grid)["ep"] == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert all_groups(grid)["edp"] == [[r] for r in (0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15)]
    grid = ParallelismConfig(2, 2, 2, 2, ep_size=2).resolve(16)
    assert all_groups(grid)["ep"] == [[0, 2], [4, 6], [1, 3], [5, 7], [8, 10], [12, 14], [9, 11], [13, 15]]
    assert all_groups(grid)["edp"] == [[0, 4], [2, 6], [1, 5], [3, 7], [8, 12], [10, 14], [9, 13], [11, 15]]
    plain = all_groups(ParallelismConfig(2, 2, 2, 2).resolve(16))
    assert plain["ep"] == [[r] for g in plain["dp_shard_cp"] for r in g]
    assert {k: v for k, v in all_groups(grid).items() if k not in ("ep", "edp")} == \
        {k: v for k, v in plain.items() if k not in ("ep", "edp")}
    with pytest.raises(ValueError, match=r"expert_parallel_size=4 does not divide .* = 2 x 1 = 2"):
        all_groups(ParallelismConfig(dp_shard_size=2, tp_size=2, ep_size=4).resolve(4))


def test_ep_refused_with_every_problem_named():
    from types import SimpleNamespace
    model = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                            intermediate_size=64, num_local_experts=6, num_experts_per_tok=8)
    conf = ParallelismConfig(dp_shard_size=8, ep_size=4).resolve(8)
    with pytest.raises(ValueError) as err:
        conf.validate_model(model)
    assert "6 experts cannot be split over expert_parallel_size=4" in str(err.value)
    assert "num_experts_per_tok=8 must lie in 1 ... 6" in str(err.value)
    conf = ParallelismConfig(dp_shard_size=3, ep_size=2).resolve(3)
    dense = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                            intermediate_size=64)
    with pytest.raises(ValueError) as err:
        conf.validate_model(dense)
    assert "does not divide dp_shard_size x context_parallel_size = 3 x 1 = 3" in str(err.value)
    assert "needs a Mixture-of-Experts model, and this model is dense" in str(err.value)
