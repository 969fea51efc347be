r"""The trainer's pipeline step with and without pipeline_overlap_steps: tokens/s of train.py's own
Trainer (data, schedule, AdamW, log) on pp 2, for 1F1B and ZB-V.

    .venv/bin/python benchmarks/bench_pp_overlap.py             writes benchmarks/results/bench_pp_overlap.md
    .venv/bin/python benchmarks/bench_pp_overlap.py --quick     a smoke run at a tiny shape, printed only

What it shows. A synchronous trainer ends each step with collectives over every stage (the loss,
the global gradient norm, the stop flag), so each step starts from an empty pipeline and pays its
fill. With pipeline_overlap_steps (and max_grad_norm 0, which it needs) each stage updates its own
layers and starts the next step at once; the next step's fill then overlaps this one's drain.
pipeline_parallel/simulate.py says which schedule gains: ZB-V, whose V ends on rank 0 while the
other ranks finish on the W's they kept back (its steady bubble is zero once m >= 2p - 1); 1F1B
gains nothing (its other ranks have no work left to fill the time with). Both schedules run both
ways here, with clipping off in all four runs so that only the overlap differs.

Each run: 2 forked gloo ranks (one a core, one torch thread each), --steps optimizer steps of a
Llama of hidden --hidden, 4 layers, micro-batches of 1 x --seq tokens, m = --micro micro-batches a
step; the figure is the median tokens/s of the steps after the first (the trainer's own
metrics.jsonl record of each step's time, which under overlap is the time one stage's step took:
the pace of the pipeline once it runs). bench_pp.py measures the schedules themselves, one step
and steps back to back, beside their ideals.

Run it with nothing else on the machine: it records the load average at its start and end and
refuses to write under benchmarks/results/ when the load at the start exceeds the core count.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402
from harness import run_world  # noqa: E402

from minipar.training.run_setup import setup_run  # noqa: E402
from minipar.training.trainer import Trainer  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
DATA = os.path.join(ROOT, "data", "shakespeare.txt")


def _train(argv):
    torch.set_num_threads(1)
    return [(r["step"], r["tokens_per_s"], r["loss"]) for r in Trainer(setup_run(argv)).train()]


def _argv(args, out, schedule, overlap):
    heads = args.hidden // 64
    return [os.path.join(ROOT, "configs", "pp.yaml"), "--pipeline_parallel_size", "2",
            "--pipeline_schedule", schedule, "--pipeline_overlap_steps", str(overlap).lower(),
            "--max_grad_norm", "0", "--model.hidden_size", str(args.hidden),
            "--model.intermediate_size", str(3 * args.hidden), "--model.num_hidden_layers", "4",
            "--model.num_attention_heads", str(heads), "--model.num_key_value_heads", str(max(1, heads // 2)),
            "--sequence_len", str(args.seq), "--global_batch_size", str(args.micro),
            "--micro_batch_size", "1",
            "--max_steps", str(args.steps), "--eval_steps", "0", "--logging_steps", "1000",
            "--progress_bar", "false", "--save_steps", "0", "--save_final_checkpoint", "false",
            "--export_hf", "false", "--dataset", DATA, "--output_dir", out]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=8,
                    help="micro-batches per step (m; ZB-V's V is full at m >= 3)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="hidden 64, seq 32, 4 steps; prints only")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_pp_overlap.md"))
    args = ap.parse_args(argv)
    if args.quick:
        args.hidden, args.seq, args.steps = 64, 32, 4
    problems = [f"--{k} must be at least {low}, got {getattr(args, k)}"
                for k, low in (("steps", 3), ("micro", 2)) if getattr(args, k) < low]
    if args.hidden < 64 or args.hidden % 64:
        problems.append(f"--hidden must be a positive multiple of 64 (heads of 64), got {args.hidden}")
    if problems:
        ap.error("; ".join(problems))
    load_start, cores, t0 = os.getloadavg()[0], os.cpu_count(), time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("1f1b", "zbv"):
            for overlap in (False, True):
                out = os.path.join(tmp, f"{schedule}-{overlap}")
                curve = run_world(_train, 2, _argv(args, out, schedule, overlap), timeout=1800)[0]
                rate = statistics.median(t for _, t, _ in curve[1:])
                rows.append((schedule, overlap, rate, curve[-1][2]))
                print(f"  {schedule} overlap={overlap}: {rate:.0f} tokens/s", flush=True)
    load_end = os.getloadavg()[0]
    lines = ["# The pipeline step, synchronous and overlapped (bench_pp_overlap.py)", "",
             f"train.py's Trainer on pp 2 (2 forked gloo ranks, one torch thread each), a Llama of hidden "
             f"{args.hidden} and 4 layers, {args.micro} micro-batches of 1 x {args.seq} tokens a step, fp32, "
             f"max_grad_norm 0 in every run, {args.steps} steps (median tokens/s of steps 2-{args.steps}); "
             f"torch {torch.__version__}, {cores} cores, load average {load_start:.2f} at the start and "
             f"{load_end:.2f} at the end.", "",
             "| schedule | pipeline_overlap_steps | tokens/s | over the synchronous run | final loss |",
             "|---|---|---|---|---|"]
    for schedule, overlap, rate, loss in rows:
        base = next(r for s, o, r, _ in rows if s == schedule and not o)
        lines.append(f"| {schedule} | {str(overlap).lower()} | {rate:.0f} | {rate / base:.3f} | {loss:.4f} |")
    lines += ["", "The final losses of a schedule agree: the updates are the same, only the stages stop "
              "waiting for each other.", "",
              f"Regenerate: `python benchmarks/bench_pp_overlap.py` ({time.time() - t0:.0f} s)."]
    text = "\n".join(lines) + "\n"
    print(text)
    published = os.path.abspath(args.out).startswith(RESULTS + os.sep)
    if args.quick or (published and load_start > cores):
        print(f"not written: {'--quick' if args.quick else f'load average {load_start:.1f} at the start'}")
        return rows
    with open(args.out, "w") as f:
        f.write(text)
    return rows


if __name__ == "__main__":
    main()
