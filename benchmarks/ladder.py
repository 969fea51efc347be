"""The ladder, measured: for each technique, its rungs from the textbook version to the optimised
one (docs/ladder.md), each a config value, each a full training step of the same Llama.

    python benchmarks/ladder.py [--rounds 2] [--steps 3] [--only dp,zero3,tp,cp,cp_impl,ep,pp]

    technique  world            rungs (config values)
    DP         dp_replicate 2   ddp: naive -> bucketed
    ZeRO-3     dp_shard 2       fsdp.prefetch: 0 -> 1 -> 2; fsdp.reshard_after_forward: false
    TP         tp 2             plain -> sequence_parallel -> tp_async_overlap (without, then with SP)
    CP         cp 2             cp_layout: contiguous -> zigzag (a longer sequence: attention matters)
    CP impl    cp 4             cp_impl: ring -> ulysses -> usp (cp_ulysses_size 2), zigzag, the same
                                sequence: K/V hops, two all-to-alls, or both (context_parallel/ulysses.py)
    EP         dp_shard 2       expert_parallel_size: 1 -> 2, a Mixtral-style MoE (8 experts, top-2):
                                every rank runs all experts on its own tokens (ZeRO-3 gathers them all),
                                or holds half and exchanges tokens (expert_parallel/dispatch.py)
    PP         pp 2, m 4        pipeline_schedule: 1f1b -> interleaved_1f1b -> zb_h1 -> zbv (one step
                                run by pipeline_parallel/executor.py over 4 micro-batches of 1 sequence)

What one measurement is: a fresh gloo world of forked ranks (tests/harness.py, one torch thread
each) builds the model, takes one warm-up step, then --steps timed steps (forward, backward,
AdamW), each started by a barrier. Per rung:

    step ms      wall time of a step, the slowest rank's, the median of the steps; the best over
                 --rounds (the rungs are interleaved round by round, so a burst of load on a
                 shared machine hits every rung alike, and the minimum is the least disturbed)
    CPU ms       process time of the slowest rank for the same step (compute plus gloo's threads):
                 on an overloaded machine this shows the work where wall time shows the queue
    MiB sent     bytes this rank puts on the wire per step, from the comm ledger (minipar/comm.py),
                 the largest over ranks, with the number of collective calls
    peak MiB     the rank's peak resident memory above what it held before building the model
                 (Linux VmHWM, reset through /proc/self/clear_refs; glibc told to map every block
                 of 64 KiB or more on its own and unmap it on free, so that resident memory follows
                 the live tensors): weights, gradients, optimizer states, activations and
                 communication buffers
    vs below     step time and peak memory over the rung above it in the table
    gathered MiB (ZeRO-3, EP) the peak of gathered parameter bytes, counted exactly by the shard
                 manager: what prefetching and resharding change, without the activations

Results go to benchmarks/results/ladder.md and ladder.json. On a 2-core CPU shared with other
jobs, read the bytes, the call counts and the memory as exact and the times as indicative.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]

from common import Measurement  # noqa: E402
from harness import run_world  # noqa: E402

import minipar  # noqa: E402
from minipar import ParallelismConfig, comm, comm_ledger  # noqa: E402

MODEL = dict(vocab_size=256, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4)
BATCH = dict(global_batch_size=4, sequence_len=256)
CP_MODEL = dict(MODEL, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
CP_BATCH = dict(global_batch_size=1, sequence_len=2048)
MOE_MODEL = dict(MODEL, intermediate_size=384, model_type="mixtral", num_local_experts=8,
                 num_experts_per_tok=2)

# technique -> (title, world layout, model, batch, [(rung, config shown, ParallelismConfig extras, wrap)])
LADDER = {
    "dp": ("Data parallelism (dp_replicate 2)", dict(dp_replicate_size=2), MODEL, BATCH, [
        ("naive", "ddp: naive", {}, ("ddp", "naive")),
        ("bucketed", "ddp: bucketed", {}, ("ddp", "bucketed"))]),
    "zero3": ("ZeRO-3 (dp_shard 2)", dict(dp_shard_size=2), MODEL, BATCH, [
        ("prefetch 0", "fsdp.prefetch: 0", {}, ("zero3", dict(prefetch=0))),
        ("prefetch 1", "fsdp.prefetch: 1", {}, ("zero3", dict(prefetch=1))),
        ("prefetch 2", "fsdp.prefetch: 2", {}, ("zero3", dict(prefetch=2))),
        ("no reshard", "fsdp.reshard_after_forward: false", {},
         ("zero3", dict(prefetch=1, reshard_after_forward=False)))]),
    "tp": ("Tensor parallelism (tp 2)", dict(tp_size=2), MODEL, BATCH, [
        ("plain", "tensor_parallel_size: 2", {}, None),
        ("sequence parallel", "sequence_parallel: true", dict(sequence_parallel=True), None),
        ("async overlap", "tp_async_overlap: true", dict(tp_async_overlap=True), None),
        ("SP + async overlap", "sequence_parallel + tp_async_overlap", dict(sequence_parallel=True,
                                                                            tp_async_overlap=True), None)]),
    "cp": ("Context parallelism (cp 2, T = 2048)", dict(cp_size=2), CP_MODEL, CP_BATCH, [
        ("contiguous", "cp_layout: contiguous", dict(cp_layout="contiguous"), ("ddp", "bucketed")),
        ("zigzag", "cp_layout: zigzag", dict(cp_layout="zigzag"), ("ddp", "bucketed"))]),
    # DDP over cp here as in the cp rungs, so that the bytes that differ are attention's alone
    "cp_impl": ("Context parallelism: attention impl (cp 4, T = 2048)", dict(cp_size=4), CP_MODEL, CP_BATCH, [
        ("ring", "cp_impl: ring", dict(cp_impl="ring"), ("ddp", "bucketed")),
        ("ulysses", "cp_impl: ulysses", dict(cp_impl="ulysses"), ("ddp", "bucketed")),
        ("usp", "cp_impl: usp, cp_ulysses_size: 2", dict(cp_impl="usp", cp_ulysses_size=2),
         ("ddp", "bucketed"))]),
    # ZeRO-3 in both rungs: the experts are gathered whole over dp_shard (ep 1), or each rank keeps
    # its half over edp (here of one rank: nothing gathered) and the tokens travel instead
    "ep": ("Expert parallelism (dp_shard 2, 8 experts, top-2)", dict(dp_shard_size=2), MOE_MODEL, BATCH, [
        ("all experts", "expert_parallel_size: 1", dict(ep_size=1), ("zero3", dict(prefetch=1))),
        ("ep 2", "expert_parallel_size: 2", dict(ep_size=2), ("zero3", dict(prefetch=1)))]),
    # a pipeline step (the rung's `wrap` names the schedule): 4 layers, so 2 per stage, 1 per chunk
    "pp": ("Pipeline parallelism (pp 2, 4 micro-batches)", dict(pp_size=2), MODEL, BATCH, [
        ("1f1b", "pipeline_schedule: 1f1b", {}, ("pp", "1f1b")),
        ("interleaved", "pipeline_schedule: interleaved_1f1b", {}, ("pp", "interleaved_1f1b")),
        ("zb_h1", "pipeline_schedule: zb_h1", {}, ("pp", "zb_h1")),
        ("zbv", "pipeline_schedule: zbv", {}, ("pp", "zbv"))]),
}


GATHERED = ("zero3", "ep")     # techniques whose table shows the shard manager's gathered bytes


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _exact_malloc() -> None:
    """Large blocks (>= 64 KiB: every tensor that matters) straight from mmap and back to the OS on
    free, so that resident memory follows the live tensors instead of glibc's cached heap."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)          # M_MMAP_THRESHOLD, fixed (no dynamic raising)
        libc.mallopt(-1, 128 * 1024)         # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _wrap(model, pgm, wrap):
    if wrap is None:
        return None
    kind, value = wrap
    if kind == "zero3":
        from minipar.zero3 import fully_shard
        fully_shard(model, pgm, **value)          # the units train.py uses: embedding, each layer
        return None
    from minipar.data_parallel import replicate, replicate_naive
    return (replicate_naive if value == "naive" else replicate)(model, pgm.dp_cp)


