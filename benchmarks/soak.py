r"""Soak test: launch many short real torchrun runs back to back and count the clean exits.

    python benchmarks/soak.py                          30 runs, 8 ranks: dp_shard 2 x cp 2 x tp 2
    python benchmarks/soak.py --runs 50 --nproc 4 \
        --layout "--dp_shard_size 4 --context_parallel_size 1 --tensor_parallel_size 1"

A run that trains, saves and exports correctly but then dies at interpreter exit (a gloo thread
still alive while the process tears down: "terminate called without an active exception",
SIGABRT; see minipar/trainer/lifecycle.py) makes torchrun exit 1, so a scheduler sees a failed
job. Such a bug shows in a fraction of runs only, more often on a loaded machine; one run proves
nothing, so this launches many. Every run gets a fresh output directory (and, through
--standalone, its own rendezvous port); its exit code, duration and, for a failure, the tail of
its output are recorded. The table is rewritten after every run under benchmarks/results/, so an
interrupted soak still reports. --cores lets an aborting rank leave a core file for
`gdb python core` (that is how the abort above was traced).
Exit status: 0 when every run exited 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
LAYOUT = "--dp_shard_size 2 --context_parallel_size 2 --tensor_parallel_size 2"
TINY = ("--max_steps 10 --save_steps 5 --model.hidden_size 64 --model.intermediate_size 128 "
        "--model.num_hidden_layers 2 --model.num_attention_heads 4 --model.num_key_value_heads 2 "
        "--sequence_len 32 --global_batch_size 8 --warmup_steps 2 --eval_steps 5 --eval_batches 1 "
        "--logging_steps 5")


def torchrun() -> list:
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]


def _allow_core_dumps():
    import resource
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def launch(nproc: int, layout: str, extra: str, out: str, timeout: float, cores: bool = False) -> dict:
    cmd = torchrun() + ["--standalone", "--nproc-per-node", str(nproc), os.path.join(ROOT, "train.py"),
                        *shlex.split(layout), *shlex.split(TINY), *shlex.split(extra), "--output_dir", out]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    try:
        # with --cores, a rank that aborts leaves out/core* (cwd) for `gdb python core`
        p = subprocess.run(cmd, cwd=out if cores else ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           preexec_fn=_allow_core_dumps if cores else None)
        code, text = p.returncode, p.stdout
    except subprocess.TimeoutExpired as err:
        code, text = "timeout", (err.stdout or b"").decode(errors="replace") \
            if isinstance(err.stdout, bytes) else (err.stdout or "")
    return dict(code=code, seconds=round(time.time() - t0, 1), tail="\n".join(text.splitlines()[-25:]),
                aborted="terminate called" in text or "SIGABRT" in text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--layout", default=LAYOUT, help="the parallel sizes, as train.py flags")
    ap.add_argument("--extra", default="", help="more train.py flags for every run")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--cores", action="store_true", help="allow core dumps; keep a failed run's directory")
    ap.add_argument("--name", default="soak", help="results file: <results>/<name>.md and .json")
    ap.add_argument("--results", default=RESULTS, help="its folder (default benchmarks/results)")
    args = ap.parse_args(argv)

    work = tempfile.mkdtemp(prefix="minipar-soak-")
    runs = []
    try:
        for i in range(args.runs):
            out = os.path.join(work, f"run{i}")
            r = launch(args.nproc, args.layout, args.extra, out, args.timeout, args.cores)
            runs.append(r)
            print(f"run {i + 1:>3}/{args.runs}: exit {r['code']}  {r['seconds']:.0f} s"
                  + ("  (abort at exit)" if r["aborted"] else ""), flush=True)
            if r["code"] != 0 and args.cores:
                r["kept"] = shutil.move(out, os.path.join(tempfile.gettempdir(),
                                                          f"minipar-soak-failed-{os.getpid()}-{i}"))
                print(f"  kept {r['kept']}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
            text = write_results(args, runs)       # after every run: an interrupted soak still reports
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + text)
    return 0 if all(r["code"] == 0 for r in runs) else 1


def write_results(args, runs) -> str:
    ok = sum(r["code"] == 0 for r in runs)
    failures = [(i, r) for i, r in enumerate(runs) if r["code"] != 0]
    done = "" if len(runs) == args.runs else f" (interrupted: {len(runs)} of {args.runs})"
    lines = [f"# soak: {len(runs)} torchrun launches back to back{done}", "",
             f"command: `python benchmarks/soak.py --runs {args.runs} --nproc {args.nproc} "
             f"--layout \"{args.layout}\"" + (f" --extra \"{args.extra}\"" if args.extra else "") + "`", "",
             f"train.py flags: `{args.layout} {TINY} {args.extra}`".rstrip(), "",
             "| runs | exit 0 | failed | aborted at exit | mean s per run |", "|---|---|---|---|---|",
             f"| {len(runs)} | {ok} | {len(failures)} | {sum(r['aborted'] for r in runs)} | "
             f"{sum(r['seconds'] for r in runs) / max(len(runs), 1):.1f} |"]
    for i, r in failures:
        lines += ["", f"## run {i + 1}: exit {r['code']}", "", "```", r["tail"], "```"]
    text = "\n".join(lines) + "\n"
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, f"{args.name}.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.results, f"{args.name}.json"), "w") as f:
        json.dump(dict(args=vars(args), runs=runs), f, indent=1)
    return text


if __name__ == "__main__":
    sys.exit(main())
