"""The benchmark programs run (so they cannot rot) and report what they measure, not what they assume."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import run_all  # noqa: E402
from harness import run_program  # noqa: E402


def _check_rows(data, rounds):
    rows = {(r["comparison"], r["variant"]): r for r in data["rows"]}
    for r in rows.values():                    # every row measured, in every round, the same way
        assert len(r["rounds"]) == rounds
        assert all(x["step_s"] > 0 and x["cpu_s"] > 0 and x["peak_rss"] > 0
                   for x in r["rounds"]), r["variant"]
    return rows


def test_quick_subset_measures_every_row(tmp_path):
    """The smallest cell, one round: ZeRO-3 vs FSDP2, TP vs DTensor and ring attention and Ulysses vs
    SDPA (the rest: the slow twin)."""
    run_all.main(["--quick", "--rounds", "1", "--only", "zero3", "tp", "cp", "--out", str(tmp_path)])
    data = json.load(open(tmp_path / "quick.json"))
    assert not [n for n in data["meta"]["notes"] if "failed" in n], data["meta"]["notes"]
    rows = _check_rows(data, 1)
    assert {c for c, _ in rows} == {"zero3", "tp", "cp"}
    # the same plan: DTensor's plain TP reduces each Colwise input gradient itself, minipar once per
    # shared input; with SP both move activations by reduce-scatter + all-gather pairs, the same number
    tp, dt = rows[("tp", "minipar TP")]["collectives"], rows[("tp", "DTensor TP")]["collectives"]
    assert tp["all_reduce"] < dt["all_reduce"]
    sp, dsp = rows[("tp", "minipar TP + SP")]["collectives"], rows[("tp", "DTensor TP + SP")]["collectives"]
    assert sp["reduce_scatter"] == dsp["reduce_scatter"] and sp["all_gather"] == dsp["all_gather"]
    mine, peer = rows[("zero3", "minipar ZeRO-3")], rows[("zero3", "torch FSDP2")]
    assert mine["peer"] == "torch FSDP2" and "ratio" in mine
    # the same bytes as FSDP2 with its defaults (root gathered once), up to padding
    for op in ("all_gather", "reduce_scatter"):
        assert mine["comm"][op] == pytest.approx(peer["comm"][op], rel=0.02), op
    assert mine["gathered_exact"] > 0 and peer["gathered_sampled"] > 0
    ring = rows[("cp", "ring attention")]
    L = ring["cp_seq"] // 2                    # cp = 2: one hop forward (K, V), K, V + dK, dV backward
    assert ring["comm"]["send_recv"] == 3 * 2 * 4 * L * 64 * 4 == ring["wire"]
    # Ulysses at cp 2 (context_parallel/ulysses.py): q, k, v, out forward and dout, dq, dk, dv backward,
    # each all-to-all over its (B, H, L, D) buffer, 8 query and 4 KV heads (no repeats at u = 2); the
    # wire carries the half that leaves the rank. USP needs cp >= 4: not in a 2-rank cell
    uly = rows[("cp", "ulysses attention")]
    assert uly["comm"] == {"all_to_all": 2 * (8 + 4 + 4 + 8) * L * 64 * 4}
    assert uly["wire"] == uly["comm"]["all_to_all"] / 2 and uly["peer"] == "SDPA 1 process (enable_gqa)"
    assert ("cp", "usp attention (ulysses 2 x ring)") not in rows and ring["cp_seq"] == run_all.QUICK_CP_SEQ
    assert rows[("cp", "SDPA 1 process (enable_gqa)")]["gqa"] == "enable_gqa"
    text = open(tmp_path / "quick.md").read()
    assert "ZeRO-3 vs torch FSDP2" in text and "Ring attention, Ulysses" in text and "vs DTensor" in text
    assert "quick.json" in text
    line = [l for l in open(tmp_path / "quick_summary.md").read().splitlines() if "| minipar ZeRO-3 |" in l]
    assert len(line) == 1 and f"| {mine['ratio'][0]:.2f} |" in line[0], line


def test_committed_results_and_their_tables_agree():
    """The README and summary under benchmarks/results are what report.py makes of run_all.json today
    (a hand edit, or a report change without `python -m benchmarks --report`, fails here), and a
    summary row's ratios are the per-cell medians of the rows it spans."""
    import report
    res = os.path.join(ROOT, "benchmarks", "results")
    data = json.load(open(os.path.join(res, "run_all.json")))
    assert open(os.path.join(res, "README.md")).read() == report.report(data)
    text = report.summary(data)
    assert open(os.path.join(res, "summary.md")).read() == text
    ratios = [r["ratio"][0] for r in data["rows"] if r["variant"] == "minipar DDP"]
    row = [l for l in text.splitlines() if "| minipar DDP |" in l][0].split(" | ")
    assert row[4] == f"{min(ratios):.2f}-{max(ratios):.2f}"


