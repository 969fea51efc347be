"""Every side-by-side comparison in one fair run: minipar against torch's own implementation.

    python -m benchmarks                  the full table (3 sizes x 2 and 4 ranks), ~20 min on 2 cores
    python -m benchmarks --quick          the smallest cell (1M parameters, 2 ranks), under a minute
    python -m benchmarks --report         rewrite results/README.md and summary.md from results/run_all.json
    python -m benchmarks --only cp --merge   rerun the CP cells only, the other rows of run_all.json kept

    comparison         minipar                       peer (torch)
    zero3              ZeRO-3 (prefetch 1)           FSDP2 fully_shard, its defaults
    accumulation       ZeRO-3, 2 micro-batches,      FSDP2, 2 micro-batches, set_requires_gradient_sync(False)
                       no_sync() / sync each         on the first
    ddp                DDP (bucketed)                DistributedDataParallel
    tp                 TP, TP + SP                   DTensor parallelize_module, the same plan (+ SP)
    cp                 ring attention (zigzag),      one process, SDPA with enable_gqa=True
                       ulysses, usp (u = 2, cp >= 4)

Fairness: every variant runs in a fresh world of forked processes (common.py), so its memory is its
own: peak resident set over the post-import baseline, the same measure for every row, none
computed. Variants of a comparison are interleaved, A B A B, for --rounds rounds (>= 5 in the full
run); each round's value is the median of its timed steps; the table prints the median over rounds
and [min-max], and the ratio to the peer taken round by round (paired, so machine drift cancels).
Tensor-level gathered bytes (ZeRO-3 / FSDP2) are sampled the same way for both (cases_dp.py).

CP cells run attention alone at sequence 2048, 4096 and 8192 (the 1M, 10M and 50M cells; --quick: 512);
`python -m benchmarks --only cp --merge` runs only them and keeps the file's other rows (without --merge
the results file is rewritten with the cells of this run alone).

Results: results/run_all.json (every round of every row) and, generated from it (report.py),
results/README.md (every row) and results/summary.md (one line per variant, which the README copies);
--quick writes the smallest cell to files named quick.* in results/ instead. CPU numbers from gloo on a shared
machine: per-step overheads and exact bytes, not GPU overlap (benchmarks/bench_gpu.py is for that).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from common import MB, SIZES, run_variant, spread  # noqa: E402
from report import COMPARISONS, report, summary  # noqa: E402

PEERS = {"minipar ZeRO-3": "torch FSDP2", "minipar ZeRO-3 accum no-sync": "torch FSDP2 accum no-sync",
         "minipar ZeRO-3 accum sync-each": "torch FSDP2 accum no-sync", "minipar DDP": "torch DDP",
         "minipar TP": "DTensor TP", "minipar TP + SP": "DTensor TP + SP",
         "ring attention": "SDPA 1 process (enable_gqa)",
         "ring attention, no overlap": "SDPA 1 process (enable_gqa)",
         "ring attention, contiguous": "SDPA 1 process (enable_gqa)",
         "ulysses attention": "SDPA 1 process (enable_gqa)",
         "usp attention (ulysses 2 x ring)": "SDPA 1 process (enable_gqa)"}
QUICK_CP_SEQ = 512                            # --quick: the CP cell at a short sequence
STEPS = {"1M": 3, "10M": 2, "50M": 1}        # timed steps per world (after one warm-up step)


def _variants(comparison, ranks):
    """The variants of a comparison that run at `ranks` (USP needs cp >= 4), and their world function."""
    import cases_cp
    import cases_dp
    import cases_tp
    variants, fn = {"zero3": (cases_dp.ZERO3, cases_dp.dp_world),
                    "accumulation": (cases_dp.ACCUM, cases_dp.dp_world),
                    "ddp": (cases_dp.DDP, cases_dp.dp_world), "tp": (cases_tp.TP, cases_tp.tp_world),
                    "cp": (cases_cp.CP, cases_cp.cp_world)}[comparison]
    if comparison == "cp":
        variants = [v for v in variants if cases_cp.runs_at(v, ranks)]
    return variants, fn


def _preimport():
    """Import in the parent what the variants use, so that each forked world starts at once."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    import minipar.context_parallel  # noqa: F401
    import minipar.data_parallel  # noqa: F401
    import minipar.zero3  # noqa: F401
    import models.llama  # noqa: F401


