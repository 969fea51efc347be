r"""Peak resident memory per rank as decoder layers are added, against the planner, at SmolLM-135M's
shape (vocab 49,152, hidden 576, intermediate 1,536, 9 / 3 heads, tied embeddings; fp32,
dp_shard 4 (ZeRO-3), 4 x 256 tokens per step, one micro-batch per rank).

    .venv/bin/python benchmarks/bench_memory.py                      layers 1, 15, 30; writes the table
    .venv/bin/python benchmarks/bench_memory.py --quick              layers 1 and 4, prints only

Each cell is a fresh world of 4 forked gloo ranks running train.py's Trainer for 3 steps. Per rank:
baseline = resident memory before the Trainer is built (Python, torch, the process groups);
runtime = resident memory between steps 2 and 3 less the bytes of every tensor alive then (what the
planner leaves out: libraries paged in, the small-object heap, and freed memory the allocator
kept); peak = the most resident memory during steps 2 and 3 (VmHWM, reset after step 1: the first
step creates AdamW's states, so a run's peak is a later step's); and step 3's peak by phase, as the
planner walks the step (minipar/plan/peak.py): each event of a comm ledger (the ZeRO-3 hooks' marks,
every collective) samples VmHWM and resets it, and the marks say which phase the step is in. The
table shows the rank with the largest peak, its peak less its runtime beside the planner's (python
-m minipar.plan's total for the same run), the growth per decoder layer of both, and every phase.

    allocator   returned    MINIPAR_RETURN_FREED_MEMORY=1 (minipar/trainer/host_memory.py: glibc's
                            mmap threshold fixed, so a freed tensor goes back to the kernel)
                glibc       minipar's default (that setting costs speed): glibc's dynamic threshold
                            keeps freed tensors in its heap, and the peak counts memory that was
                            live at different moments

Memory does not depend on the machine's load (the time would), but the table records the load
average like every benchmark here and is written only when the load at the start is below the
number of cores.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from common import current_rss, peak_rss, reset_peak_rss  # noqa: E402
from harness import run_world  # noqa: E402

from minipar.plan import Batch, Cluster, Layout, ModelShape, Options, plan  # noqa: E402

MiB = 2 ** 20
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
             num_key_value_heads=3, tie_word_embeddings=True)
RANKS, BATCH, SEQ = 4, 4, 256


def argv(layers: int, output_dir: str, shape=SHAPE, seq: int = SEQ):
    model = [x for k, v in shape.items() for x in (f"--model.{k}", str(v).lower())]
    return [os.path.join(ROOT, "configs", "fsdp.yaml"), *model, "--model.num_hidden_layers", str(layers),
            "--model.max_position_embeddings", "2048", "--sequence_len", str(seq),
            "--global_batch_size", str(BATCH), "--dp_shard_size", str(RANKS), "--dtype", "float32",
            "--max_steps", "3", "--warmup_steps", "0", "--eval_steps", "0", "--progress_bar", "false",
            "--save_final_checkpoint", "false", "--export_hf", "false", "--peak_tflops", "1",
            "--output_dir", output_dir]


class PhaseMarks(list):
    """A ledger's event list (minipar/comm_ledger.py) that also samples memory: at each event (the
    ZeRO-3 hooks' marks, every collective) the peak resident memory since the last one (VmHWM, then
    reset) goes to the phase the step is in. The marks give the phases: the forward up to the root's
    end (the loss computes there), the root's backward (lm_head), the layers' backward (to the first
    layer's reduce-scatter), the end of backward (the embedding's, the root's reduce-scatter)."""

    def __init__(self):
        super().__init__()
        self.phase, self.peaks = "loss forward", {}

    def sample(self):
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), peak_rss())
        reset_peak_rss()

    def append(self, event):
        self.sample()
        super().append(event)
        if not isinstance(event, str):
            return
        if event == "zero3.backward <root>":
            self.phase = "head backward"
        elif event.startswith("zero3.backward model.layers.") and self.phase == "head backward":
            self.phase = "layer backward"
        elif event == "zero3.reduce_scatter model.layers.0":
            self.phase = "backward end"


def tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor alive in this process."""
    import gc
    import warnings

    import torch
    seen = {}
    with warnings.catch_warnings():      # isinstance on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in tensors:
        if o.device.type == "cpu":
            s = o.untyped_storage()
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def measure(args, allocator: str):
    """Inside a rank: baseline, runtime, peak of steps 2-3, resident at the end of step 3's forward,
    and step 3's peak by phase, in bytes."""
    import torch

    from minipar import comm_ledger
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    if allocator == "returned":          # the Trainer then fixes glibc's mmap threshold (host_memory.py)
        os.environ["MINIPAR_RETURN_FREED_MEMORY"] = "1"
    run = setup_run(args)
    base = reset_peak_rss()
    tr = Trainer(run)
    forward, step_tail, at_end = tr.parallel.loss, tr.step.tail, []
    marks = PhaseMarks()

    def counted(*a, **k):                # every activation of the micro-batch alive, no gradient yet
        loss = forward(*a, **k)
        at_end.append(current_rss())
        return loss

    def optimizer_step():
        marks.sample()
        marks.phase = "optimizer"
        out = step_tail()
        marks.sample()
        return out
    tr.parallel.loss, tr.step.tail = counted, optimizer_step
    tr.train_step(0)
    reset_peak_rss()
    tr.train_step(1)
    peak = peak_rss()
    # between steps: what is resident but held by no tensor (libraries' pages, the small-object
    # heap, freed memory the allocator kept), the part of a rank's memory the planner leaves out
    runtime = current_rss() - tensor_bytes()
    marks.phase, marks.peaks = "loss forward", {}      # (the wrapper sampled steps 1 and 2 too)
    reset_peak_rss()
    with comm_ledger.ledger() as led:
        led.events = marks
        tr.train_step(2)
    return dict(baseline=base, runtime=runtime, peak=max(peak, *marks.peaks.values()),
                forward_end=at_end[-1], phases=marks.peaks)


def measured(layers: int, allocator: str, shape=SHAPE, seq: int = SEQ) -> dict:
    """The rank with the largest peak: its baseline, runtime, peak, end of forward and phases."""
    with tempfile.TemporaryDirectory() as out:
        per_rank = run_world(measure, RANKS, argv(layers, out, shape, seq), allocator, timeout=1200)
    worst = max(per_rank, key=lambda r: r["peak"])
    return dict(baseline=worst["baseline"], runtime=worst["runtime"], peak=worst["peak"],
                forward_end=worst["forward_end"], phases=worst["phases"])


def planned(layers: int, shape=SHAPE, seq: int = SEQ) -> dict:
    """The planner's peak and its phases, and what it has alive at the end of the forward (the loss
    forward's phase less the logits and z - max: the state less the gradients, which zero_grad freed,
    the gathered root and the micro-batch's activations)."""
    model = ModelShape.from_dict(dict(shape, num_hidden_layers=layers))
    layout, batch = Layout(dp_shard=RANKS), Batch(BATCH, None, seq)
    # these runs are gloo's, whose reduce-scatter works on a copy of its input (peak.py)
    opts = Options(dtype="float32", reduce_scatter_copies_input=True)
    m = plan(model, layout, batch, opts, Cluster())["memory"]
    loss = seq * batch.micro(layout) * model.vocab_size * (4 + 4)
    return dict(planned=m["total"], planned_phases=m["phases"], planned_peak_phase=m["peak_phase"],
                planned_forward_end=m["phases"]["loss forward"] - loss)


def growth(rows, key):
    """MiB per layer between consecutive rows."""
    return [(a["layers"], b["layers"], (b[key] - a[key]) / (b["layers"] - a["layers"]) / MiB)
            for a, b in zip(rows, rows[1:])]


