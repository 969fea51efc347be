"""The planner under cp_impl ulysses and usp: its ledger against real runs, the head counts it
refuses, where it places the new groups, and the search over the impls.

The runs are tests/test_plan.py's: forked gloo worlds of train.py's Trainer, one optimizer step per
rank measured (persistent state, the comm ledger and activations EXACTLY) and compared
with minipar.plan for the same model, layout, batch and dtype. The variants here are the paths that
configs/ does not already cover: the KV repeat (tp 2 leaves 1 KV head per rank, so u = 2 repeats it
twice), USP with activation checkpointing in bf16 (the recompute repeats the all-to-alls and the
ring hops), and Ulysses inside pipeline stages (pipeline_stage.py's per-stage count).
"""
import dataclasses
import itertools

import pytest
from harness import run_world
from test_plan import _argv, _check, _llama, _measure_all, _plan_rank

from minipar.config import ParallelismConfig
from minipar.context_parallel import check_ulysses
from minipar.mesh import all_groups
from minipar.plan import Layout, Pipeline, collectives, plan, search
from minipar.plan.__main__ import main as plan_main
from minipar.plan.estimate import AXES, Cluster, crosses_nodes
from minipar.plan.feasible import check
from minipar.plan.inputs import Batch, ModelShape, Options
from minipar.plan.layout_search import candidates
from minipar.trainer.prediction import from_train_config

CP_VARIANTS = [("cp_tp.yaml", ["--cp_impl", "ulysses"]),
               ("fsdp.yaml", ["--context_parallel_size", "4", "--dp_shard_size", "1", "--cp_impl", "usp",
                              "--cp_ulysses_size", "2", "--gradient_checkpointing", "true",
                              "--dtype", "bfloat16"]),
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--context_parallel_size", "2",
                            "--cp_impl", "ulysses"])]

# 6 query heads, 2 KV heads: Ulysses splits them over 2 or 3 ranks (after tp 1), not over 4
SIX_HEADS = ModelShape(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=16)


def test_plan_matches_ulysses_and_usp_runs_on_4_ranks(tmp_path):
    """The planned ledger (the all-to-alls over cp_ulysses, the hops over cp_ring) is the run's,
    and the runs did run the impls (a flag the trainer ignored would leave a ring run, planned as one)."""
    argvs = [_argv(config, tmp_path / str(i), *extra) for i, (config, extra) in enumerate(CP_VARIANTS)]
    per_rank = run_world(_measure_all, 4, argvs, timeout=900)
    for i, (impl, u) in enumerate((("ulysses", 2), ("usp", 2), ("ulysses", 2))):
        r0 = per_rank[0][i]
        assert (r0["layout"].cp_impl, r0["layout"].cp_ulysses_size) == (impl, u)
        assert ("all_to_all", "cp_ulysses") in r0["ledger"]
        assert (("send_recv", "cp_ring") in r0["ledger"]) == (impl == "usp")
        _check(r0, [r[i] for r in per_rank])
        # the head-split q, k, v (f times for k, v), out and lse that ring_attention saves: counted to
        # the byte (as _check holds them, here under the impl's own Layout)
        model, sizes, batch, opts = from_train_config(r0["cfg"])
        lc = r0["layout"]
        lay = Layout(lc.dp_replicate_size, lc.dp_shard_size, lc.cp_size, lc.tp_size, lc.sequence_parallel,
                     impl, u)
        pipe = Pipeline.from_sizes(sizes) if sizes.get("pp", 1) > 1 else None
        act = _plan_rank(model, lay, pipe, batch, opts, 0)[2]
        for (checkpointing, seq), measured in r0["acts"].items():
            assert act(dataclasses.replace(batch, sequence_len=seq), checkpointing) == measured, \
                (CP_VARIANTS[i], checkpointing, seq)


def test_the_planned_collectives_are_the_impls():
    """What the ledger check above compares: all-to-alls under ulysses, hops and all-to-alls
    under usp (a ring of R - 1 = 1 hop each way), ring hops alone under ring."""
    model, batch, opts = _llama("llama-3.1-8b"), Batch(4, 1, 8192), Options()
    groups = {impl: {k for k in collectives(model, Layout(1, 1, 4, 1, False, impl, u), batch, opts)
                     if k[1].startswith("cp")}
              for impl, u in (("ring", None), ("ulysses", None), ("usp", 2))}
    assert groups == dict(ring={("send_recv", "cp")}, ulysses={("all_to_all", "cp_ulysses")},
                          usp={("all_to_all", "cp_ulysses"), ("send_recv", "cp_ring")})
    usp = collectives(model, Layout(1, 1, 4, 1, False, "usp", 2), batch, opts)
    ring = collectives(model, Layout(1, 1, 4, 1, False, "ring"), batch, opts)
    # the same bytes per hop as the cp-ring (8 KV heads split over u = 2), R - 1 = 1 hops not C - 1 = 3
    hops = lambda c: c[("send_recv", "cp_ring" if ("send_recv", "cp_ring") in c else "cp")]
    assert 3 * hops(usp)[0] == hops(ring)[0] and 3 * hops(usp)[1] == hops(ring)[1]


