"""The device check: on one lent GPU, in under 8 minutes, what the CPU cannot show.

    python benchmarks/device_check.py                       on the GPU machine; results under $OUT
    python benchmarks/device_check.py --device cpu --small  the same steps, small, on this CPU (the
                                                            test of this script: tests/test_benchmarks.py)

Time on a GPU comes in short slots, one GPU at a time, so every step is prepared here, runs in a
process of its own under its own time limit, and a failing or stuck step is recorded and the next
one runs. The steps:

    device        torch, CUDA, NCCL versions; the device's name, capability and memory
    attention     each ring block shape (the causal square, zigzag's two half blocks, a block cut by
                  documents) through the block kernel against the fp32 math path, with the kernel
                  each one took and why (fused_attention.py)
    ring          ring attention at cp 2 and 4 as threads on the one GPU (thread_world.py), plain
                  and packed, bf16 and fp32, against one process's attention (device_threads.py)
    zero3         ZeRO-3 at dp_shard 2 as threads on the GPU, forced to shard: gather, prefetch,
                  free and reduce-scatter on CUDA streams, against one process (device_threads.py)
    syncs         the host syncs of each steady-state training step, dense and MoE, as CUDA itself
                  reports them (torch.cuda.set_sync_debug_mode "warn"; on the CPU the counter of
                  tests/test_host_syncs.py), against docs/design.md's allowance (sync_check.py)
    p2p           the pipeline's p2p under NCCL, two processes on the GPU, 16 MiB activations,
                  each schedule (device_p2p.py), tied embeddings (their gradients all-reduced over
                  the pp group the sends use) and a pipelined evaluation: a posting order NCCL could
                  deadlock on hangs here
    bench_gpu     a ~1 B Llama in bf16: tokens/s, MFU and peak memory beside the planner's
                  estimate for the same run (bench_gpu.py)

Results, in the folder --out names ($OUT by default): a JSON file (every row of every step, the
device, the load average) and a markdown table of the same rows, both named device_check, with each
step's log. Exit 1 when a step failed. To publish, copy the two to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

BUDGET_S = 480                          # the whole check: 8 minutes of a slot
LIMITS = {"device": 30, "attention": 45, "ring": 45, "zero3": 45, "syncs": 60, "p2p": 110, "bench_gpu": 140}
P2P_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")


# ------------------------------------------------------------------ the steps run in a child process
def step_device(device, small):
    import torch
    info = dict(torch=torch.__version__, cuda=torch.version.cuda, device=str(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2 ** 30, 1),
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return dict(rows=[dict(name="device", ok=True, detail=", ".join(f"{k} {v}" for k, v in info.items()))],
                info=info)


def step_attention(device, small):
    from benchmarks.device_kernels import attention_step
    return attention_step(device, small)


def step_ring(device, small):
    from benchmarks.device_threads import ring_step
    return ring_step(device, small)


def step_zero3(device, small):
    from benchmarks.device_threads import zero3_step
    return zero3_step(device, small)


IN_PROCESS = {"device": step_device, "attention": step_attention, "ring": step_ring, "zero3": step_zero3}


def _child(name: str, device: str, small: bool, result: str) -> int:
    import torch
    torch.manual_seed(0)
    out = IN_PROCESS[name](torch.device(device), small)
    with open(result, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0


# ------------------------------------------------------------------------------------ the driver
def _run(cmd, limit, log):
    """Run cmd under a time limit, its output to `log` and the terminal; -> (exit code, seconds)."""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with open(log, "a") as f:
        # a session of its own, so that a step over its limit is killed with everything it started
        # (torchrun's workers too), not just the launcher
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = 124
    return code, time.perf_counter() - start


def _tail(log, n=3):
    try:
        with open(log) as f:
            lines = [line.strip() for line in f if line.strip()]
        return " | ".join(lines[-n:])[-400:]
    except OSError:
        return ""


def _bench_summary(b: dict) -> str:
    """bench_gpu's figures in one line: throughput, MFU, memory measured and planned."""
    planned = (b.get("planner") or {}).get("memory", {}).get("total")
    return (f"{b['shape']}: {b['tokens_per_s']:.0f} tokens/s, MFU {100 * b['mfu']:.1f} % of "
            f"{b['peak_tflops']:.0f} TFLOP/s, peak memory {b['peak_memory_bytes'] / 2 ** 30:.3g} GiB"
            + (f" (planned {planned / 2 ** 30:.3g} GiB)" if planned else ""))