def test_planner_counts_the_measured_cp_bytes():
    """Every measured CP row's bytes per op (the comm ledger of ring, Ulysses and USP runs) are what
    the planner's cp_attention counts for that attention: the column beside them in the results."""
    import cases_cp
    data = json.load(open(os.path.join(ROOT, "benchmarks", "results", "run_all.json")))
    rows = [r for r in data["rows"] if r["comparison"] == "cp" and "comm" in r]
    assert {r["variant"].split()[0] for r in rows} == {"ring", "ulysses", "usp"}
    for r in rows:
        assert cases_cp.planner_bytes(r["variant"], r["cp_seq"], r["world"]) == r["comm"], r["variant"]


def test_quickstart_results_are_their_table():
    """benchmarks/results/quickstart.md (which the README quotes) is what quickstart.py makes of its
    json, and the json is a real pair of runs: 300 steps each, the losses the runs logged, the
    8-rank curve on the one-process curve."""
    import quickstart
    res = os.path.join(ROOT, "benchmarks", "results")
    data = json.load(open(os.path.join(res, "quickstart.json")))
    assert open(os.path.join(res, "quickstart.md")).read() == quickstart.table(data)
    one, eight = data["runs"]["1"], data["runs"]["8"]
    assert one["steps"] == eight["steps"] == len(one["losses"]) == len(eight["losses"]) == 300
    assert len(eight["peak_rss_mib"]) == 8 and one["final_loss"] == pytest.approx(one["losses"][-1], abs=1e-4)
    diffs = [abs(a - b) for a, b in zip(one["losses"], eight["losses"])]
    assert max(diffs[:50]) < 1e-5 and max(diffs) < 2e-2


@pytest.mark.slow
def test_quick_runs_every_comparison(tmp_path):
    run_all.main(["--quick", "--out", str(tmp_path)])
    data = json.load(open(tmp_path / "quick.json"))
    assert not [n for n in data["meta"]["notes"] if "failed" in n], data["meta"]["notes"]
    rows = _check_rows(data, 2)
    assert {c for c, _ in rows} == set(run_all.COMPARISONS)
    acc = rows[("accumulation", "minipar ZeRO-3 accum no-sync")]
    each = rows[("accumulation", "minipar ZeRO-3 accum sync-each")]
    assert 2 * acc["comm"]["reduce_scatter"] == each["comm"]["reduce_scatter"]
    assert acc["held_unsharded_grads"] == each["state_bytes"] * 2 and each["held_unsharded_grads"] == 0