def cells(args):
    """In the order a run cut short by --budget-min loses least: at the smallest world size every
    comparison at the smallest model, then ZeRO-3 vs FSDP2 at the larger ones (how memory grows
    with size), then the other comparisons at them; then the same at the next world size."""
    out = []
    for ranks in args.ranks:
        for size in args.sizes:
            for comparison in args.only:
                if comparison == "accumulation" and ranks != min(args.ranks):
                    continue                      # its point is bytes and memory: one world size
                out.append((comparison, size, ranks))
    def order(c):
        tier = 0 if c[1] == args.sizes[0] else 1 if c[0] == "zero3" else 2
        return args.ranks.index(c[2]), tier, args.sizes.index(c[1]), args.only.index(c[0])
    return sorted(out, key=order)


def run_cell(comparison, size_name, ranks, rounds, steps, log, deadline=None, cp_seq=None):
    variants, fn = _variants(comparison, ranks)
    size = SIZES[size_name] if cp_seq is None else dataclasses.replace(SIZES[size_name], cp_seq=cp_seq)
    per_round = {v: [] for v in variants}
    for r in range(rounds):
        if deadline is not None and r >= 1 and time.perf_counter() > deadline:
            log(f"  [{comparison} {size_name} x{ranks}] out of time after {r} of {rounds} rounds")
            break
        for v in variants:                        # A B A B: the variants of one round back to back
            world = 1 if v.startswith("SDPA") else ranks
            t0 = time.perf_counter()
            res = run_variant(fn, world, v, size, steps)
            per_round[v].append(res)
            log(f"  [{comparison} {size_name} x{ranks}] round {r + 1}/{rounds} {v}: "
                f"{res['step_s'] * 1e3:.0f} ms/step, peak RSS +{res['peak_rss'] / MB:.0f} MB "
                f"({time.perf_counter() - t0:.0f} s)")
    rows = []
    for v in variants:
        rs = per_round[v]
        row = dict(comparison=comparison, size=size_name, n_params=size.n_params, ranks=ranks,
                   world=1 if v.startswith("SDPA") else ranks, variant=v, peer=PEERS.get(v),
                   tokens_per_rank=size.rows * size.seq, cp_seq=size.cp_seq if comparison == "cp" else None,
                   steps_per_round=steps, rounds=rs,
                   step_ms=spread([x["step_s"] * 1e3 for x in rs]),
                   cpu_ms=spread([x["cpu_s"] * 1e3 for x in rs]),
                   peak_rss_mb=spread([x["peak_rss"] / MB for x in rs]))
        if row["peer"] in per_round:
            peer = per_round[row["peer"]]
            row["ratio"] = spread([a["step_s"] / b["step_s"] for a, b in zip(rs, peer)])
            row["cpu_ratio"] = spread([a["cpu_s"] / b["cpu_s"] for a, b in zip(rs, peer)])
        for key in ("comm", "wire", "collectives", "gathered_sampled", "gathered_exact",
                    "held_unsharded_grads", "state_bytes", "gqa"):
            if key in rs[-1]:
                row[key] = rs[-1][key]            # exact quantities: the same in every round
        rows.append(row)
    return rows


