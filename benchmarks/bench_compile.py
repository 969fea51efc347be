"""torch.compile measured: step time compiled / eager, and minipar compiled against torch's own.

    python benchmarks/bench_compile.py [--sizes 10M 50M] [--ranks 1 2 4] [--backend inductor]
                                       [--steps 5] [--rounds 2] [--quick --out DIR/name]

Per model size and rank count, each variant in a fresh world of forked gloo ranks
(benchmarks/common.py), the variants of a group interleaved A B C A B C over --rounds rounds so
that other jobs' load hits them alike:

    1 rank          minipar eager, minipar compiled (compile: true: each decoder layer's forward,
                    minipar/regional_compile.py)
    n ranks, dp     minipar ZeRO-3 eager / compiled (dp_shard n), torch FSDP2 compiled:
                    torch.compile of each decoder layer, then fully_shard(layer) and fully_shard(model)
                    (torchtitan's order), on the same model (benchmarks/cases_dp.py runs it eagerly)
    n ranks, tp     minipar TP eager / compiled (tp n), DTensor TP compiled: the plain model under
                    parallelize_module's plan (benchmarks/cases_tp.py), each layer then compiled
                    (torchtitan's order), the embedding's output made a plain tensor before the first
                    compiled layer (cases_tp.settle_embedding_output: torch 2.13 loses the gradient of
                    an AsyncCollectiveTensor input to a compiled region, and the backward fails)

A step is forward + backward + AdamW on the same batches, fp32. The first two steps are warm-up
(the first compiles every graph); the step time is the median of --steps after them, so compile
time is EXCLUDED from it and reported on its own: dynamo's compile seconds (tracing, AOT autograd,
the backend) and the first step's wall time. The results file records the load average at the
start and end; common.save_results refuses to write it when the machine was loaded (--quick writes
only where --out says: the 1M model, 1 and 2 ranks, aot_eager, one step, one round; the tests).
A variant that torch cannot run here gets a row that says why.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from common import SIZES, Measurement, run_variant, timed_world  # noqa: E402

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "compile")
GROUPS = {"one": ["minipar eager", "minipar compiled"],
          "dp": ["minipar ZeRO-3 eager", "minipar ZeRO-3 compiled", "torch FSDP2 compiled"],
          "tp": ["minipar TP eager", "minipar TP compiled", "DTensor TP compiled"]}


def _batch(cfg, size, dp: int):
    g = torch.Generator().manual_seed(1000)
    ids = torch.randint(0, cfg.vocab_size, (size.rows * dp, size.seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _compile_each_layer(layers, backend):
    for layer in layers:       # torch's regional compile of a plain module (hooks inside: FSDP2's own)
        layer.compile(backend=backend)


def world(variant, size, steps, backend):
    """One variant on this rank; the world's size is the variant's rank count."""
    import torch.distributed as dist

    import minipar
    from minipar import ParallelismConfig
    from minipar.api import prepare
    n = dist.get_world_size()
    compiled = "compiled" in variant
    first = {}

    def build():
        cfg = size.llama()
        dp = n if (" TP " not in variant and "DTensor" not in variant) else 1
        ids, labels = _batch(cfg, size, dp)      # dp: each rank its `rows`; tp: one batch for all
        if variant.startswith("minipar"):
            sizes = {} if n == 1 else (dict(tp_size=n) if " TP " in variant else dict(dp_shard_size=n))
            _, _, step = prepare(cfg, ParallelismConfig(**sizes), learning_rate=1e-4, compile=compiled,
                                 compile_backend=backend)
            return lambda: step(ids, labels)
        from torch.distributed.device_mesh import init_device_mesh
        if variant == "torch FSDP2 compiled":
            from cases_dp import _fsdp2

            from models.llama import LlamaForCausalLM
            model = LlamaForCausalLM(cfg, None, seed=0)
            _compile_each_layer(model.model.layers, backend)
            mesh = init_device_mesh("cpu", (n,))
            for layer in model.model.layers:
                _fsdp2()[0](layer, mesh=mesh)
            _fsdp2()[0](model, mesh=mesh)
            rank = dist.get_rank()
            mine = slice(rank * size.rows, (rank + 1) * size.rows)

            def loss():
                logits = model(ids[mine])
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[mine].flatten()).backward()
        else:                                     # DTensor TP compiled
            from cases_tp import dtensor_model, settle_embedding_output
            from torch.distributed.tensor.parallel import loss_parallel
            minipar.init(ParallelismConfig())     # the plain model's one-process groups
            model = dtensor_model(cfg, init_device_mesh("cpu", (n,), mesh_dim_names=("tp",)), sp=False)
            settle_embedding_output(model)        # the first layer's input: not an async collective's
            _compile_each_layer(model.model.layers, backend)

            def loss():
                logits = model(ids)               # (b, s, V) DTensor, sharded on the vocabulary
                with loss_parallel():
                    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            loss()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    def timed_build():
        step = build()

        def first_step_timed():
            if "t" not in first:
                t = time.perf_counter()
                step()
                first["t"] = time.perf_counter() - t
            else:
                step()
        return first_step_timed, extras

    def extras():
        out = dict(first_step_s=first.get("t"))
        if compiled:
            from torch._dynamo.utils import counters

            from minipar.regional_compile import CompileStats
            out.update(compile_s=CompileStats.seconds(), graphs=int(counters["stats"]["unique_graphs"]),
                       graph_breaks=int(sum(counters["graph_break"].values())))
        return out

    return timed_world(timed_build, steps, warmup=2)


def measure(args):
    """{(size, ranks, variant): [result per round]}."""
    rows = {}
    for size_name in args.sizes:
        size = SIZES[size_name]
        for n in args.ranks:
            groups = ["one"] if n == 1 else args.layouts
            for _ in range(args.rounds):
                for group in groups:
                    for variant in GROUPS[group]:
                        try:
                            r = run_variant(world, n, variant, size, args.steps, args.backend, timeout=1800)
                        except Exception as err:     # a variant torch cannot run here: its row says why
                            last = [line for line in str(err).strip().splitlines() if line.strip()][-1:]
                            r = dict(error=(last[0] if last else type(err).__name__)[:200])
                            print(f"{size_name} {n} rank(s) {variant}: FAILED {r['error']}", flush=True)
                        else:
                            print(f"{size_name} {n} rank(s) {variant}: {r['step_s'] * 1e3:.1f} ms/step, "
                                  f"first step {r['first_step_s']:.1f} s", flush=True)
                        rows.setdefault((size_name, n, variant), []).append(r)
    return rows


def table(rows) -> str:
    lines = ["| size | ranks | variant | step ms (median of rounds) | / eager | compile s | first step s | "
             "graphs | graph breaks |", "|---|---|---|---|---|---|---|---|---|"]
    for (size, n, variant), rs in rows.items():
        if any("error" in r for r in rs):
            lines.append(f"| {size} | {n} | {variant} | failed: {rs[0].get('error', '')} | | | | | |")
            continue
        ms = statistics.median(r["step_s"] for r in rs) * 1e3
        eager_key = (size, n, variant.rsplit(" ", 1)[0] + " eager") if variant.startswith("minipar") else \
            (size, n, "minipar ZeRO-3 eager" if "FSDP2" in variant else "minipar TP eager")
        eager = rows.get(eager_key)
        eager = None if eager is None or any("error" in r for r in eager) else eager
        ratio = f"{ms / (statistics.median(r['step_s'] for r in eager) * 1e3):.2f}" if eager else ""
        c = rs[0]
        comp = f"{c['compile_s']:.1f}" if c.get("compile_s") is not None else ""
        lines.append(f"| {size} | {n} | {variant} | {ms:.1f} | {ratio} | {comp} | {c['first_step_s']:.1f} | "
                     f"{c.get('graphs', '')} | {c.get('graph_breaks', '')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=["10M", "50M"], choices=sorted(SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--layouts", nargs="+", default=["dp", "tp"], choices=["dp", "tp"])
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="the 1M model, 1 and 2 ranks, aot_eager, 1 step, 1 round (the tests)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.quick:
        if args.out == DEFAULT_OUT:
            ap.error("refusing to write a --quick run into benchmarks/results/: pass --out")
        args.sizes, args.ranks, args.backend, args.steps, args.rounds = ["1M"], [1, 2], "aot_eager", 1, 1
    if min(args.steps, args.rounds, *args.ranks) < 1:
        ap.error("--steps, --rounds and --ranks must be >= 1")
    run = Measurement("bench_compile.py", argv)
    rows = measure(args)
    run.done()
    head = ["# torch.compile: compiled / eager, and against FSDP2 and DTensor compiled "
            "(benchmarks/bench_compile.py)", "",
            f"`{run.command}`: backend {args.backend}, fp32, {args.steps} timed step(s) after 2 "
            f"warm-up steps (the first compiles: compile time excluded from the step time, reported beside "
            f"it), {args.rounds} interleaved round(s); CPU, gloo, 1 torch thread per forked rank, "
            f"{run.machine()} '/ eager': against minipar eager on the same layout.", ""]
    md = "\n".join(head + [table(rows), ""])
    return run.save(args.out, md, args.quick, backend=args.backend,
                    rows=[dict(size=s, ranks=n, variant=v, rounds=rs) for (s, n, v), rs in rows.items()])


if __name__ == "__main__":
    sys.exit(main())
