"""The planner beside published bf16 training runs: how far its tokens/s per GPU and memory are.

    python benchmarks/plan_vs_published.py     writes benchmarks/results/plan_vs_published.md

Each row is a run someone published with its model, GPUs, layout, batch, sequence and activation
checkpointing; the planner (minipar/plan, default constants: estimate.py's Cluster) is given that
layout and the hardware the source names, and its tokens/s per GPU and memory per GPU are set beside
the published ones. A row passes when the prediction is within 25 % (tokens/s) and 20 % (memory, where
published) of the published figure; a row the planner cannot express says why. Nothing is tuned per
row: the same constants price every run. What differs per row is what its source STATES about the
hardware (torchtitan's 500 W HBM2e H100s) and about how its trainer runs the step, each an Options
flag the time model prices (minipar/plan/time_model.py, overlap.py): fused kernels (torch.compile,
Megatron's Transformer Engine), torchtitan's per-op selective AC, Megatron's distributed optimizer
and --tp-comm-overlap, FSDP gathering once per step under pp and the Llama 3 paper's all-gather CP.
Where a source is silent (AC, micro-batch, schedule), the row says what was assumed.

A row that misses, and whose source leaves one constant of the time model unknown (the sustained GEMM
rate of torchtitan's 500 W GPUs; the Llama 3 paper's attention kernel), says which value of that
constant its published tokens/s would take (`implied`, by bisection); `one_value` then re-plans every
row on the same hardware at the mean of those values, to show whether one value explains them all.
Both are checks printed beside the table: the planner's constants stay what they are for every row.

The rows themselves, with their sources, are benchmarks/published_runs.py.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from published_runs import GRAND_TETON, NOT_COMPARABLE, Run, runs  # noqa: E402

from minipar.plan import activation_bytes as pa  # noqa: E402
from minipar.plan.estimate import Cluster, plan  # noqa: E402
from minipar.plan.inputs import DTYPE_BYTES  # noqa: E402
from minipar.plan.pipeline import plan_pipeline  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "plan_vs_published.md")
TOKENS_WITHIN, MEMORY_WITHIN = 0.25, 0.20
GiB = 2 ** 30


# repr(run) -> its plan: planned once (implied() and one_value() re-plan the rows and the bisection
# steps that row() already planned; the plans are only read)
_PLANNED = {}


def predict(run: Run) -> dict:
    key = repr(run)
    if key not in _PLANNED:
        cluster = dataclasses.replace(Cluster(), **run.cluster)
        _PLANNED[key] = plan(run.model, run.layout, run.batch, run.opts, cluster) if run.pipe is None else \
            plan_pipeline(run.model, run.layout, run.pipe, run.batch, run.opts, cluster)
    return _PLANNED[key]


WHAT = {"efficiency": "GEMMs at {x:.2f} of peak (the planner: {now})",
        "attention_efficiency": "attention at {x:.2f} of peak (the planner: {now})"}


def _at(run: Run, field: str, x: float) -> Run:
    """The run planned with one Cluster constant set to x."""
    return dataclasses.replace(run, cluster=dict(run.cluster, **{field: x}))


def implied(run: Run) -> Optional[float]:
    """The value of the one constant the row's source leaves unknown (run.unstated: the sustained GEMM
    rate of a power-capped GPU, an unnamed attention kernel) at which the planner's tokens/s per GPU
    equals the published figure, found by bisection (tokens/s rises with it); None when even 1.0 is
    too slow. It is what the row's miss would take, not a fit: the planner keeps its constant."""
    lo, hi = 0.01, 1.0
    if ratio(_at(run, run.unstated, hi)) < 1:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(_at(run, run.unstated, mid)) < 1 else (lo, mid)
    return hi


def implied_text(run: Run) -> str:
    x = implied(run)
    if x is None:
        return f"no {run.unstated} up to 1.0 reaches the published tokens/s"
    now = getattr(dataclasses.replace(Cluster(), **run.cluster), run.unstated)
    return "the published tokens/s would take " + WHAT[run.unstated].format(x=x, now=now)