def _pipeline_step(model, pgm, schedule, ids):
    """A step's forwards and backwards through pipeline_parallel's executor: `model` is the stage,
    every sequence of the global batch one micro-batch."""
    from minipar.pipeline_parallel import run_schedule, schedule_order
    v = model.num_chunks
    micro = [dict(input_ids=ids[i:i + 1, :-1], labels=ids[i:i + 1, 1:],
                  position_ids=torch.arange(ids.shape[1] - 1).unsqueeze(0)) for i in range(ids.shape[0])]
    m = len(micro)
    run_schedule(model, schedule_order(schedule, pgm.pp.size, m, pgm.pp.rank, v), pgm, micro,
                 torch.tensor(ids[:, 1:].numel()))


def _rung(layout, extras, model_kw, batch, wrap, steps):
    """One rung on one rank: warm-up, then timed steps; returns this rank's numbers."""
    from minipar.batch_split import local_batch
    from minipar.optim import build_optimizer
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    pgm = minipar.init(ParallelismConfig(**layout, **extras))
    _exact_malloc()
    # one step of a tiny model of the same layout first: torch's lazily loaded kernels, autograd's
    # threads and gloo's buffers are then in the baseline, not in the rung's peak
    tiny = dict(model_kw, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    pipelined = wrap is not None and wrap[0] == "pp"
    if pipelined:                               # the tiny warm-up model: 2 layers a stage, 1F1B
        tiny["num_hidden_layers"] = 2 * pgm.pp.size
    tiny_model = LlamaForCausalLM(LlamaConfig(**tiny, max_position_embeddings=batch["sequence_len"]), pgm,
                                  seed=0)
    if pipelined:
        from minipar.pipeline_parallel import build_stage
        tiny_model = build_stage(tiny_model, pgm)
    _wrap(tiny_model, pgm, None if pipelined else wrap)
    T0 = 8 * pgm.cp.size * pgm.tp.size
    t_ids = torch.zeros(pgm.dp.size, T0 + 1, dtype=torch.long)
    t_b = local_batch(t_ids[:, :-1], t_ids[:, 1:], pgm)
    tiny_opt = build_optimizer(tiny_model, lr=1e-3)
    if pipelined:
        _pipeline_step(tiny_model, pgm, "1f1b", torch.zeros(2 * pgm.pp.size, T0 + 1, dtype=torch.long))
    else:
        tiny_model(t_b["input_ids"], position_ids=t_b["position_ids"], labels=t_b["labels"],
                   num_items_in_batch=torch.tensor(t_ids.numel())).backward()
    tiny_opt.step()
    del tiny_model, tiny_opt, t_b
    resettable = _reset_peak()
    base = _rss_kib("VmRSS")
    model = LlamaForCausalLM(LlamaConfig(**model_kw, max_position_embeddings=batch["sequence_len"]), pgm,
                             seed=0)
    if pipelined:
        from minipar.pipeline_parallel import build_stage
        model = build_stage(model, pgm, 2 if wrap[1] in ("interleaved_1f1b", "zbv") else 1, None, wrap[1])
    _wrap(model, pgm, None if pipelined else wrap)
    opt = build_optimizer(model, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    B, T = batch["global_batch_size"], batch["sequence_len"]
    ids = torch.randint(0, model_kw["vocab_size"], (B, T + 1), generator=g)
    b = local_batch(ids[:, :-1], ids[:, 1:], pgm)
    n = torch.tensor(B * T)
    flag = torch.zeros(1)
    walls, cpus, sent, calls = [], [], 0.0, 0
    for it in range(steps + 1):
        comm.all_reduce(flag, pgm.world)                     # a barrier: every rank starts together
        t0, c0 = time.perf_counter(), time.process_time()
        with comm_ledger.ledger() as led:
            if pipelined:
                _pipeline_step(model, pgm, wrap[1], ids)
            else:
                loss = model(b["input_ids"], position_ids=b["position_ids"], labels=b["labels"],
                             num_items_in_batch=n)
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if it:                                                # step 0 is the warm-up
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
            sent, calls = led.wire_bytes(), led.count()
    peak = (_rss_kib("VmHWM") - base) / 1024 if resettable else float("nan")
    z = getattr(model, "zero3", None)                         # ZeRO-3 counts its gathered bytes exactly
    gathered = z.peak_gathered_bytes / 2 ** 20 if z is not None else None
    # the slowest rank of each step
    t = torch.tensor([walls, cpus], dtype=torch.float64)
    comm.all_reduce(t, pgm.world, op="max")
    return dict(wall=statistics.median(t[0].tolist()), cpu=statistics.median(t[1].tolist()),
                sent=sent, calls=calls, peak=peak, gathered=gathered)


def measure(names, rounds, steps):
    results = {name: {r[0]: [] for r in LADDER[name][4]} for name in names}
    for rnd in range(rounds):
        for name in names:
            title, layout, model_kw, batch, rungs = LADDER[name]
            world = 1
            for v in layout.values():
                world *= v
            for rung, _, extras, wrap in rungs:
                ranks = run_world(_rung, world, layout, extras, model_kw, batch, wrap, steps, timeout=900)
                results[name][rung].append(dict(wall=ranks[0]["wall"], cpu=ranks[0]["cpu"],
                                                sent=max(r["sent"] for r in ranks),
                                                calls=max(r["calls"] for r in ranks),
                                                peak=max(r["peak"] for r in ranks),
                                                gathered=ranks[0]["gathered"]))
                last = results[name][rung][-1]
                print(f"round {rnd + 1}/{rounds} {name:6s} {rung:20s} {1e3 * last['wall']:8.1f} ms  "
                      f"{last['sent'] / 2 ** 20:7.2f} MiB  {last['calls']:4d} calls  "
                      f"{last['peak']:7.1f} MiB peak",
                      flush=True)
    best = {}
    for name in names:
        best[name] = {}
        for rung, runs in results[name].items():
            best[name][rung] = dict(wall=min(r["wall"] for r in runs), cpu=min(r["cpu"] for r in runs),
                                    sent=runs[0]["sent"], calls=runs[0]["calls"],
                                    peak=min(r["peak"] for r in runs), gathered=runs[0]["gathered"],
                                    rounds=runs)
    return best


def table(name, rows) -> str:
    title, layout, model_kw, batch, rungs = LADDER[name]
    m = model_kw
    out = [f"### {title}", "",
           f"Llama hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
           f"{m['num_attention_heads']} heads ({m['num_key_value_heads']} KV), "
           f"global batch {batch['global_batch_size']} x {batch['sequence_len']} "
           f"tokens, fp32, AdamW.", "",
           "| rung | config | step ms | vs below | CPU ms | MiB sent/rank/step | calls/step | peak MiB "
           "| vs below |"
           + (" gathered MiB |" if name in GATHERED else ""),
           "|---|---|---|---|---|---|---|---|---|" + ("---|" if name in GATHERED else "")]
    prev = None
    for rung, shown, _, _ in rungs:
        r = rows[rung]
        t_ratio = f"{r['wall'] / prev['wall']:.2f}x" if prev else "-"
        m_ratio = f"{r['peak'] / prev['peak']:.2f}x" if prev and prev["peak"] > 0 else "-"
        out.append(f"| {rung} | `{shown}` | {1e3 * r['wall']:.0f} | {t_ratio} | {1e3 * r['cpu']:.0f} | "
                   f"{r['sent'] / 2 ** 20:.2f} | {r['calls']} | {r['peak']:.1f} | {m_ratio} |"
                   + (f" {r['gathered']:.2f} |" if name in GATHERED else ""))
        prev = r
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all rungs (best kept)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per measurement (median kept)")
    ap.add_argument("--only", default="dp,zero3,tp,cp,cp_impl,ep,pp",
                    help="comma-separated: dp, zero3, tp, cp, cp_impl, ep, pp")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ladder"))
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in LADDER]
    if unknown or args.rounds < 1 or args.steps < 1:
        ap.error(f"--only takes {', '.join(LADDER)} (got {unknown}); --rounds and --steps must be >= 1")
    torch.set_num_threads(1)
    run = Measurement("ladder.py", argv)
    best = measure(names, args.rounds, args.steps)
    run.done()
    head = ["# The ladder (benchmarks/ladder.py)", "",
            f"`{run.command}`: {args.rounds} interleaved round(s), median of {args.steps} step(s) each, "
            f"best round kept; CPU, gloo, 1 torch thread per forked rank. Bytes and calls are exact "
            f"(comm ledger); peak MiB is resident memory above the rank's baseline; times on a 2-core CPU "
            f"are indicative (CPU ms is the slowest rank's process time). {run.machine()}", ""]
    md = "\n".join(head + [table(n, best[n]) + "\n" for n in names])
    return run.save(args.out, md, quick=False, results={n: best[n] for n in names})

if __name__ == "__main__":
    sys.exit(main())
