"""Ring attention at cp = 2 against one process attending the whole sequence; overlap on and off;
the bytes each rank sends per step, from the communication ledger, against theory.

    python benchmarks/bench_cp.py [--seq 2048] [--heads 8] [--kv-heads 4] [--head-dim 64] [--iters 5]

What is timed: one attention forward + backward (the part context parallelism changes) of
q (B, Hq, T, D), k/v (B, Hkv, T, D) in fp32, causal. One process attends all T tokens with torch's
fused kernel; each cp rank attends its T/cp zigzag share with ring attention, K/V (and in the
backward dK/dV) hopping round the ring. A step's time is the slowest rank's, the best of --iters
(the machine is shared: the minimum is the least disturbed); CPU ms per rank is the process time
of each rank (compute plus gloo's threads), which shows the balance even on a loaded machine.
Ranks are forked gloo processes with one torch thread each (tests/harness.py), so on a 2-core
machine cp = 2 gives each rank a core of its own; cp = 4 is only run for its bytes.

Theory per rank per step (L = T/cp, e = bytes per element):
    forward   (cp-1) x K and V                 (cp-1) * 2 * B * Hkv * L * D * e
    backward  (cp-1) x K and V + fp32 dK, dV   (cp-1) * 2 * B * Hkv * L * D * (e + 4)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import minipar  # noqa: E402
from minipar import ParallelismConfig, comm  # noqa: E402
from minipar.context_parallel import ring_attention, schedule_score_elements, zigzag_shard  # noqa: E402
from harness import run_world  # noqa: E402


def _inputs(args, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(args.batch, h, args.seq, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    q, k, v = (torch.randn(s, generator=g) for s in shapes)
    return q, k, v, torch.randn(shapes[0], generator=g)


def _single(args):
    torch.set_num_threads(1)
    q, k, v, dout = _inputs(args)
    g = args.heads // args.kv_heads
    times, cpus = [], []
    for it in range(args.iters + 1):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        t0, c0 = time.perf_counter(), time.process_time()
        # the repeat is what a single process without GQA support in its kernel pays
        out = F.scaled_dot_product_attention(x[0], x[1].repeat_interleave(g, 1), x[2].repeat_interleave(g, 1),
                                             is_causal=True)
        out.backward(dout)
        if it:
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return dict(time=min(times), cpu=[min(cpus)])


def _ring(args, cp_size, overlap, layout):
    pgm = minipar.init(ParallelismConfig(cp_size=cp_size))
    cp = pgm.cp
    q, k, v, dout = _inputs(args)
    if layout == "zigzag":
        q, k, v, dout = (zigzag_shard(t, 2, cp) for t in (q, k, v, dout))
    else:
        q, k, v, dout = (t.chunk(cp_size, 2)[cp.rank].contiguous() for t in (q, k, v, dout))
    flag = torch.zeros(1)
    times, cpus, fwd_bytes, bwd_bytes = [], [], 0, 0
    for it in range(args.iters + 1):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        comm.all_reduce(flag, cp)                       # a barrier: every rank starts the step together
        t0, c0 = time.perf_counter(), time.process_time()
        with comm.ledger() as fwd:
            out = ring_attention(*x, cp, causal=True, overlap=overlap, layout=layout)
        with comm.ledger() as bwd:
            out.backward(dout)
        elapsed = torch.tensor([time.perf_counter() - t0])
        cpu = torch.tensor([time.process_time() - c0])
        comm.all_reduce(elapsed, cp, op="max")          # the step lasts as long as its slowest rank
        if it:
            times.append(elapsed.item())
            cpus.append(comm.all_gather(cpu, cp))
        fwd_bytes, bwd_bytes = fwd.total_bytes("send_recv", "cp"), bwd.total_bytes("send_recv", "cp")
    return dict(time=min(times), cpu=torch.stack(cpus).min(0).values.tolist(), fwd=fwd_bytes, bwd=bwd_bytes)


def _theory(args, cp_size):
    block = 2 * args.batch * args.kv_heads * (args.seq // cp_size) * args.head_dim
    return (cp_size - 1) * block * 4, (cp_size - 1) * block * (4 + 4)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_cp.md"))
    args = p.parse_args(argv)

    base = run_world(_single, 1, args, timeout=600)[0]
    rows = [("one process, full sequence (sdpa)", 1, "-", "-", base, None)]
    base_t = base["time"]
    for cp_size, layout, overlap in [(2, "zigzag", True), (2, "zigzag", False), (2, "contiguous", True),
                                     (4, "zigzag", True)]:
        res = run_world(_ring, cp_size, args, cp_size, overlap, layout, timeout=600)[0]
        rows.append((f"ring attention, cp={cp_size}", cp_size, layout, "on" if overlap else "off", res, res))

    mib = 1 / 2 ** 20
    lines = [f"# Ring attention benchmark (bench_cp.py)", "",
             f"Attention forward + backward, fp32, causal: B={args.batch}, Hq={args.heads}, "
             f"Hkv={args.kv_heads}, "
             f"T={args.seq}, D={args.head_dim}; CPU ({torch.get_num_threads()} thread(s) per rank in the "
             f"parent, 1 per forked rank), torch {torch.__version__}, gloo. Best of {args.iters} steps; a "
             f"step is its slowest rank. cp=4 runs 4 ranks on {os.cpu_count()} cores: its time is "
             f"not a speed-up measurement, its bytes are exact. Load average when run: "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall times of a shared machine are noisy; "
             f"the CPU columns are not).", "",
             "| run | cp | layout | overlap | step ms | vs one process | CPU ms per rank | vs one process, "
             "slowest rank's CPU | fwd MiB sent/rank (theory) | bwd MiB sent/rank (theory) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, cp_size, layout, overlap, meas, res in rows:
        t, cpu = meas["time"], "/".join(f"{c * 1e3:.0f}" for c in meas["cpu"])
        cpu_speedup = base["cpu"][0] / max(meas["cpu"])
        if res is None:
            fwd = bwd = "0"
        else:
            tf, tb = _theory(args, cp_size)
            ok = "=" if (res["fwd"], res["bwd"]) == (tf, tb) else "!="
            fwd = f"{res['fwd'] * mib:.2f} {ok} ({tf * mib:.2f})"
            bwd = f"{res['bwd'] * mib:.2f} {ok} ({tb * mib:.2f})"
        lines.append(f"| {name} | {cp_size} | {layout} | {overlap} | {t * 1e3:.1f} | {base_t / t:.2f}x | "
                     f"{cpu} | {cpu_speedup:.2f}x | "
                     f"{fwd} | {bwd} |")
    t = args.seq
    lines += ["", f"Attention scores per rank per (batch, head), forward, T={t} (the schedule ring_attention "
              "runs). Blocks: a causal square counted in full (2cp/(cp+1) for contiguous); unmasked: only "
              "its lower triangle, what a tiled kernel that skips masked tiles approaches.", "",
              "| cp | layout | blocks, per rank | blocks max/mean | unmasked max/mean |",
              "|---|---|---|---|---|"]

    def ratio(c):
        return max(c) / (sum(c) / len(c))
    for cp_size in (2, 4, 8):
        for zig in (True, False):
            counts = [schedule_score_elements(t, cp_size, r, zigzag=zig) for r in range(cp_size)]
            exact = [schedule_score_elements(t, cp_size, r, zigzag=zig, count_masked=False)
                     for r in range(cp_size)]
            name = "zigzag" if zig else "contiguous"
            lines.append(f"| {cp_size} | {name} | {counts} | {ratio(counts):.3f} | {ratio(exact):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