def test_bench_gpu_cpu_tiny_path(tmp_path):
    out = tmp_path / "gpu.json"
    res = run_program(os.path.join(ROOT, "benchmarks", "bench_gpu.py"), ["--device", "cpu", "--tiny", "--out",
                                                                         str(out)],
                      timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert res.returncode == 0, res.stderr[-2000:]
    r = json.load(open(out))["result"]
    assert r["backend"] == "gloo" and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    assert r["peak_memory_bytes"] > 0
    assert r["attention"]["kernel"] == "cpu" and r["attention"]["max_abs_err_vs_sdpa"] < 0.05   # bf16 vs fp32
    assert r["planner"] is not None or "minipar.plan" in r["planner_note"]
    assert "MFU" in res.stdout and "peak memory" in res.stdout


def _device_check(tmp_path, steps, *extra):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "device_check.py"), "--device", "cpu", "--small",
           "--out", str(tmp_path), "--steps", ",".join(steps), *extra]
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    record = json.load(open(tmp_path / "device_check.json"))
    assert [s["name"] for s in record["steps"]] == steps
    for s in record["steps"]:
        assert s["ok"] and s["rows"] and all(r["ok"] for r in s["rows"]), s
        assert all(r["max_err"] <= r["tol"] for r in s["rows"] if r.get("tol")), s
    table = open(tmp_path / "device_check.md").read()
    assert table.count("\n| ") == 1 + sum(len(s["rows"]) for s in record["steps"])
    return {r["name"] for s in record["steps"] for r in s["rows"]}


def test_device_check_runs_every_step_small_on_the_cpu(tmp_path):
    # the GPU check's logic, small, here (its figures come from a lent GPU): each step in its own
    # process, the kernels against the math path, ring attention and ZeRO-3 as threads against one
    # process, one JSON and one table. The steps that launch programs (syncs: sync_check.py; p2p:
    # device_p2p.py under torchrun; bench_gpu) run in the slow twin below, and bench_gpu also in
    # test_bench_gpu_cpu_tiny_path
    rows = _device_check(tmp_path, ["device", "attention", "ring", "zero3"])
    assert {"ring cp 4 packed float32", "zero3 dp_shard 2: first-step gradients",
            "documents, s>r float32"} <= rows


@pytest.mark.slow
def test_device_check_launches_its_programs_small_on_the_cpu(tmp_path):
    rows = _device_check(tmp_path, ["syncs", "p2p"], "--p2p-schedules", "1f1b,zbv")
    assert {"p2p pp 2 1f1b, m 4", "p2p pp 2 zbv, m 4", "dense step 3: 1 syncs"} <= rows


def test_device_check_kills_a_step_over_its_limit(tmp_path):
    import device_check
    log = str(tmp_path / "log")
    code, secs = device_check._run([sys.executable, "-c", "import time; time.sleep(60)"], 0.3, log)
    assert code == 124 and secs < 30


def test_bench_pp_small_run_matches_its_theory(tmp_path, capsys):
    """bench_pp.py on 2 stages, 2 micro-batches: every schedule's bytes sent equal 2 x boundaries x m
    x bytes(h), the micro-batches held equal the schedule's theory, and the timeline PNG is drawn."""
    import bench_pp
    out = tmp_path / "bench_pp.md"
    results = bench_pp.main(["--cells", "2:2", "--hidden", "64", "--seq", "32", "--micro-batch", "2",
                             "--iters", "1", "--out", str(out)])
    assert {r["schedule"] for r in results} == {"afab", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"}
    act = 2 * 32 * 64 * 4                          # micro-batch 2 x seq 32 x hidden 64, fp32
    for r in results:                              # zbv: 2 (p - 1) boundaries cross ranks, the rest v p - 1
        crossing = 2 * (r["p"] - 1) if r["schedule"] == "zbv" else r["v"] * r["p"] - 1
        assert sum(row["sent"] for row in r["rows"]) == 2 * crossing * r["m"] * act, r["schedule"]
        assert all(row["live"] == row["peak_theory"] for row in r["rows"]), r["schedule"]
        assert all(row["held_w"] > 0 for row in r["rows"]) == (r["schedule"] in ("zb_h1", "zbv"))
    text = out.read_text()
    assert (tmp_path / "bench_pp.png").stat().st_size > 0 and "theory MiB" in text and "load average" in text
    assert "## Against the targets" in text and "| 2 | 2 | zbv |" in text
    for bad, says in ((["--hidden", "32"], "multiple of 64"), (["--cells", "2"], "P:M pairs")):
        with pytest.raises(SystemExit):            # a flag's mistake: argparse's one line, exit 2
            bench_pp.main([*bad, "--out", str(out)])
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit, match="refusing to write"):   # a smoke run never lands in results/
        bench_pp.main(["--quick"])