def one_value(rows) -> list:
    """The rows that leave the same constant unknown, re-planned at the mean of the values their
    misses imply: whether one value explains them all (a check, not the planner's setting)."""
    out = []
    for field in sorted({r.unstated for r in rows if r.unstated}):
        group = [r for r in rows if r.unstated == field and r.cluster == next(
            q.cluster for q in rows if q.unstated == field)]
        missed = [r for r in group if abs(ratio(r) - 1) > TOKENS_WITHIN]
        values = [v for v in (implied(r) for r in missed) if v is not None]
        if len(group) < 2 or not values:
            continue
        x = sum(values) / len(values)
        at = [ratio(_at(r, field, x)) for r in group]
        which = ("what the one row out of bounds among them implies" if len(values) == 1 else
                 f"the mean of the {min(values):.2f}-{max(values):.2f} that the {len(values)} rows out of "
                 f"bounds among them imply")
        out.append(f"The {len(group)} rows on the same hardware that leave `{field}` unknown, planned at "
                   f"{x:.2f} ({which}; a check, not the planner's setting): {min(at):.2f}x-{max(at):.2f}x "
                   f"the published tokens/s.")
    return out


def ratio(run: Run) -> float:
    p = predict(run)
    return p["time"]["tokens_per_s"] / p["world"] / run.tokens_per_gpu


def memory_counted(run: Run, p: dict) -> str:
    """What a row's planned memory is made of, from the plan itself: the worst stage's activations in
    flight, a decoder layer's share by part (activation_bytes.py's count of minipar's eager code), and
    the s x s attention scores that count leaves out (SDPA's flash kernel keeps none)."""
    m, act = p["memory"], pa.activations(run.model, run.layout, run.batch, run.opts)
    kept = m["activations"]["as_configured"]
    stage = p["stages"][p["worst_stage"]]
    layers = sum(len(c) for c in stage["layers"])
    parts = {k: v / GiB for k, v in act["per_layer_parts"].items()}
    lay, b = run.layout, run.batch.micro(run.layout)
    scores = b * run.model.num_attention_heads // lay.tp * run.batch.sequence_len // lay.cp \
        * run.batch.sequence_len * DTYPE_BYTES[run.opts.dtype] / GiB
    kv = ("q, the K/V heads, the output and its copy (CP)" if lay.cp > 1 else
          "q, k and v repeated to the query heads, the output")
    return (f"memory counts minipar's eager activations, the run's is not published (it had 80 GB): stage "
            f"{stage['rank']} keeps {kept / GiB:.0f} GiB in flight at its peak ({m['peak_phase']}), "
            f"{kept / m['activations']['per_micro']:.1f} micro-batches of its {layers} layers at "
            f"{act['per_layer'] / GiB:.2f} GiB a layer: the two RMSNorms {parts['norms']:.2f} (mostly the "
            f"all-gathered input of the column-parallel matmuls, which minipar's SP keeps whole; each also "
            f"an fp32 copy of its input and its normalised x), SwiGLU {parts['mlp']:.2f} (gate, silu(gate), "
            f"up, their product), attention {parts['attention']:.2f} ({kv}, the fp32 log-sum-exp: flash "
            f"SDPA keeps no s x s scores, which would be {scores:.1f} GiB a layer more); the rest, "
            f"{(m['total'] - kept) / GiB:.0f} GiB, is the "
            f"state, the stage's gathered layers and no_sync's fp32 accumulators. Megatron-LM-style SP "
            f"keeps the sharded input and all-gathers it again in backward (Korthikanti et al. 2022) and "
            f"fused norm and SwiGLU kernels keep less; the planner does not model that, nor the paper's "
            f"pipeline memory changes")


