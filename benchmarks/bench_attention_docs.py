r"""Attention over packed documents: peak memory and time against the sequence length, the dense mask
against the host's document boundaries (minipar/context_parallel/documents.py).

    .venv/bin/python benchmarks/bench_attention_docs.py            T = 1k, 2k, 4k, 8k; writes the table
    .venv/bin/python benchmarks/bench_attention_docs.py --quick    T = 1k, 2k, one step; prints only

One causal attention forward and backward of (1, 4 query heads, T, 64) over 2 KV heads, fp32, on
one CPU thread, the row packed with 512-token documents (the last one shorter), three ways:

    sdpa mask    what cp 1 ran before: SDPA with the boolean (b, 1, T, T) mask (torch's CPU math)
    ring dense   what a ring block cut by documents ran before (any cp; here the one block of cp 1):
                 the reference math on fp32 (b, H, T, T) scores, masked
    documents    now: the block classified on the host, one CPU flash call per document

Each cell is a fresh forked process (benchmarks/common.py timed_world): peak = the growth of its
resident set (VmHWM) over the state with the inputs made, time = the median of the timed steps.
With d-token documents the documents' work is T * d per head, so both must grow linearly with T;
the dense ways grow with T^2. The table is written only when the load average at the start is
below the number of cores (save_results).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402
from common import MB, run_variant, save_results, timed_world  # noqa: E402

VARIANTS = ("sdpa mask", "ring dense", "documents")
HQ, HKV, D, DOC = 4, 2, 64, 512


def packed_ids(t: int, doc: int = DOC) -> torch.Tensor:
    """(1, t) ids of documents of `doc` tokens, one after the other."""
    return (torch.arange(t) // doc)[None]


def _cell(variant: str, t: int, steps: int):
    from minipar.context_parallel import BlockKernel, Documents, ring_attention
    from minipar.mesh import MeshDim
    from models.llama_layer import causal_attention

    def build():
        g = torch.Generator().manual_seed(0)
        q, k, v, dout = (torch.randn(1, h, t, D, generator=g) for h in (HQ, HKV, HKV, HQ))
        ids = packed_ids(t)
        alone = MeshDim("cp_alone", [0], 0, None)

        def step():
            x = [y.clone().requires_grad_() for y in (q, k, v)]
            if variant == "sdpa mask":
                out = causal_attention(*x, ids)
            elif variant == "ring dense":
                out = ring_attention(*x, alone, BlockKernel(documents=ids))
            else:
                out = ring_attention(*x, alone, BlockKernel(documents=Documents(ids)))
            out.backward(dout)
        return step, None
    return timed_world(build, steps, warmup=1)


def table(rows, quick: bool, load: float) -> str:
    lines = [f"# Packed documents: attention's peak memory and time against T ({DOC}-token documents)", "",
             f"One causal forward + backward, (1, {HQ} heads, T, {D}) over {HKV} KV heads, fp32, one CPU "
             f"thread; peak = resident-set growth of a fresh process; {os.cpu_count()} cores, load average "
             f"{load:.1f} at the start{' (--quick)' if quick else ''}. "
             f"benchmarks/bench_attention_docs.py.", "",
             "| T | way | peak MiB | peak / previous T | ms | ms / previous T |",
             "|---:|---|---:|---:|---:|---:|"]
    prev = {}
    for t, variant, r in rows:
        mib, ms = r["peak_rss"] / MB, 1e3 * r["step_s"]
        before = prev.get(variant)
        grow = (f"{mib / before[0]:.2f}x" if before and before[0] > 0 else "-",
                f"{ms / before[1]:.2f}x" if before else "-")
        lines.append(f"| {t} | {variant} | {mib:.1f} | {grow[0]} | {ms:.1f} | {grow[1]} |")
        prev[variant] = (mib, ms)
    lines += ["", "Doubling T doubles a linear cost and quadruples a quadratic one."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 1k and 2k, one timed step; prints only")
    ap.add_argument("--lengths", type=int, nargs="*", default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "attention_docs"))
    args = ap.parse_args(argv)
    lengths = args.lengths or ([1024, 2048] if args.quick else [1024, 2048, 4096, 8192])
    steps = args.steps or (1 if args.quick else 3)
    load = os.getloadavg()[0]
    rows = []
    for t in lengths:
        for variant in VARIANTS:
            r = run_variant(_cell, 1, variant, t, steps, timeout=600)
            rows.append((t, variant, r))
            print(f"T {t} {variant}: peak {r['peak_rss'] / MB:.1f} MiB, {1e3 * r['step_s']:.1f} ms",
                  flush=True)
    md = table(rows, args.quick, load)
    print(md)
    if args.quick:
        print("not written: --quick")
        return 0
    record = dict(lengths=lengths, doc=DOC, heads=HQ, kv_heads=HKV, head_dim=D, load=load,
                  rows=[dict(T=t, way=v, peak_bytes=r["peak_rss"], step_s=r["step_s"]) for t, v, r in rows])
    return save_results(args.out, md, record, load, os.cpu_count(), quick=False)


if __name__ == "__main__":
    sys.exit(main())
