"""LoRA against a full fine-tune, measured: the same model, the same layout, the same batches.

    python benchmarks/bench_lora.py [--size 10M] [--dp-shard 2] [--cp 1] [--tp 2] [--lora-r 16]
                                    [--steps 5] [--rounds 2]

Two variants of one training run (the trainer's own step: forward, backward, the reductions, clip,
AdamW), each in a fresh world of forked gloo ranks (benchmarks/common.py):

    full   every weight trained: ZeRO-3 reduce-scatters every unit's gradient over dp_shard_cp,
           AdamW holds two fp32 states per element of the rank's shards
    lora   adapter: lora, every projection (lora_target_linear), rank r: the base frozen and still
           sharded (gathered for forward and backward, never reduced), the adapters whole on every
           rank of dp_shard_cp and all-reduced over dp_cp (minipar/lora/adapter.py)

Per variant, per rank: the trainable elements and the bytes of their gradients (what backward leaves
to step: the shard gradients, or the adapters'), AdamW's state bytes, the bytes a rank puts on the
wire per step (the comm ledger, every collective of the step), the step time (the slowest rank,
median of --steps, best of --rounds interleaved rounds), the peak resident memory above the rank's
baseline (VmHWM), and the size of the checkpoint the run saves after its steps (a full run: shards
of every weight and two AdamW states; LoRA: the adapters and theirs).

On a machine with fewer cores than ranks, ranks share cores and wall times mostly show the queue;
bytes and memory are exact whatever the load. The script refuses to write its results when the load
average at the start exceeds the core count (--quick, for the tests, writes only where --out says).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from common import MB, SIZES, Measurement, run_variant, timed_world  # noqa: E402

from minipar import comm_ledger  # noqa: E402
from minipar.trainer.run_setup import setup_run  # noqa: E402
from minipar.trainer.trainer import Trainer  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "bench_lora")


def _argv(args, out: str, lora: bool):
    size = SIZES[args.size]
    argv = [os.path.join(ROOT, "configs", "ddp.yaml"),
            "--dataset", os.path.join(ROOT, "data", "shakespeare.txt"),
            "--model.vocab_size", str(size.vocab), "--model.hidden_size", str(size.hidden),
            "--model.intermediate_size", str(size.intermediate),
            "--model.num_hidden_layers", str(size.layers),
            "--model.num_attention_heads", "8", "--model.num_key_value_heads", "4",
            "--sequence_len", str(size.seq), "--global_batch_size", str(size.rows * args.dp_shard),
            "--dp_replicate_size", "1", "--dp_shard_size", str(args.dp_shard),
            "--context_parallel_size", str(args.cp), "--tensor_parallel_size", str(args.tp),
            "--max_steps", "1000", "--eval_steps", "0", "--logging_steps", "100000",
            "--progress_bar", "false",
            "--save_steps", "0", "--save_final_checkpoint", "false", "--export_hf", "false",
            "--output_dir", out, "--learning_rate", "1e-3"]
    if lora:
        argv += ["--adapter", "lora", "--lora_r", str(args.lora_r), "--lora_alpha", str(2 * args.lora_r),
                 "--lora_target_linear", "true"]
    return argv


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _rank(args, out: str, lora: bool):
    """One rank of one variant: the trainer's steps, timed; then what the rank holds and saves."""
    state = dict(step=0)

    def build():
        trainer = Trainer(setup_run(_argv(args, out, lora)))
        params = [p for g in trainer.optimizer.param_groups for p in g["params"]]

        def step():
            with comm_ledger.ledger() as led:
                trainer.train_step(state["step"])
            state["step"] += 1
            state["sent"] = led.wire_bytes()

        def extras():
            optim = _nbytes(v for st in trainer.optimizer.state.values() for v in st.values()
                            if torch.is_tensor(v) and v.dim() > 0)
            path = trainer.save(state["step"])          # collective; rank 0 sums the files
            ckpt = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            return dict(sent=state["sent"], trainable=sum(p.numel() for p in params),
                        grad_bytes=_nbytes(params), optim_bytes=optim, ckpt_bytes=ckpt,
                        held_bytes=_nbytes(trainer.model.parameters()))
        return step, extras
    return timed_world(build, args.steps)


def measure(args):
    rows = {}
    ranks = args.dp_shard * args.cp * args.tp
    for _ in range(args.rounds):                   # interleaved: load bursts hit both variants alike
        for name, lora in (("full", False), ("lora", True)):
            out = tempfile.mkdtemp(prefix=f"bench-lora-{name}-")
            try:
                r = run_variant(_rank, ranks, args, out, lora, timeout=1800)
            finally:
                shutil.rmtree(out, ignore_errors=True)
            if name not in rows or r["step_s"] < rows[name]["step_s"]:
                rows[name] = r
    return rows


def table(rows) -> str:
    out = ["| variant | trainable elements/rank | gradient MiB/rank | AdamW MiB/rank | params held MiB/rank "
           "| MiB sent/rank/step | step ms | peak MiB/rank | checkpoint MiB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        out.append(f"| {name} | {r['trainable']:,} | {r['grad_bytes'] / MB:.3f} | "
                   f"{r['optim_bytes'] / MB:.3f} | "
                   f"{r['held_bytes'] / MB:.3f} | {r['sent'] / MB:.3f} | {1e3 * r['step_s']:.1f} | "
                   f"{r['peak_rss'] / MB:.1f} | {r['ckpt_bytes'] / MB:.3f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10M", choices=sorted(SIZES))
    ap.add_argument("--dp-shard", type=int, default=2)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="the 1M model, dp_shard 2, 1 step, 1 round (the tests)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        if args.out == DEFAULT_OUT:
            ap.error("refusing to write a --quick run into benchmarks/results/: pass --out")
        args.size, args.dp_shard, args.cp, args.tp = "1M", 2, 1, 1
        args.lora_r, args.steps, args.rounds = 4, 1, 1
    if min(args.dp_shard, args.cp, args.tp, args.lora_r, args.steps, args.rounds) < 1:
        ap.error("--dp-shard, --cp, --tp, --lora-r, --steps and --rounds must be >= 1")
    run = Measurement("bench_lora.py", argv)
    rows = measure(args)
    run.done()
    size = SIZES[args.size]
    head = ["# LoRA against a full fine-tune (benchmarks/bench_lora.py)", "",
            f"`{run.command}`: the {args.size} model ({size.n_params / 1e6:.1f} M parameters), dp_shard "
            f"{args.dp_shard} x cp {args.cp} x tp {args.tp}, {size.rows} x {size.seq} tokens per dp rank per "
            f"step, fp32; LoRA r={args.lora_r}, alpha={2 * args.lora_r} on every projection. Median of "
            f"{args.steps} step(s), best of {args.rounds} round(s); CPU, gloo, 1 torch thread per forked "
            f"rank, {run.machine()} Bytes are exact (the tensors, the comm ledger); "
            f"peak MiB is resident memory above the rank's baseline.", ""]
    md = "\n".join(head + [table(rows), ""])
    return run.save(args.out, md, args.quick, rows=[dict(variant=n, **r) for n, r in rows.items()])


if __name__ == "__main__":
    sys.exit(main())