def row(run: Run) -> tuple:
    p = predict(run)
    tps = p["time"]["tokens_per_s"] / p["world"]
    ratio = tps / run.tokens_per_gpu
    mem = p["memory"]["total"] / GiB
    mem_cell = f"{mem:.1f} / {run.memory_gib} ({mem / run.memory_gib:.3f}x)" if run.memory_gib else \
        f"{mem:.1f} / not published"
    ok = abs(ratio - 1) <= TOKENS_WITHIN and \
        (not run.memory_gib or abs(mem / run.memory_gib - 1) <= MEMORY_WITHIN)
    missed = abs(ratio - 1) > TOKENS_WITHIN and run.unstated
    return ok, (f"| {run.what} | {p['world']} | {tps:,.0f} / {run.tokens_per_gpu:,.0f} ({ratio:.2f}x) | "
                f"{mem_cell} | {100 * p['time']['mfu_full_attention']:.1f} % | {'yes' if ok else 'no'} | "
                f"{run.source}{'; ' + run.derived if run.derived else ''} | {run.note}"
                f"{'; ' + implied_text(run) if missed else ''}"
                f"{'; ' + memory_counted(run, p) if run.explain_memory else ''} |")


def compile_saving(rows) -> list:
    """torchtitan's eager and torch.compile rows of one table: the step each spends, planned and
    published, so that the fused-kernel model's saving is read beside the published one."""
    out = []
    for eager in (r for r in rows if r.what.endswith("eager, selective AC")):
        comp = next(r for r in rows if r.what == eager.what.replace("eager", "torch.compile"))
        tokens = eager.batch.global_batch_size * eager.batch.sequence_len / eager.layout.world
        plan_s = [predict(r)["time"]["step_s"] for r in (eager, comp)]
        pub_s = [tokens / r.tokens_per_gpu for r in (eager, comp)]
        out.append(f"{eager.what.split(',')[0]} ({eager.layout.world} GPUs), eager -> torch.compile, "
                   f"seconds a step: planned {plan_s[0]:.2f} -> {plan_s[1]:.2f} "
                   f"(saves {plan_s[0] - plan_s[1]:.2f}), "
                   f"published {pub_s[0]:.2f} -> {pub_s[1]:.2f} (saves {pub_s[0] - pub_s[1]:.2f}).")
    return out


def main(out: str = OUT):
    c = Cluster()
    lines = ["# The planner beside published runs", "",
             "Generated by `python benchmarks/plan_vs_published.py` (the planner's default constants: "
             f"{c.peak_tflops:.0f} TFLOP/s, GEMMs at {c.efficiency}, attention at {c.attention_efficiency}, "
             f"HBM {c.hbm_gbps:.0f} GB/s, NVLink {c.intra_gbps:.0f} GB/s, "
             f"IB {c.inter_gbps:.0f} GB/s per GPU, "
             f"latency {c.intra_latency_us}/{c.inter_latency_us} us per hop; torchtitan's 96 GB HBM2e "
             f"500 W H100s with 2,400 GB/s and {GRAND_TETON['peak_tflops']:.0f} TFLOP/s, the midpoint of "
             "the range its source gives). How each run executes its step is the row's own (last column: "
             "the Options flags set from what the source states). Each cell is predicted / published; "
             "a row passes within "
             f"{100 * TOKENS_WITHIN:.0f} % on tokens/s per GPU and {100 * MEMORY_WITHIN:.0f} % on memory. "
             "MFU counts attention whole (torchtitan's and Megatron-LM's convention).", "",
             "| run | GPUs | tokens/s per GPU | memory GiB per GPU | planner MFU | within | source | "
             "how it is planned; what is not modelled |", "|---|---|---|---|---|---|---|---|"]
    passed = 0
    rows = runs()
    for run in rows:
        ok, text = row(run)
        passed += ok
        lines.append(text)
    for source, what, why in NOT_COMPARABLE:
        lines.append(f"| {what} | | cannot be compared | | | n/a | {source} | {why} |")
    lines += ["", f"{passed} of {len(rows)} comparable rows within the bounds.", ""] + compile_saving(rows) \
        + [""] + one_value(rows)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
