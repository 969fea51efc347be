"""How one collective call runs: named in a profiler trace, and named when it fails.

comm.py's collectives all go through `run` (and their async works through `NamedWork`), so that
every call is seen the same way from outside:

In a profiler trace (profile_steps) every call is a span named as the ledger names it,
"all_gather:dp_shard_cp", around its launch (the whole call when synchronous), and every wait on
an async one a span "wait:all_gather:dp_shard_cp": where a gather was issued and where the rank
waited for it show whether the prefetch hid it. (A ring hop that also carries packed document ids
is one span and two ledger records.) With no profiler recording, no span is made.

Failures are named. A collective whose peer is stuck (stopped, swapped out, deadlocked) waits for
the group's timeout (`ddp_timeout`, given to every group by mesh.py) and then fails; one whose peer
died fails at once. gloo's own messages say neither which collective nor which group ("Timed out
waiting 5000ms for recv operation to complete", "Connection closed by peer"), so every call, and
every wait() on an async one, re-raises such an error as a `CollectiveError` that names the
operation, the group and its ranks: "all_reduce over dp_cp (ranks [0, 2, 4, 6]) on rank 2 failed
...". (NCCL raises its timeouts from a watchdog thread instead, unless TORCH_NCCL_BLOCKING_WAIT=1.)
train.py catches it and ends the run with that one line.
"""
from __future__ import annotations

import contextlib

import torch


class CollectiveError(RuntimeError):
    """A collective that failed or timed out, with the operation, the group and its ranks."""


def describe(op: str, dim, err: BaseException) -> str:
    """One line: which collective over which group failed on which rank, and the likely why."""
    ranks = dim.ranks if len(dim.ranks) <= 16 else f"{dim.ranks[:8]}... ({len(dim.ranks)} ranks)"
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        why = "a peer did not take part within the timeout (ddp_timeout): it is stuck, stopped or far behind"
    elif "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
        why = "a peer's connection closed: that rank exited or crashed (its own error is the first one)"
    else:
        why = "see the error above"
    return f"{op} over {dim.name} (ranks {ranks}) failed on rank {dim.global_rank}: {why}. [{text}]"


@contextlib.contextmanager
def named(op: str, dim):
    """Re-raise a backend's error inside as a CollectiveError naming `op` over `dim`."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as err:     # gloo and NCCL raise RuntimeError (DistBackendError is one)
        raise CollectiveError(describe(op, dim, err)) from err


def span(name: str):
    """A torch.profiler span (record_function) while a profiler records, else nothing: every
    collective is one, named "op:group" as the ledger names it, so a trace (profile_steps,
    minipar/trainer/profiling.py) shows each call where it was issued (a prefetch during the
    previous layer) and, as "wait:op:group", where the rank blocked on an async one."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() \
        else contextlib.nullcontext()


class NamedWork:
    """An async work whose wait() names the collective when it fails. Holds the work only until
    it completes: a finished gloo work kept alive keeps its group's I/O thread alive with it."""

    def __init__(self, work, op: str, dim):
        self._work, self.op, self.dim = work, op, dim

    def wait(self, timeout=None):
        if self._work is None:
            return True
        work, self._work = self._work, None
        with named(self.op, self.dim), span(f"wait:{self.op}:{self.dim.name}"):
            return work.wait() if timeout is None else work.wait(timeout)

    def is_completed(self):
        return self._work is None or self._work.is_completed()


class Done:
    """What an async call on a size-1 group returns: already complete."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def run(op: str, dim, call, async_op: bool):
    """call() (it launches the collective) in its span, its failure named; an async work comes
    back as a NamedWork."""
    with named(op, dim), span(f"{op}:{dim.name}"):
        work = call()
    return NamedWork(work, op, dim) if async_op else work