def test_bench_ep_quick(tmp_path):
    """benchmarks/bench_ep.py in its quick mode: the three variants measured; EP sends the counts and
    four exchanges (the ledger's bytes near the balanced theory), holds half the experts, and the
    rung below it (all experts on every rank) and one process send nothing."""
    import bench_ep
    assert bench_ep.main(["--quick", "--out", str(tmp_path / "ep")]) == 0
    rows = {r["variant"]: r for r in json.load(open(tmp_path / "ep.json"))["rows"]}
    assert set(rows) == {"one process", "all experts", "ep 2"}
    ep, alone = rows["ep 2"], rows["all experts"]
    assert ep["calls"] == 5 and alone["sent"] == rows["one process"]["sent"] == 0
    assert 0.5 * ep["theory"] < ep["sent"] < 1.5 * ep["theory"]
    assert 2 * ep["expert_bytes"] == alone["expert_bytes"] == rows["one process"]["expert_bytes"]


def test_bench_lora_quick(tmp_path):
    """benchmarks/bench_lora.py in its quick mode: LoRA trains a few per cent of the elements, so its
    gradients, AdamW states and checkpoint are that much smaller, it sends less (no reduce-scatter of
    the base), and it still holds the whole frozen base shard; --quick never writes into results/."""
    import bench_lora
    assert bench_lora.main(["--quick", "--out", str(tmp_path / "lora")]) == 0
    rows = {r["variant"]: r for r in json.load(open(tmp_path / "lora.json"))["rows"]}
    full, lora = rows["full"], rows["lora"]
    assert lora["trainable"] < full["trainable"] / 5
    assert lora["optim_bytes"] == 2 * lora["grad_bytes"] and full["optim_bytes"] == 2 * full["grad_bytes"]
    assert lora["grad_bytes"] < full["grad_bytes"] / 5 and lora["ckpt_bytes"] < full["ckpt_bytes"] / 5
    assert lora["sent"] < full["sent"] and lora["held_bytes"] > full["held_bytes"]
    with pytest.raises(SystemExit):
        bench_lora.main(["--quick"])


def test_bench_async_save_quick(tmp_path):
    """benchmarks/bench_async_save.py in its quick mode: both variants saved and timed; the async
    stall is measured beside its host copy; --quick never writes into results/."""
    import bench_async_save
    assert bench_async_save.main(["--quick", "--out", str(tmp_path / "async")]) == 0
    rows = {r["variant"]: r for r in json.load(open(tmp_path / "async.json"))["rows"]}
    assert set(rows) == {"sync", "async"}
    assert all(r["saves"] == 2 and r["ckpt_bytes"] > 0 for r in rows.values())
    assert 0 <= rows["async"]["copy_s"] <= rows["async"]["stall_s"]
    with pytest.raises(SystemExit):
        bench_async_save.main(["--quick"])


def test_bench_generate_quick(tmp_path):
    """benchmarks/bench_generate.py in its quick mode: both variants generate every token, and the
    table and record are written where --out says (never into benchmarks/results/)."""
    import bench_generate
    assert bench_generate.main(["--quick", "--out", str(tmp_path / "gen")]) == 0
    rows = json.load(open(tmp_path / "gen.json"))["rows"]
    assert [r["tokens"] for r in rows] == [32, 48] and all(r["cache_tok_s"] > 0 for r in rows)
    with pytest.raises(SystemExit):
        bench_generate.main(["--quick"])