def run_step(name, device, small, out, limit, schedules=P2P_SCHEDULES):
    """-> the step's record: name, ok, seconds, rows (each check), error (why it failed)."""
    log = os.path.join(out, f"{name}.log")
    if name in IN_PROCESS:
        result = os.path.join(out, f"{name}.json")
        code, secs = _run([sys.executable, os.path.abspath(__file__), "--step", name, "--device", device,
                           "--result", result] + (["--small"] if small else []), limit, log)
        rows = json.load(open(result))["rows"] if code == 0 and os.path.exists(result) else []
    elif name == "p2p":
        rows, secs, code = [], 0.0, 0
        for schedule in schedules:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   os.path.join(ROOT, "benchmarks", "device_p2p.py"), "--schedule", schedule,
                   "--device", device, "--timeout", "20" if small else "40"]
            c, s = _run(cmd + (["--small"] if small else []), limit / len(schedules), log)
            secs += s
            code = code or c
            rows.append(dict(name=f"p2p pp 2 {schedule}, m 4", ok=c == 0, seconds=round(s, 1),
                             detail="2 steps and an evaluation, no hang" if c == 0 else
                             ("timed out: a hang" if c == 124 else f"exit {c}: {_tail(log, 1)}")))
    elif name == "syncs":
        rows, secs, code = [], 0.0, 0
        for moe in (False, True):
            result = os.path.join(out, f"syncs{'_moe' if moe else ''}.json")
            c, t = _run([sys.executable, os.path.join(ROOT, "benchmarks", "sync_check.py"), "--out", result]
                        + (["--moe"] if moe else []) + (["--small"] if small else []), limit / 2, log)
            secs, code = secs + t, code or c
            if os.path.exists(result):
                for step, r in json.load(open(result))["steps"].items():
                    where = "; ".join(f"{n} x {e}" for e, n in r.items() if e not in ("total", "allowed"))
                    rows.append(dict(name=f"{'moe' if moe else 'dense'} step {step}: {r['total']} syncs",
                                     ok=r["total"] <= r["allowed"], detail=f"allowed {r['allowed']}"
                                     + (f"; {where}" if where else "")))
    else:                               # bench_gpu
        result = os.path.join(out, "bench_gpu.json")
        cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--out", result]
        code, secs = _run(cmd + (["--device", "cpu", "--tiny"] if device == "cpu" else []), limit, log)
        rows = []
        if code == 0 and os.path.exists(result):
            summary = _bench_summary(json.load(open(result))["result"])
            rows.append(dict(name="bench_gpu", ok=True, detail=summary))
    ok = code == 0 and bool(rows) and all(r.get("ok") for r in rows)
    error = "" if ok else ("timed out after %d s" % limit if code == 124 else _tail(log))
    return dict(name=name, ok=ok, seconds=round(secs, 1), limit=limit, rows=rows, error=error)


def table(record) -> str:
    info = record["device_info"]
    lines = [f"# Device check: {info.get('name', record['device'])}", "",
             f"torch {info.get('torch')}, load average {record['load_start']:.2f} at the start, "
             f"{record['load_end']:.2f} at the end; {record['seconds']:.0f} s in all.", "",
             "| step | check | ok | max error | tolerance | detail |", "|---|---|---|---|---|---|"]
    for s in record["steps"]:
        if not s["rows"]:
            lines.append(f"| {s['name']} | (step) | FAILED | | | {s['error']} |")
        for r in s["rows"]:
            err = f"{r['max_err']:.2e}" if "max_err" in r else ""
            tol = f"{r['tol']:.0e}" if r.get("tol") else ""
            lines.append(f"| {s['name']} | {r['name']} | {'yes' if r.get('ok') else 'NO'} | {err} | {tol} | "
                         f"{r.get('detail', r.get('kernel', ''))} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="small shapes: checks the script, not the device")
    ap.add_argument("--out", default=os.environ.get("OUT", "out/device_check"))
    ap.add_argument("--steps", default=",".join(LIMITS), help=f"a subset of {','.join(LIMITS)}")
    ap.add_argument("--p2p-schedules", default=",".join(P2P_SCHEDULES),
                    help="the schedules the p2p step runs, one launch each")
    ap.add_argument("--step", help=argparse.SUPPRESS)          # internal: run one step in this process
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.step:
        return _child(args.step, args.device, args.small, args.result)
    steps = args.steps.split(",")
    unknown = [s for s in steps if s not in LIMITS]
    if unknown:
        raise ValueError(f"device_check: unknown steps {unknown}; choose from {list(LIMITS)}")
    os.makedirs(args.out, exist_ok=True)
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    record = dict(device=args.device, small=args.small, load_start=load_start, steps=[], device_info={})
    for name in steps:
        left = BUDGET_S - (time.perf_counter() - start)
        if left < 10:
            record["steps"].append(dict(name=name, ok=False, seconds=0, limit=0, rows=[],
                                        error=f"not run: the {BUDGET_S} s budget is spent"))
            continue
        print(f"== {name} (limit {min(LIMITS[name], left):.0f} s)", flush=True)
        s = run_step(name, args.device, args.small, args.out, min(LIMITS[name], left),
                     args.p2p_schedules.split(","))
        print(f"== {name}: {'ok' if s['ok'] else 'FAILED ' + s['error']} ({s['seconds']} s)", flush=True)
        record["steps"].append(s)
        if name == "device" and s["ok"]:
            record["device_info"] = json.load(open(os.path.join(args.out, "device.json")))["info"]
    record.update(seconds=time.perf_counter() - start, load_end=os.getloadavg()[0])
    with open(os.path.join(args.out, "device_check.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.out, "device_check.md"), "w") as f:
        f.write(table(record))
    failed = [s["name"] for s in record["steps"] if not s["ok"]]
    print(table(record))
    print(f"device_check: {'failed: ' + ', '.join(failed) if failed else 'every step passed'}; "
          f"results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
