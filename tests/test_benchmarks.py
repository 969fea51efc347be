"""The benchmark programs run (so they cannot rot) and report what they measure, not what they assume."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import run_all  # noqa: E402


def _check_rows(data, rounds):
    rows = {(r["comparison"], r["variant"]): r for r in data["rows"]}
    for r in rows.values():                    # every row measured, in every round, the same way
        assert len(r["rounds"]) == rounds
        assert all(x["step_s"] > 0 and x["cpu_s"] > 0 and x["peak_rss"] > 0 for x in r["rounds"]), r["variant"]
    return rows


def test_quick_subset_measures_every_row(tmp_path):
    """The smallest cell, one round, ZeRO-3 vs FSDP2 and ring attention vs SDPA (the rest: the slow twin)."""
    run_all.main(["--quick", "--rounds", "1", "--only", "zero3", "cp", "--out", str(tmp_path)])
    data = json.load(open(tmp_path / "quick.json"))
    rows = _check_rows(data, 1)
    mine, peer = rows[("zero3", "minipar ZeRO-3")], rows[("zero3", "torch FSDP2")]
    assert mine["peer"] == "torch FSDP2" and "ratio" in mine
    # the same bytes as FSDP2 with its defaults (root gathered once), up to padding
    for op in ("all_gather", "reduce_scatter"):
        assert mine["comm"][op] == pytest.approx(peer["comm"][op], rel=0.02), op
    assert mine["gathered_exact"] > 0 and peer["gathered_sampled"] > 0
    ring = rows[("cp", "ring attention")]
    L = ring["cp_seq"] // 2                    # cp = 2: one hop forward (K, V), K, V + dK, dV backward
    assert ring["comm"]["send_recv"] == 3 * 2 * 4 * L * 64 * 4
    assert rows[("cp", "SDPA 1 process (enable_gqa)")]["gqa"] == "enable_gqa"
    text = open(tmp_path / "quick.md").read()
    assert "ZeRO-3 vs torch FSDP2" in text and "Ring attention" in text and "quick.json" in text


@pytest.mark.slow
def test_quick_runs_every_comparison(tmp_path):
    run_all.main(["--quick", "--out", str(tmp_path)])
    rows = _check_rows(json.load(open(tmp_path / "quick.json")), 2)
    assert {c for c, _ in rows} == set(run_all.COMPARISONS)
    acc = rows[("accumulation", "minipar ZeRO-3 accum no-sync")]
    each = rows[("accumulation", "minipar ZeRO-3 accum sync-each")]
    assert 2 * acc["comm"]["reduce_scatter"] == each["comm"]["reduce_scatter"]
    assert acc["held_unsharded_grads"] == each["state_bytes"] * 2 and each["held_unsharded_grads"] == 0


def test_bench_gpu_cpu_tiny_path(tmp_path):
    out = tmp_path / "gpu.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--device", "cpu",
                          "--tiny", "--out", str(out)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.load(open(out))["result"]
    assert r["backend"] == "gloo" and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_memory_bytes"] > 0
    assert r["attention"]["kernel"] == "cpu" and r["attention"]["max_abs_err_vs_sdpa"] < 0.05   # bf16 vs fp32
    assert r["planner"] is not None or "minipar.plan" in r["planner_note"]
    assert "MFU" in res.stdout and "peak memory" in res.stdout
