"""What every benchmark shares: the model sizes, one timed world per variant, memory measured alike.

A variant (say "minipar ZeRO-3" at 2 ranks, 10 M parameters) runs in a FRESH world of forked gloo
ranks (tests/harness.py: one torch thread per rank), so no variant inherits another's allocations:

    fork -> gloo group -> baseline: reset the peak resident set (/proc/self/clear_refs "5"),
            read VmRSS -> build the model, wrap it -> warm-up steps -> timed steps -> read VmHWM
    peak RSS    = VmHWM - baseline, the most this rank's process grew over its post-import state,
                  the largest over ranks (every row, minipar's and torch's, measured the same way)
    step time   = per step, the slowest rank's wall time (an all-reduce of max); a world reports the
                  median of its timed steps; CPU time likewise (the busiest rank's process time,
                  which other jobs on a shared machine disturb less than the wall clock)

run_all.py interleaves the variants of a comparison, A B A B, for several rounds (a fresh world
each time), so load from other jobs on a shared machine hits them alike; it prints the median and
the min-max over rounds, and the ratio to the peer per round (paired, so drift cancels).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(ROOT, "tests"), ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from harness import run_world  # noqa: E402

MB = 2 ** 20


@dataclass(frozen=True)
class Size:
    """A Llama shape (heads divisible by 4, so tp = 4 fits) and what one rank computes per step."""
    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    rows: int = 2          # samples per rank per step (ZeRO-3, DDP) or per tp group (TP)
    seq: int = 64          # tokens per sample
    cp_seq: int = 4096     # the CP comparison (ring, ulysses, usp): sequence length of one attention

    def llama(self):
        from models.llama_config import LlamaConfig
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden,
                           intermediate_size=self.intermediate,
                           num_hidden_layers=self.layers, num_attention_heads=8, num_key_value_heads=4,
                           max_position_embeddings=max(self.seq, 128))

    @property
    def n_params(self) -> int:
        h, f, v, kv = self.hidden, self.intermediate, self.vocab, self.hidden // 2
        return 2 * v * h + h + self.layers * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h)


SIZES = {"1M": Size("1M", 512, 128, 384, 4, cp_seq=2048),
         "10M": Size("10M", 2048, 384, 1024, 5, cp_seq=4096),
         "50M": Size("50M", 4096, 768, 2048, 7, cp_seq=8192)}


# ------------------------------------------------------------------------------ memory
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def current_rss() -> int:
    return _status("VmRSS")


def reset_peak_rss() -> int:
    """Reset this process's peak resident set (Linux >= 4.0) and return the current one, in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return current_rss()


def peak_rss() -> int:
    return _status("VmHWM")


# ------------------------------------------------------------------------------ one world
def timed_world(build, steps: int, warmup: int = 1):
    """Run inside a rank: `build()` -> (step_fn, extras_fn); `warmup` + `steps` calls of step_fn,
    each timed on the slowest rank. Returns the rank's measurements (extras_fn() merged in)."""
    torch.set_num_threads(1)
    world = dist.group.WORLD
    base = reset_peak_rss()
    step, extras = build()
    flag = torch.zeros(1)
    times, cpus = [], []
    for i in range(warmup + steps):
        dist.all_reduce(flag, group=world)             # a barrier: every rank starts together
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=world)
        if i >= warmup:
            times.append(dt[0].item())
            cpus.append(dt[1].item())
    # cpu_s: the busiest rank's process time (compute + gloo threads): less disturbed by other jobs
    out = dict(step_s=statistics.median(times), cpu_s=statistics.median(cpus), peak_rss=peak_rss() - base)
    out.update(extras() if extras else {})
    return out


def run_variant(fn, ranks: int, *args, timeout: float = 900):
    """A fresh world of `ranks` forked processes runs fn(*args) (which calls timed_world); returns
    rank 0's result with the peak RSS the largest over ranks."""
    results = run_world(fn, ranks, *args, timeout=timeout)
    out = dict(results[0])
    out["peak_rss"] = max(r["peak_rss"] for r in results)
    return out


def spread(values):
    """(median, min, max) of a list of numbers."""
    return statistics.median(values), min(values), max(values)


def local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


class Measurement:
    """One benchmark's run as its results file states it: the command, this machine, and the load
    average read before the work and after it (a results file from a loaded machine is refused)."""

    def __init__(self, script: str, argv=None):
        self.command = f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
        self.command = self.command.strip()
        self.load, self.cores, self.load_end = os.getloadavg()[0], os.cpu_count() or 1, None

    def done(self) -> None:
        self.load_end = os.getloadavg()[0]

    def machine(self) -> str:
        """The sentence every results file ends its header with."""
        return (f"torch {torch.__version__}, {self.cores} cores ({platform.machine()}), load average "
                f"{self.load:.1f} at the start and {self.load_end:.1f} at the end.")

    def save(self, out: str, md: str, quick: bool, **fields) -> int:
        """Print the table, then save_results it with the record: the command, the loads, the
        machine and `fields` (the rows)."""
        print("\n" + md)
        record = dict(command=self.command, load_start=self.load, load_end=self.load_end, cores=self.cores,
                      torch=torch.__version__, **fields)
        return save_results(out, md, record, self.load, self.cores, quick)


def save_results(out: str, md: str, record: dict, load: float, cores: int, quick: bool) -> int:
    """Write the markdown table and the JSON record beside it (two files named after out), or refuse
    when the load average at the start exceeded the cores (timings from a busy machine are noise; a
    quick run is a smoke test and is written anywhere). 0: saved, 1: refused."""
    if load > cores and not quick:
        print(f"not saved: the load average at the start ({load:.1f}) exceeds the {cores} cores; "
              f"rerun on a quiet machine")
        return 1
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".md", "w") as f:
        f.write(md)
    with open(out + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print(f"saved {out}.md and {out}.json")
    return 0
