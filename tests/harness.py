"""Run a function on N gloo ranks forked from the test process.

    results = run_world(fn, 4, arg1, arg2, timeout=60)   # fn(*args) runs on each rank
    results[rank] is what fn returned on that rank (anything torch.save can write)

Forking is fast (16 ranks start in about 2 s, where torchrun or spawn re-import torch for 10-20 s)
and needs no pickling of `fn`. Each rank: one torch thread, a gloo default group over a FileStore
in a fresh temporary directory (no ports to collide), then `fn`. A rank that raises fails the
world with that rank's traceback (`RankError`); a world still running at `timeout` is killed and
raises `WorldTimeout` naming the ranks that had not finished, so a deadlock fails a test instead
of hanging the suite. Ranks leave with os._exit so that the forked copy of pytest never runs its
own exit handlers.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import traceback

import torch

# Imported once here, before any fork, so that the ranks inherit them instead of each paying for them
# (importing starts no thread and runs no torch op):
# - torch._dynamo: torch.optim's constructors and steps import it, and with it torch.distributed.tensor
#   and .fsdp, about 1 s of CPU in every rank that builds an optimizer (16 ranks on 2 cores: 8 s of a
#   4d.yaml test);
import torch._dynamo  # noqa: F401
import torch.distributed as dist

# - torch.fx's symbolic shapes (and with it sympy: 1-2 s): torch.autograd.backward(outputs,
#   grad_tensors) imports it on its first call, which every pipeline stage but the last makes.
# (matplotlib's pyplot, for the Trainer's loss-curve PNG, is tests/conftest.py's: a benchmark program
# that imports this file for run_world need not pay for it)
import torch.fx.experimental.symbolic_shapes  # noqa: F401


def _pytest_timeout() -> float:
    import configparser
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "setup.cfg"))
    return cfg.getfloat("tool:pytest", "timeout", fallback=float("inf"))


# pytest-timeout (setup.cfg) kills the whole test with a stack dump; a world must time out well
# before it, so that WorldTimeout can name the stuck ranks: at most half of pytest's limit
MAX_WORLD_TIMEOUT = _pytest_timeout() / 2


class RankError(RuntimeError):
    pass


class WorldTimeout(TimeoutError):
    pass


def _worker(fn, rank, world_size, tmp, args, kwargs, timeout, init):
    code = 1
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        os.environ.pop("MASTER_ADDR", None)   # minipar.init must find the group already set up
        if dist.is_initialized():              # a group inherited from the test process: not ours
            dist.destroy_process_group()
        if init:
            store = dist.FileStore(os.path.join(tmp, "store"), world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout))
            # gloo finishes connecting the full mesh in the background: without this barrier a
            # rank whose fn fails at once could exit while a peer is still connecting to it
            dist.barrier()
        result = fn(*args, **kwargs)
        torch.save(result, os.path.join(tmp, f"result{rank}.pt"))
        code = 0
    except BaseException:
        with open(os.path.join(tmp, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        os._exit(code)


def run_world(fn, world_size: int, *args, timeout: float = 120, init: bool = True, **kwargs):
    """init=False forks the ranks without creating the default group (to test what happens then)."""
    if timeout > MAX_WORLD_TIMEOUT:
        raise ValueError(f"timeout={timeout} s: a world must time out before pytest-timeout does "
                         f"(at most {MAX_WORLD_TIMEOUT:.0f} s, half of setup.cfg's timeout)")
    tmp = tempfile.mkdtemp(prefix="minipar-world-")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, tmp, args, kwargs, timeout, init),
                         daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.exitcode for p in procs]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # the first rank that raised is the interesting one; others may just be stuck
                time.sleep(0.2)
                msgs = []
                for r in failed:
                    path = os.path.join(tmp, f"error{r}.txt")
                    text = open(path).read() if os.path.exists(path) else f"exit code {codes[r]} (killed?)"
                    msgs.append(f"--- rank {r} of {world_size} ---\n{text}")
                raise RankError(f"{len(failed)} of {world_size} ranks failed:\n" + "\n".join(msgs[:2]))
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                raise WorldTimeout(f"world of {world_size} ranks timed out after {timeout:.0f} s; "
                                   f"ranks still running (deadlock?): {running}")
            time.sleep(0.01)
        return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