def _write_tables(data, md) -> str:
    """README.md (every row) and summary.md (one line per variant) next to it; with --quick, the
    same pair under quick names."""
    text, short_text = report(data), summary(data)
    with open(md, "w") as f:
        f.write(text)
    short = os.path.join(os.path.dirname(md), "quick_summary.md" if md.endswith("quick.md") else "summary.md")
    with open(short, "w") as f:
        f.write(short_text)
    return text + "\n" + short_text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the smallest cell only (1M, 2 ranks, 2 rounds)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; quick 2)")
    p.add_argument("--sizes", nargs="+", default=None, choices=list(SIZES))
    p.add_argument("--ranks", nargs="+", type=int, default=None)
    p.add_argument("--only", nargs="+", default=list(COMPARISONS), choices=COMPARISONS)
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="directory of the results")
    p.add_argument("--report", action="store_true",
                   help="only regenerate README.md and summary.md from run_all.json")
    p.add_argument("--merge", action="store_true",
                   help="run this run's cells (--only, --sizes, --ranks), keep the results file's other rows")
    p.add_argument("--resume", action="store_true",
                   help="keep the cells already in the results file, run the rest")
    p.add_argument("--budget-min", type=float, default=None,
                   help="start no new cell after this many minutes (the cells left out are listed)")
    args = p.parse_args(argv)
    name = "quick" if args.quick else "run_all"
    path = os.path.join(args.out, f"{name}.json")
    md = os.path.join(args.out, "quick.md" if args.quick else "README.md")
    if args.report:
        with open(path) as f:
            print(_write_tables(json.load(f), md))
        return
    args.sizes = args.sizes or (["1M"] if args.quick else list(SIZES))
    args.ranks = args.ranks or ([2] if args.quick else [2, 4])
    args.rounds = args.rounds or (2 if args.quick else 5)
    if args.merge and args.resume:
        raise ValueError("--merge reruns this run's cells, --resume skips the cells already run: pick one")
    if args.rounds < 1 or any(r < 2 for r in args.ranks):
        raise ValueError(f"--rounds must be >= 1 and --ranks >= 2, got {args.rounds} and {args.ranks}")
    _preimport()
    os.makedirs(args.out, exist_ok=True)
    import torch
    start = time.perf_counter()
    shown = [a for a in (argv if argv is not None else sys.argv[1:])]
    if "--out" in shown:                                  # where it wrote is not part of what it ran
        i = shown.index("--out")
        del shown[i:i + 2]
    cmd = " ".join(["python -m benchmarks", *shown])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    meta = dict(command=cmd, json=os.path.relpath(path, os.path.dirname(HERE)), rounds=args.rounds,
                commit=commit, torch=torch.__version__, cpus=os.cpu_count(), load_start=os.getloadavg()[0],
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                sizes=args.sizes, ranks=args.ranks, notes=[], duration_s=0.0, load_end=os.getloadavg()[0])
    rows = []
    todo = list(cells(args))
    if args.resume and os.path.exists(path):            # a run cut short: keep its cells, run the rest
        with open(path) as f:
            before = json.load(f)
        rows = before["rows"]
        done = {(r["comparison"], r["size"], r["ranks"]) for r in rows}
        todo = [c for c in todo if c not in done]
        meta["notes"] = before["meta"].get("notes", []) + [
            f"resumed: {len(done)} cells from the run of {before['meta']['date']} (commit "
            f"{before['meta'].get('commit', '?')}, {before['meta']['duration_s']:.0f} s) kept"]
        meta["load_start"] = before["meta"]["load_start"]
        start -= before["meta"]["duration_s"]           # durations and the budget count both runs
    if args.merge and os.path.exists(path):             # rerun some cells (one comparison), keep the rest
        with open(path) as f:
            before = json.load(f)
        rerun = set(todo)
        rows = [r for r in before["rows"] if (r["comparison"], r["size"], r["ranks"]) not in rerun]
        kept = sorted({(r["comparison"], r["size"], r["ranks"]) for r in rows})
        meta["notes"] = before["meta"].get("notes", []) + [
            f"merged: {len(kept)} cells ({', '.join(sorted({c for c, _, _ in kept}))}) from the run of "
            f"{before['meta']['date']} (commit {before['meta'].get('commit', '?')}, "
            f"`{before['meta']['command']}`) kept; the header describes the run of the other cells"]
    data = dict(meta=meta, rows=rows)
    for i, (comparison, size, ranks) in enumerate(todo):
        if args.budget_min is not None and time.perf_counter() - start > 60 * args.budget_min:
            left = ", ".join(f"{c} {s} x{r}" for c, s, r in todo[i:])
            meta["notes"].append(f"cut for time (--budget-min {args.budget_min:g}): not run: {left}")
            print(meta["notes"][-1], flush=True)
            break
        print(f"[{i + 1}/{len(todo)}] {comparison}, {size}, {ranks} ranks "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        steps = 1 if args.quick else STEPS[size]
        try:
            deadline = None if args.budget_min is None else start + 60 * args.budget_min
            got = run_cell(comparison, size, ranks, args.rounds, steps, lambda m: print(m, flush=True),
                           deadline, cp_seq=QUICK_CP_SEQ if args.quick and comparison == "cp" else None)
            if len(got[0]["rounds"]) < args.rounds:
                meta["notes"].append(f"{comparison} {size} x{ranks}: "
                                     f"{len(got[0]['rounds'])} of {args.rounds} "
                                     f"rounds (cut for time)")
            rows += got
        except Exception as err:                         # one failed cell must not lose the others
            meta["notes"].append(f"{comparison} {size} x{ranks} failed: "
                                 f"{str(err).strip().splitlines()[-1][:300]}")
            print(f"FAILED: {err}", flush=True)
        meta.update(duration_s=time.perf_counter() - start, load_end=os.getloadavg()[0])
        with open(path + ".tmp", "w") as f:             # after every cell: a crash keeps what ran
            json.dump(data, f, indent=1)
        os.replace(path + ".tmp", path)
    meta.update(duration_s=time.perf_counter() - start, load_end=os.getloadavg()[0])
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(_write_tables(data, md))
    print(f"wrote {path}, {md} and its summary in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
