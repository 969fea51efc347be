"""Pipeline schedules as they really run: bubble, activation memory and bytes sent per stage,
next to the ideal and the theory, and the timeline of one step drawn from the recorded events.

    python benchmarks/bench_pp.py [--cells 2:4 2:8 2:16 4:4 4:8] [--hidden 1024] [--seq 128] [--iters 3]
    python benchmarks/bench_pp.py --quick --out /tmp/bench_pp.md          # a 1-minute smoke run

Run it with nothing else on the machine: it records the load average at its start and end, and
REFUSES to write under benchmarks/results/ when the load at the start exceeds the core count (a
rank that shares a core stretches its compute while its neighbour runs, and the bubble it measures
means nothing; p = 2 wants 2 idle cores, p = 4 four).

For each schedule (afab, 1f1b, interleaved_1f1b with v = 2, zb_h1, zbv), p stages and m
micro-batches: one Llama of p x 2 x --layers-per-chunk decoder layers for every schedule (so 1F1B's
stage is two of zbv's or the interleaved schedule's chunks), split with
minipar.pipeline_parallel.build_stage, one step run by run_schedule on p forked gloo ranks (one
torch thread each). Per stage, from the executor's hooks (recorder.py's Recorder) and the comm ledger:

    bubble       1 - (time in F / B / W compute) / (step time)
    ideal        the same action lists through simulate.simulate with each stage's own mean t_F,
                 t_B (and t_W) per chunk: what the stages would see with free sends and no
                 executor overhead (a stage slower than its neighbours, e.g. the one with the
                 loss, still delays them, as it does on any machine); `replay` the same with
                 every action's own measured time (the jitter of compute kept, only the sends'
                 and the executor's cost left out)
    waiting      the part of the bubble blocked in a receive or done before the slowest stage;
                 the rest is the executor's own overhead (posting sends, Python between actions)
    theory       simulate.theory_bubble: the formula at t_F = t_B (= t_W)
    live         the most micro-batch chunks held (F done; B, or W under zb_h1 / zbv, not yet)
    saved MiB    the peak of the bytes autograd holds for backward (saved_tensors_hooks count
                 every saved tensor that is not a parameter, while it is alive)
    W MiB        the peak of what the split backward keeps for W (x and dy of each Linear; x
                 may also be counted in `saved` while its B has not run)
    sent         the bytes the ledger saw this rank send; over the pipeline it must be
                 2 x boundaries x m x bytes(h), boundaries p - 1 (interleaved v p - 1, zbv 2 (p - 1)
                 that cross ranks), h = (micro_batch, seq, hidden) fp32

A second table puts the schedules side by side per (p, m): the mean measured and ideal bubble,
measured / ideal, and each ideal bubble (in idle time per step) over 1F1B's. A step's numbers are
from the iteration whose slowest stage was fastest. The figure: one row per stage, time across,
F, B and W boxes in three colours (lighter: chunk b), for the largest p of --cells and its largest m,
each schedule; written next to the table (bench_pp.png).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import pp_report  # noqa: E402
from harness import run_world  # noqa: E402

import minipar  # noqa: E402
from minipar import ParallelismConfig, comm_ledger  # noqa: E402
from minipar.pipeline_parallel import (  # noqa: E402
    Recorder,
    build_stage,
    exchange_plan,
    run_schedule,
    schedule_order,
    simulate,
)
from minipar.pipeline_parallel.schedules import Action  # noqa: E402
from minipar.pipeline_parallel.simulate import back_to_back, peak_in_flight, steady_state  # noqa: E402
from models.llama import LlamaForCausalLM  # noqa: E402
from models.llama_config import LlamaConfig  # noqa: E402

SCHEDULE_V = (("afab", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


class SavedBytes:
    """Live bytes autograd saved for backward (parameters excluded), and their peak."""

    def __init__(self):
        self.live = self.peak = 0

    def _free(self, n):
        self.live -= n

    def pack(self, t):
        if t.requires_grad and t.is_leaf:         # a parameter: not an activation
            return t
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        holder = _Holder(t)
        weakref.finalize(holder, self._free, n)
        return holder

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Holder) else x


class _Holder:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


def _rank(args, schedule, p, m, v):
    torch.set_num_threads(1)
    pgm = minipar.init(ParallelismConfig(pp_size=p, dp_shard_size=1))
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_hidden_layers=p * 2 * args.layers_per_chunk,
                      num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                      max_position_embeddings=args.seq)
    stage = build_stage(LlamaForCausalLM(cfg, pgm, seed=0), pgm, v, None, schedule)
    order = schedule_order(schedule, p, m, pgm.pp.rank, v)
    plan = exchange_plan(schedule, p, m, v, pgm.pp.rank)
    gen = torch.Generator().manual_seed(0)
    batches = [dict(input_ids=torch.randint(0, 256, (args.micro_batch, args.seq), generator=gen),
                    labels=torch.randint(0, 256, (args.micro_batch, args.seq), generator=gen),
                    position_ids=torch.arange(args.seq).expand(args.micro_batch, -1)) for _ in range(m)]
    n_items = m * args.micro_batch * args.seq
    runs = []
    for it in range(args.iters + 1):
        rec, mem = Recorder(), SavedBytes()
        dist.barrier()
        with comm_ledger.ledger() as led, torch.autograd.graph.saved_tensors_hooks(mem.pack, mem.unpack):
            run_schedule(stage, order, pgm, batches, n_items, hooks=rec, plan=plan)
        stage.zero_grad(set_to_none=True)
        if it:                                   # the first step warms up allocator and gloo
            runs.append(dict(t0=rec.t0, step=rec.t_end, events=rec.events, waits=rec.waits,
                             live=rec.peak_live,
                             saved=mem.peak, sent=led.total_bytes("send"), peak_theory=peak_in_flight(order),
                             held_w=rec.peak_held_w))
    chain = []                                   # steps back to back: no barrier, no collective between
    dist.barrier()
    for _ in range(args.chain):
        rec = Recorder()
        run_schedule(stage, order, pgm, batches, n_items, hooks=rec, plan=plan)
        stage.zero_grad(set_to_none=True)        # what a stage's own optimizer step would do: nothing shared
        chain.append((rec.t0, rec.events))
    return runs, chain


def _durations(events, v):
    """From each rank's recorded (kind, chunk, micro, start, end): the mean t_F, t_B, t_W of a whole
    stage (a chunk's time x v), each stage's own mean per (rank, kind, chunk), and each action's
    measured time per (rank, kind, chunk, micro): what the ideal, the replay and the even-time
    simulations take."""
    def mean(kind):
        ts = [e - s for ev in events for k, _, _, s, e in ev if k == kind]
        return v * sum(ts) / len(ts) if ts else 0.0
    own, took = {}, {}
    for rank, ev in enumerate(events):
        for k, c, mi, s, e in ev:
            own.setdefault((rank, k, c), []).append(e - s)
            took[(rank, k, c, mi)] = e - s
    own = {key: sum(ts) / len(ts) for key, ts in own.items()}
    return dict(t_f=mean("F"), t_b=mean("B"), t_w=mean("W")), own, took


def _steady(chains, schedule, p, m, v):
    """The steps run back to back: their step time and each stage's bubble (simulate.steady_state),
    the same for the chain simulated with each stage's mean times, and the idle time of the chain
    simulated at the mean t_F, t_B, t_W over 1F1B's at the same times (1F1B's backward B + W)."""
    t0 = min(c[0][0] for c in chains)
    recorded = [[(k, c, mi + step * m, s + t - t0, e + t - t0)
                 for step, (t, evs) in enumerate(chain) for k, c, mi, s, e in evs] for chain in chains]
    period, idle = steady_state([[(Action(*x[:3]), *x[3:]) for x in ev] for ev in recorded], m)
    times, own, took = _durations(recorded, v)
    orders = back_to_back([schedule_order(schedule, p, m, rank, v) for rank in range(p)], m, len(chains[0]))
    ideal = simulate(orders, v, name=schedule, duration=lambda rank, a: own[(rank, a.kind, a.chunk)])[0]
    ideal_period, ideal_idle = steady_state(ideal, m)
    replay = simulate(orders, v, name=schedule, duration=lambda rank, a: took[(rank, *a)])[0]
    replay_period, replay_idle = steady_state(replay, m)
    even = steady_state(simulate(orders, v, name=schedule, **times)[0], m)[1]
    ones = back_to_back([schedule_order("1f1b", p, m, rank) for rank in range(p)], m, len(chains[0]))
    one = steady_state(simulate(ones, 1, t_f=times["t_f"], t_b=times["t_b"] + times["t_w"])[0], m)[1]
    rows = [dict(events=ev, bubble=i / period) for ev, i in zip(recorded, idle)]
    return dict(step=period, ideal=sum(ideal_idle) / p / ideal_period, vs_1f1b=sum(even) / sum(one),
                replay=sum(replay_idle) / p / replay_period, rows=rows)


def _measure(args, schedule, p, m, v):
    got = run_world(_rank, p, args, schedule, p, m, v, timeout=1800)
    per_rank = [runs for runs, _ in got]
    best = min(range(args.iters), key=lambda i: max(r[i]["step"] for r in per_rank))
    rows = [r[best] for r in per_rank]
    t0 = min(r["t0"] for r in rows)
    for r in rows:                               # one time axis for all stages
        r["events"] = [(k, c, mi, s + r["t0"] - t0, e + r["t0"] - t0) for k, c, mi, s, e in r["events"]]
        r["waits"] = [(s + r["t0"] - t0, e + r["t0"] - t0) for s, e in r["waits"]]
    step = max(r["events"][-1][4] for r in rows)
    times, own, took = _durations([r["events"] for r in rows], v)
    orders = [schedule_order(schedule, p, m, rank, v) for rank in range(p)]
    ideal_events, ideal_step = simulate(orders, v, name=schedule,
                                        duration=lambda rank, a: own[(rank, a.kind, a.chunk)])
    replay_events, replay_step = simulate(orders, v, name=schedule,
                                          duration=lambda rank, a: took[(rank, a.kind, a.chunk, a.micro)])
    even_events, even_step = simulate(orders, v, name=schedule, **times)     # one mean for every stage
    same = None                                  # 1F1B at this run's times (B + W its backward)
    if times["t_w"]:
        ones = [schedule_order("1f1b", p, m, rank) for rank in range(p)]
        one_events, one_step = simulate(ones, 1, t_f=times["t_f"], t_b=times["t_b"] + times["t_w"])
        same = sum(one_step - sum(e - s for _, s, e in ev) for ev in one_events) / p
    for rank, r in enumerate(rows):
        busy = sum(e - s for _, _, _, s, e in r["events"])
        r["bubble"] = 1 - busy / step
        # idle: blocked in a receive, or done and waiting for the slowest stage; the rest of the
        # step that is not compute is the executor's own time (sends, Python between actions)
        idle = sum(e - s for s, e in r["waits"]) + step - r["events"][-1][4]
        r["waiting"], r["overhead"] = idle / step, 1 - busy / step - idle / step
        r["ideal"] = 1 - sum(e - s for _, s, e in ideal_events[rank]) / ideal_step
        r["ideal_idle"] = ideal_step - sum(e - s for _, s, e in ideal_events[rank])
        r["replay"] = 1 - sum(e - s for _, s, e in replay_events[rank]) / replay_step
        r["even_idle"] = even_step - sum(e - s for _, s, e in even_events[rank])
    return dict(schedule=schedule, p=p, m=m, v=v, step=step, rows=rows, ideal_step=ideal_step,
                one_f_one_b_idle=same, steady=_steady([c for _, c in got], schedule, p, m, v), **times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", nargs="+", default=["2:4", "2:8", "2:16", "4:4", "4:8"], metavar="P:M",
                    help="(stages p, micro-batches m) to run; p 4 shares 2 cores, so it runs fewer m")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--layers-per-chunk", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--chain", type=int, default=4,
                    help="steps then run back to back, with no collective between them (at least 3: the "
                         "first and the last are the chain's fill and drain)")
    ap.add_argument("--schedules", nargs="+", default=[s for s, _ in SCHEDULE_V],
                    choices=[s for s, _ in SCHEDULE_V])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: p 2, m 4, hidden 64, seq 32, 1 iteration (not a measurement)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench_pp.md"))
    args = ap.parse_args(argv)
    if args.quick:
        args.cells, args.hidden, args.seq, args.iters, args.chain = ["2:4"], 64, 32, 1, 3
    try:
        cells = [tuple(int(x) for x in c.split(":")) for c in args.cells]
        assert all(len(c) == 2 and c[0] >= 2 and c[1] >= 1 for c in cells)
    except (ValueError, AssertionError):
        ap.error(f"--cells takes P:M pairs with P >= 2 stages and M >= 1 micro-batches, got {args.cells}")
    if args.chain < 3:
        ap.error(f"--chain must be at least 3 steps (the first and the last are the chain's fill and drain), "
                 f"got {args.chain}")
    if args.hidden < 64 or args.hidden % 64:       # head_dim 64: hidden / 64 query heads
        ap.error(f"--hidden must be a positive multiple of 64 (heads of 64), got {args.hidden}")
    load_start, cores = os.getloadavg()[0], os.cpu_count()
    published = os.path.abspath(args.out).startswith(RESULTS + os.sep)
    if published and (load_start > cores or args.quick):
        raise SystemExit(f"bench_pp: load average {load_start:.1f} at the start on {cores} cores"
                         + (" (or --quick)" if args.quick else "") + f": refusing to write {args.out}, "
                         f"whose bubbles must be measured on a quiet machine (pass --out elsewhere to try "
                         f"it)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)   # the table and the PNG
    results, t_start = [], time.time()
    for p, m in cells:
        for schedule, v in SCHEDULE_V:
            if schedule not in args.schedules:
                continue
            if schedule != "afab" and m < p or (schedule == "interleaved_1f1b" and m % p):
                continue
            results.append(_measure(args, schedule, p, m, v))
            print(f"  {schedule} p={p} m={m}: step {results[-1]['step'] * 1e3:.0f} ms", flush=True)
    load_end = os.getloadavg()[0]
    lines = pp_report.tables(args, results, cores, load_start, load_end)
    big_p = max(p for p, _ in cells)
    big_m = max(m for p, m in cells if p == big_p)
    drawn = [r for r in results if r["p"] == big_p and r["m"] == big_m]
    png = os.path.splitext(args.out)[0] + ".png"
    if drawn:
        pp_report.draw(drawn, png)
        chained = os.path.splitext(args.out)[0] + "_back_to_back.png"
        pp_report.draw([dict(r, **r["steady"], back_to_back=True) for r in drawn], chained)
        shown = [os.path.relpath(x, ROOT) if published else os.path.basename(x) for x in (png, chained)]
        lines += ["", f"Timeline of p={big_p}, m={big_m} as recorded: `{shown[0]}` (one step), "
                  f"`{shown[1]}` ({args.chain} steps back to back)."]
    lines += ["", f"Regenerate: `{' '.join(['python benchmarks/bench_pp.py', *(argv or sys.argv[1:])])}` "
              f"({time.time() - t_start:.0f} s)."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    return results


if __name__ == "__main__":
    main()
