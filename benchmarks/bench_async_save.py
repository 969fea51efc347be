"""The training stall of a checkpoint, synchronous against asynchronous (`async_save: true`).

    python benchmarks/bench_async_save.py [--layers 30] [--ranks 4] [--steps 12] [--save-every 4]
                                          [--rounds 2]      (SmolLM-135M's shape on 4 ZeRO-3 ranks)
    python benchmarks/bench_async_save.py --quick --out /tmp/x   (the tests: 1 layer, 2 ranks)

Two variants of one training run (the trainer's own step and its own save, Trainer.save), each in
a fresh world of forked gloo ranks (benchmarks/common.py), interleaved over --rounds:

    sync    save_checkpoint at the step boundary: every rank waits for serialise, write, fsync,
            hash, rename and rotation (trainer/checkpoint/atomic.py)
    async   the state copied to host memory at the boundary, the rest in a background thread
            (trainer/checkpoint/async_save.py) while the next steps run

Every --save-every steps the run saves (save_total_limit 1). Per variant: the plain step time
(median of the steps that neither save nor run beside a write), the saving step (the step plus the
save call at its boundary, the slowest rank), the stall per save (their difference, median over the
saves) and its step-time ratio (saving step / plain step: what a save costs in steps), the host copy
of async (the part of the stall it cannot avoid), and the steps that ran while a background write
was in flight (on a machine whose cores the ranks already fill, the writer competes for them: the
stall moves into those steps, partly, instead of vanishing). The claim measured: the async stall is
the host copy only.

The script refuses to write its results when the load average at the start exceeds the core count
(common.save_results); --quick, a smoke test for the tests, writes only where --out says.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from common import MB, Measurement, run_variant  # noqa: E402

from minipar.trainer.run_setup import setup_run  # noqa: E402
from minipar.trainer.trainer import Trainer  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "bench_async_save")
# SmolLM-135M (as benchmarks/bench_memory.py): vocab 49,152, hidden 576, 9 / 3 heads, tied embeddings
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
             num_key_value_heads=3, tie_word_embeddings=True)
QUICK_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=True)


def _argv(args, out: str, asynchronous: bool):
    model = [x for k, v in args.shape.items() for x in (f"--model.{k}", str(v).lower())]
    return [os.path.join(ROOT, "configs", "fsdp.yaml"), *model, "--model.num_hidden_layers", str(args.layers),
            "--dataset", os.path.join(ROOT, "data", "shakespeare.txt"),
            "--sequence_len", str(args.seq), "--global_batch_size", str(args.ranks),
            "--dp_shard_size", str(args.ranks), "--dtype", "float32", "--max_steps", "100000",
            "--warmup_steps", "0", "--eval_steps", "0", "--logging_steps", "100000",
            "--progress_bar", "false",
            "--save_steps", "0", "--save_final_checkpoint", "false", "--save_total_limit", "1",
            "--export_hf", "false", "--peak_tflops", "1", "--output_dir", out,
            "--async_save", "true" if asynchronous else "false"]


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rank(args, out: str, asynchronous: bool):
    """One rank: a warm-up step, then --steps steps, saving after every --save-every-th; each
    step (and its save) timed on the slowest rank."""
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(_argv(args, out, asynchronous)))
    trainer.train_step(0)
    plain, saving, beside, stalls, copies = [], [], [], [], []
    for step in range(1, args.steps + 1):
        dist.barrier()
        writing = trainer.saver is not None and trainer.saver.pending is not None
        t0 = time.perf_counter()
        trainer.train_step(step)
        t_step = time.perf_counter() - t0
        stall = copy = 0.0
        if step % args.save_every == 0:
            t1 = time.perf_counter()
            trainer.save(step)
            stall = time.perf_counter() - t1
            copy = trainer.saver.last_copy_s if trainer.saver is not None else float("nan")
        t_step, stall, copy = _slowest(t_step), _slowest(stall), _slowest(copy)
        if step % args.save_every == 0:
            saving.append(t_step + stall)
            stalls.append(stall)
            copies.append(copy)
        (beside if writing else plain).append(t_step)
    trainer.finish_saves()
    trainer.close_saves()
    files = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if "step-" in d]
    med = statistics.median
    return dict(step_s=med(plain), saving_step_s=med(saving), stall_s=med(stalls), copy_s=med(copies),
                beside_s=med(beside) if beside else None, saves=len(stalls),
                ckpt_bytes=sum(os.path.getsize(f) for f in files), peak_rss=0)


def measure(args):
    rows = {}
    for _ in range(args.rounds):                   # interleaved: load bursts hit both variants alike
        for name, asynchronous in (("sync", False), ("async", True)):
            out = tempfile.mkdtemp(prefix=f"bench-async-save-{name}-")
            try:
                r = run_variant(_rank, args.ranks, args, out, asynchronous, timeout=1800)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            rows.setdefault(name, []).append(r)
    # per variant, the round with the smallest stall (the least disturbed by other jobs)
    return {name: min(rs, key=lambda r: r["stall_s"]) for name, rs in rows.items()}


def table(rows) -> str:
    out = ["| variant | step ms | saving step ms | stall per save ms | step-time ratio | host copy ms "
           "| steps beside a write ms | checkpoint MiB |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        beside = f"{1e3 * r['beside_s']:.1f}" if r["beside_s"] is not None else "-"
        copy = "-" if r["copy_s"] != r["copy_s"] else f"{1e3 * r['copy_s']:.1f}"      # (nan: sync)
        out.append(f"| {name} | {1e3 * r['step_s']:.1f} | {1e3 * r['saving_step_s']:.1f} | "
                   f"{1e3 * r['stall_s']:.1f} | {r['saving_step_s'] / r['step_s']:.2f} | "
                   f"{copy} | {beside} | {r['ckpt_bytes'] / MB:.1f} |")
    s, a = rows["sync"], rows["async"]
    out += ["", f"async stall / sync stall: {a['stall_s'] / s['stall_s']:.3f}; async stall / its host copy: "
                f"{a['stall_s'] / max(a['copy_s'], 1e-9):.2f}"]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a 1-layer toy on 2 ranks, 4 steps (the tests)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.shape = SHAPE
    if args.quick:
        if args.out == DEFAULT_OUT:
            ap.error("refusing to write a --quick run into benchmarks/results/: pass --out")
        args.shape, args.layers, args.ranks, args.seq = QUICK_SHAPE, 1, 2, 32
        args.steps, args.save_every, args.rounds = 4, 2, 1
    if min(args.layers, args.ranks, args.seq, args.steps, args.save_every, args.rounds) < 1:
        ap.error("--layers, --ranks, --seq, --steps, --save-every and --rounds must be >= 1")
    if args.steps < 2 * args.save_every:
        ap.error(f"--steps {args.steps} must be at least 2 x --save-every ({args.save_every}): a save and "
                 f"plain steps to compare it with")
    run = Measurement("bench_async_save.py", argv)
    rows = measure(args)
    run.done()
    head = ["# The stall of a checkpoint, sync against async (benchmarks/bench_async_save.py)", "",
            f"`{run.command}`: {'a toy' if args.quick else 'SmolLM-135M'} shape, {args.layers} layers, "
            f"dp_shard {args.ranks} (ZeRO-3), {args.seq} tokens per rank per step, fp32, a save every "
            f"{args.save_every} of {args.steps} steps (shards and AdamW states, save_total_limit 1); the "
            f"slowest rank, medians, the least stalled of {args.rounds} interleaved round(s). CPU, gloo, 1 "
            f"torch thread per forked rank, {run.machine()}", ""]
    md = "\n".join(head + [table(rows), ""])
    return run.save(args.out, md, args.quick, rows=[dict(variant=n, **r) for n, r in rows.items()])


if __name__ == "__main__":
    sys.exit(main())
