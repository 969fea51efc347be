"""Generation with and without the KV cache, measured: tokens per second at 128 to 1k tokens.

    python benchmarks/bench_generate.py [--size 10M] [--batch 1] [--lengths 128 256 512 1024] [--rounds 2]

One process (one torch thread, in a forked world: benchmarks/common.py), greedy, a prompt of 16
tokens, then new tokens up to each total length. Two variants of minipar/post/generation.py:

    cache      the prompt's K, V written once, then one position a step (models/kv_cache.py):
               each step's attention reads `length` cached positions, O(T) work a token
    recompute  use_cache=False: the whole sequence through the model every step, O(T^2) a token
               in attention and O(T) in every matmul

Per length: new tokens per second (best of --rounds), the speed-up, and the cache's bytes
(2 x layers x batch x kv_heads x T x head_dim x 4). The script refuses to write its results when the
load average at the start exceeds the core count (--quick, for the tests, writes only where --out says).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from common import SIZES, Measurement  # noqa: E402
from harness import run_world  # noqa: E402

from minipar.post.generation import Generation, generate  # noqa: E402
from models.kv_cache import KVCache  # noqa: E402
from models.llama import LlamaForCausalLM  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "generate")
PROMPT = 16


def _measure(size_name, batch, lengths, rounds):
    cfg = SIZES[size_name].llama()
    cfg.max_position_embeddings = max(max(lengths), cfg.max_position_embeddings)
    model = LlamaForCausalLM(cfg, seed=0).eval()
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(PROMPT)] for i in range(batch)]
    rows = []
    for total in lengths:
        row = dict(tokens=total, cache_mib=KVCache(model, batch, total).nbytes() / 2 ** 20)
        for name, use_cache in (("cache", True), ("recompute", False)):
            g = Generation(max_new_tokens=total - PROMPT, use_cache=use_cache)
            best = float("inf")
            for _ in range(rounds):
                t0 = time.perf_counter()
                out = generate(model, prompts, g)
                best = min(best, time.perf_counter() - t0)
            assert len(out.tokens[0]) == total - PROMPT
            row[f"{name}_tok_s"] = batch * (total - PROMPT) / best
        row["speedup"] = row["cache_tok_s"] / row["recompute_tok_s"]
        rows.append(row)
    return rows


def table(rows) -> str:
    lines = ["| tokens | cache tok/s | recompute tok/s | speed-up | cache MiB |", "|---|---|---|---|---|"]
    lines += [f"| {r['tokens']} | {r['cache_tok_s']:.0f} | {r['recompute_tok_s']:.0f} | "
              f"{r['speedup']:.1f}x | {r['cache_mib']:.2f} |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="10M", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="the 1M model, 32 and 48 tokens, 1 round (the tests)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        if args.out == DEFAULT_OUT:
            ap.error("refusing to write a --quick run into benchmarks/results/: pass --out")
        args.size, args.lengths, args.rounds = "1M", [32, 48], 1
    if min([args.batch, args.rounds] + args.lengths) < 1 or min(args.lengths) <= PROMPT:
        ap.error(f"--batch and --rounds must be >= 1 and every --lengths value > the prompt's {PROMPT}")
    run = Measurement("bench_generate.py", argv)
    rows = run_world(_measure, 1, args.size, args.batch, args.lengths, args.rounds, timeout=900)[0]
    run.done()
    md = "\n".join([
        "# Generation with and without the KV cache (benchmarks/bench_generate.py)", "",
        f"`{run.command}`: the {args.size} model ({SIZES[args.size].n_params / 1e6:.1f} M parameters), "
        f"batch {args.batch}, a {PROMPT}-token prompt, greedy, fp32, one process with 1 torch thread; best "
        f"of {args.rounds} round(s); {run.machine()}", "", table(rows), ""])
    return run.save(args.out, md, args.quick, rows=rows)


if __name__ == "__main__":
    sys.exit(main())