PHASES = ("loss forward", "head backward", "layer backward", "backward end", "optimizer")


def table(rows_by_allocator, load_start, load_end) -> str:
    lines = ["# Peak resident memory per rank against the planner, by decoder layers", "",
             f"SmolLM-135M's shape, fp32, dp_shard {RANKS} (ZeRO-3), {BATCH} x {SEQ} tokens per step; "
             f"peak of steps 2-3, the rank with the largest; {os.cpu_count()} cores, load average "
             f"{load_start:.2f} at the start and {load_end:.2f} at the end. Generated by "
             "`python benchmarks/bench_memory.py` (benchmarks/bench_memory.py says how). runtime: the "
             "resident memory no tensor holds, between steps (the planner leaves it out: libraries, "
             "the small-object heap, and under glibc the freed memory its heap kept).", "",
             "| allocator | layers | baseline MiB | runtime MiB | peak MiB | peak - runtime | planner MiB | "
             "ratio | planner's peak phase | measured |", "|---|---|---|---|---|---|---|---|---|---|"]
    for allocator, rows in rows_by_allocator.items():
        for r in rows:
            net = r["peak"] - r["runtime"]
            at = max(r["phases"], key=r["phases"].get)
            lines.append(f"| {allocator} | {r['layers']} | {r['baseline'] / MiB:.0f} | "
                         f"{r['runtime'] / MiB:.0f} | {r['peak'] / MiB:.0f} | {net / MiB:.0f} | "
                         f"{r['planned'] / MiB:.0f} | "
                         f"{net / r['planned']:.2f} | {r['planned_peak_phase']} | {at} |")
    lines += ["", "Growth per decoder layer (MiB), of the peak and of the end of the forward:", "",
              "| allocator | layers | peak | planner | ratio | end of forward | planner | ratio |",
              "|---|---|---|---|---|---|---|---|"]
    for allocator, rows in rows_by_allocator.items():
        for (a, b, got), (_, _, want), (_, _, fgot), (_, _, fwant) in zip(
                growth(rows, "peak"), growth(rows, "planned"), growth(rows, "forward_end"),
                growth(rows, "planned_forward_end")):
            lines.append(f"| {allocator} | {a} -> {b} | {got:.1f} | {want:.1f} | {got / want:.2f} | "
                         f"{fgot:.1f} | {fwant:.1f} | {fgot / fwant:.2f} |")
    lines += ["", "By phase of step 3 (minipar/plan/peak.py): the peak resident memory less the runtime, "
              "measured / planned, MiB:", "",
              "| allocator | layers | " + " | ".join(PHASES) + " |", "|---|---|" + "---|" * len(PHASES)]
    for allocator, rows in rows_by_allocator.items():
        for r in rows:
            cells = [f"{(r['phases'].get(k, 0) - r['runtime']) / MiB:.0f} / "
                     f"{r['planned_phases'][k] / MiB:.0f}" for k in PHASES]
            lines.append(f"| {allocator} | {r['layers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv_=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 15, 30])
    ap.add_argument("--allocators", nargs="+", default=["returned", "glibc"], choices=("returned", "glibc"))
    ap.add_argument("--quick", action="store_true", help="layers 1 and 4, the returned allocator; no file")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_memory.md"))
    args = ap.parse_args(argv_)
    if args.quick:
        args.layers, args.allocators = [1, 4], ["returned"]
    load_start = os.getloadavg()[0]
    rows_by_allocator = {a: [dict(layers=n, **planned(n), **measured(n, a)) for n in args.layers]
                         for a in args.allocators}
    text = table(rows_by_allocator, load_start, os.getloadavg()[0])
    print(text)
    if args.quick or load_start > os.cpu_count():
        print(f"not written: {'--quick' if args.quick else f'load average {load_start:.1f} at the start'}")
        return rows_by_allocator
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return rows_by_allocator


if __name__ == "__main__":
    main()