def test_heads_ulysses_cannot_split_are_refused():
    """check() says what the trainer's check_ulysses says (the same function), plan() refuses,
    and `python -m minipar.plan` exits 2 with it; ring, and the u that split the heads, pass."""
    batch = Batch(4, 1, 64)
    bad = Layout(1, 1, 4, 1, False, "ulysses")
    assert check(SIX_HEADS, bad, batch) == check_ulysses(6, 2, 1, 4, 4) != []
    with pytest.raises(ValueError, match="do not split over the ulysses group of 4"):
        plan(SIX_HEADS, bad, batch, Options(), Cluster())
    for ok in (Layout(1, 1, 4, 1), Layout(1, 1, 4, 1, False, "usp", 2), Layout(1, 1, 6, 1, False, "usp", 3)):
        assert check(SIX_HEADS, ok, Batch(4, 1, 72)) == [], ok
    # a u that does not divide cp: ParallelismConfig.ulysses_size's own refusal
    assert "needs cp_ulysses_size dividing context_parallel_size=4" in \
        check(SIX_HEADS, Layout(1, 1, 4, 1, False, "usp", 3), batch)[0]


def test_cli_cp_impl_flags(capsys, tmp_path):
    import json
    path = tmp_path / "six.json"
    path.write_text(json.dumps(dict(vars(SIX_HEADS), model_type="llama")))
    base = ["--model", str(path), "--world", "4", "--cp", "4", "--seq-len", "64"]
    assert plan_main(base + ["--cp-impl", "ulysses"]) == 2
    assert "do not split over the ulysses group of 4" in capsys.readouterr().err
    assert plan_main(base + ["--cp-ulysses", "2"]) == 2            # under ring u means nothing: said so
    assert "give --cp-impl usp" in capsys.readouterr().err
    assert plan_main(base + ["--cp-impl", "usp", "--cp-ulysses", "2", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["layout"]["cp_impl"] == "usp" and p["layout"]["cp_ulysses_size"] == 2
    assert set(p["comm"]) >= {"cp_ulysses", "cp_ring"} and p["time"]["all_to_all_s"] > 0


@pytest.mark.parametrize("gpus_per_node", [1, 2, 4, 8])
def test_crosses_nodes_is_the_mesh_groups(gpus_per_node):
    """crosses_nodes (estimate.py's AXES on the (R, S, C/u, u, T) grid) says of every group what
    the trainer's own groups (mesh.all_groups) say, for every impl and u of these layouts."""
    for (r, s, c, t), (impl, u) in itertools.product(
            [(1, 1, 8, 1), (1, 1, 4, 2), (2, 1, 4, 1), (1, 2, 2, 2), (1, 1, 2, 4)],
            [("ring", None), ("ulysses", None), ("usp", 2), ("usp", 4)]):
        lay = Layout(r, s, c, t, False, impl, u)
        if u is not None and (u >= c or c % u):
            continue
        cfg = ParallelismConfig(r, s, c, t, cp_impl=impl, cp_ulysses_size=u).resolve(lay.world)
        groups = all_groups(cfg)
        want = {g: any(len({rank // gpus_per_node for rank in members}) > 1 for members in groups[g])
                for g in AXES}
        assert crosses_nodes(lay, gpus_per_node) == want, (lay, gpus_per_node)


def test_all_to_all_is_exposed_and_placed():
    """The time model: Ulysses' all-to-all is added to the step (not hidden behind attention), at
    NVLink speed while u x tp fits a node and at the inter-node speed once it does not."""
    model, batch, opts, cluster = _llama("llama-3.1-8b"), Batch(2, 1, 65536), Options(), Cluster()
    inside = plan(model, Layout(1, 1, 8, 2, True, "usp", 4), batch, opts, cluster)
    across = plan(model, Layout(1, 1, 8, 2, True, "ulysses"), batch, opts, cluster)
    assert not inside["comm"]["cp_ulysses"]["crosses_nodes"] and inside["comm"]["cp_ring"]["crosses_nodes"]
    assert across["comm"]["cp_ulysses"]["crosses_nodes"]
    for p in (inside, across):
        t = p["time"]
        assert t["all_to_all_s"] == p["comm"]["cp_ulysses"]["seconds"] > 0
        assert t["step_s"] >= t["compute_s"] + t["tp_s"] + t["all_to_all_s"]


def test_search_ranks_every_cp_impl():
    """--search tries ring, ulysses (where u = cp splits the heads) and usp for each 1 < u < cp."""
    model = ModelShape(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=8,
                       num_attention_heads=12, num_key_value_heads=4, head_dim=128)
    batch = Batch(8, 1, 32768)
    impls = {}
    for lay, _ in candidates(model, batch, 8, pipeline=False):
        impls.setdefault((lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp), set()).add(
            (lay.cp_impl, lay.ulysses_size()))
    # 12 heads: cp 8 cannot be all Ulysses (12 % 8), its u = 2 and 4 can; under tp 2, 6 heads
    assert impls[(1, 1, 8, 1)] == {("ring", 1), ("usp", 2), ("usp", 4)}
    assert impls[(1, 2, 4, 1)] == {("ring", 1), ("ulysses", 4), ("usp", 2)}
    assert impls[(1, 1, 4, 2)] == {("ring", 1), ("usp", 2)}
    assert impls[(1, 8, 1, 1)] == {("ring", 1)}
    s = search(model, batch, Options(), Cluster(), 8, pipeline=False)
    ranked = {(p["layout"]["cp"], p["layout"]["cp_impl"]) for p in s["ranked"]}
    assert {"ring", "ulysses", "usp"} <= {impl for cp, impl in ranked if cp > 1}
    assert s["recommended"] in s["ranked"]


def test_llama_configs_plan_ulysses():
    """The shipped model configs split under Ulysses at cp 8 (32 / 64 query heads, 8 KV heads)."""
    for name in ("llama-3.1-8b", "llama-3.1-70b"):
        assert check(_llama(name), Layout(1, 1, 8, 1, False, "ulysses"), Batch(8, 1, 8192)) == []
