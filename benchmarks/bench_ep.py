"""Expert parallelism measured: one MoE feed-forward (models/moe.py), forward and backward, on n
ranks with its experts split over ep = n, against the rung below it and against one process.

    python benchmarks/bench_ep.py [--ranks 2 4] [--experts 8] [--hidden 256] [--width 512]
                                  [--tokens 1024] [--top-k 2] [--steps 5] [--rounds 2]

Three variants of the same layer (E experts of width F, hidden d, top-k; every rank routes its own
T tokens, as dp ranks do):

    one process      world 1, the n T tokens of all ranks through all E experts
    all experts      world n, ep 1: every rank holds all E experts and runs them on its own T
                     tokens (no exchange; the rung below EP: "loop over all experts on every rank")
    ep n             world n, ep n: every rank holds E/n experts; dispatch sends each routed copy to
                     the rank holding its expert and combine brings it back (expert_parallel/dispatch.py)

Per variant: step ms (the slowest rank, median of --steps, best of --rounds interleaved rounds), the
busiest rank's CPU ms, the bytes a rank puts on the wire per step by the comm ledger (dispatch and
combine, forward and backward, and the counts) beside the balanced-routing theory
4 T k d b (n-1)/n + (n-1)/n E 8, the expert weights a rank holds, and its peak resident memory
above its baseline (VmHWM; weights, gradients, activations of one step; benchmarks/common.py).
The router is drawn at random, so routing is near-balanced; the ledger bytes are the exact ones.
The layer alone: the gradient reduction of the experts (over edp under ZeRO-3, over the replicas
without) is the same for the last two variants per expert held and is not timed here
(minipar/expert_parallel/sharding.py gives its bytes).

On a machine with fewer cores than ranks, ranks share cores and wall times mostly show the queue;
the bytes and the memory are exact whatever the load. The script refuses to write its results when
the load average at the start exceeds the core count (--quick, for the tests, always writes).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from common import MB, run_variant, save_results, timed_world  # noqa: E402

import minipar  # noqa: E402
from minipar import ParallelismConfig, comm_ledger  # noqa: E402
from models.llama_config import LlamaConfig  # noqa: E402
from models.moe import MoEFeedForward  # noqa: E402


def _layer_rank(args, ranks: int, ep: int, tokens: int):
    """One rank of one variant: build the layer (seeded, the same full weights everywhere), then the
    timed steps; the ledger of the last step says what this rank sent."""
    state = {}

    def build():
        pgm = minipar.init(ParallelismConfig(dp_shard_size=ranks, ep_size=ep))
        config = LlamaConfig(model_type="mixtral", hidden_size=args.hidden, intermediate_size=args.width,
                             num_attention_heads=4, num_key_value_heads=4, num_local_experts=args.experts,
                             num_experts_per_tok=args.top_k, vocab_size=256)
        layer = MoEFeedForward(config, pgm.ep)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():                      # full tensors from one seed, this rank's experts kept
            for p in layer.parameters():
                full = torch.randn(p.tp_full_shape, generator=g) * 0.05
                p.copy_(full.chunk(ep, 0)[pgm.ep.rank] if getattr(p, "ep_split_dim", None) is not None
                        else full)
        x = torch.randn(1, tokens, args.hidden, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
        x.requires_grad_(True)

        def step():
            with comm_ledger.ledger() as led:
                layer(x).sum().backward()
            state["sent"] = led.wire_bytes()
            state["calls"] = led.count()
            for p in layer.parameters():
                p.grad = None
            x.grad = None

        expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
        return step, lambda: dict(sent=state["sent"], calls=state["calls"], expert_bytes=expert_bytes,
                                  tokens=tokens)
    return timed_world(build, args.steps)


def variants(args, n: int):
    """(name, ranks, ep) of the three variants at n ranks; one process sees every rank's tokens."""
    return [("one process", 1, 1), ("all experts", n, 1), (f"ep {n}", n, n)]


def theory_bytes(args, n: int, ep: int) -> float:
    """Balanced routing: 4 exchanges of T k rows of d fp32 numbers, (n-1)/n of them leave the rank;
    plus the (E,) int64 counts, forward only."""
    if ep == 1:
        return 0.0
    return 4 * args.tokens * args.top_k * args.hidden * 4 * (ep - 1) / ep + (ep - 1) / ep * args.experts * 8


def measure(args):
    rows = {}
    for _ in range(args.rounds):                   # interleaved: load bursts hit every variant alike
        for n in args.ranks:
            for name, ranks, ep in variants(args, n):
                tokens = args.tokens * n if ranks == 1 else args.tokens    # one process: every rank's
                r = run_variant(_layer_rank, ranks, args, ranks, ep, tokens, timeout=1800)
                key = (n, name)
                if key not in rows or r["step_s"] < rows[key]["step_s"]:
                    rows[key] = dict(r, ranks=ranks, ep=ep, theory=theory_bytes(args, n, ep))
    return rows


def table(args, rows) -> str:
    out = ["| n | variant | ranks | step ms | CPU ms | MiB sent/rank/step | theory MiB | calls/step "
           "| expert MiB/rank | peak MiB/rank |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (n, name), r in rows.items():
        out.append(f"| {n} | {name} | {r['ranks']} | {1e3 * r['step_s']:.1f} | {1e3 * r['cpu_s']:.1f} | "
                   f"{r['sent'] / MB:.3f} | {r['theory'] / MB:.3f} | {r['calls']} | "
                   f"{r['expert_bytes'] / MB:.2f} | {r['peak_rss'] / MB:.1f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank per step")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a tiny layer, 2 ranks, 1 round (the tests)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_ep"))
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.experts, args.hidden, args.width, args.tokens = [2], 4, 32, 64, 64
        args.steps, args.rounds = 1, 1
    bad = [n for n in args.ranks if n < 2 or args.experts % n]
    if bad or args.top_k > args.experts or min(args.steps, args.rounds, args.tokens) < 1:
        ap.error(f"--ranks {bad} must be >= 2 and divide --experts {args.experts}; --top-k "
                 f"{args.top_k} <= --experts; --steps, --rounds, --tokens >= 1")
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    rows = measure(args)
    load_end = os.getloadavg()[0]
    command = "python benchmarks/bench_ep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    head = ["# Expert parallelism (benchmarks/bench_ep.py)", "",
            f"`{command.strip()}`: one MoE feed-forward, E={args.experts} experts of width {args.width}, "
            f"d={args.hidden}, top-{args.top_k}, {args.tokens} tokens per rank, fp32, forward + backward; "
            f"median of {args.steps} step(s), best of {args.rounds} round(s); CPU, gloo, 1 torch thread "
            f"per forked rank, torch {torch.__version__}, {cores} cores ({platform.machine()}), load "
            f"average {load:.1f} at the start and {load_end:.1f} at the end. Bytes are exact (comm "
            f"ledger); peak MiB is resident memory above the rank's baseline.", ""]
    md = "\n".join(head + [table(args, rows), ""])
    print("\n" + md)
    record = dict(command=command.strip(), load_start=load, load_end=load_end, cores=cores,
                  torch=torch.__version__,
                  rows=[dict(n=n, variant=name, **r) for (n, name), r in rows.items()])
    return save_results(args.out, md, record, load, cores, args.quick)


if __name__ == "__main__":
    sys.exit(main())
