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

    done = run_program("train.py", argv, cwd=ROOT)      # `python train.py *argv`, forked the same way
    done.returncode, done.stdout, done.stderr

runs a program's __main__ block in a forked child instead of a fresh interpreter (no 2 s of imports).
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


class Finished:
    """What run_program returns: subprocess.CompletedProcess's three fields."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _python_warnings():
    """A fresh interpreter's warning filters and display (pytest records warnings in its own list and
    shows DeprecationWarnings always): a program's warnings reach its stderr as they would alone."""
    import sys
    import warnings
    warnings.resetwarnings()
    for category, module in ((DeprecationWarning, "__main__"),):
        warnings.filterwarnings("default", category=category, module=module, append=True)
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.filterwarnings("ignore", category=category, append=True)

    def show(message, category, filename, lineno, file=None, line=None):
        # set on showwarning itself (the public hook), which warnings calls in place of the display
        # pytest's recorder has installed
        (file or sys.stderr).write(warnings.formatwarning(message, category, filename, lineno, line))
    warnings.showwarning = show


def run_program(program: str, argv, *, module: bool = False, cwd=None, env=None, timeout: float = 120):
    """`python program *argv` (or `python -m program` with module=True) in a child forked from this
    process: the program's own __main__ block runs (its exit status, its stdout and stderr, its atexit
    handlers and non-daemon threads at the end), but the imports the test process already holds are
    not paid again (about 2 s of torch per fresh interpreter). For a test of what a program does; a
    test of the command line itself (the interpreter, the launcher) keeps a real subprocess."""
    import atexit
    import runpy
    import sys
    import threading
    tmp = tempfile.mkdtemp(prefix="minipar-program-")
    out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            out_f, err_f = open(out_path, "w"), open(err_path, "w")
            os.dup2(out_f.fileno(), 1)
            os.dup2(err_f.fileno(), 2)
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            sys.stdin = open(os.devnull)
            atexit._clear()                       # the test process's handlers are not the program's
            _python_warnings()
            torch.set_num_threads(1)
            if dist.is_initialized():             # a group inherited from the test process: not ours
                dist.destroy_process_group()
            if env is not None:
                os.environ.clear()
                os.environ.update(env)
            if cwd is not None:
                os.chdir(cwd)
            sys.argv = [program, *argv]
            try:
                if module:                        # as `python -m` finds it: not yet imported
                    sys.modules.pop(program + ".__main__", None)
                    sys.modules.pop(program, None)
                    runpy.run_module(program, run_name="__main__", alter_sys=True)
                else:
                    sys.path.insert(0, os.path.dirname(os.path.abspath(program)))
                    runpy.run_path(program, run_name="__main__")
                code = 0
            except SystemExit as e:               # as the interpreter reads sys.exit's argument
                if e.code is None:
                    code = 0
                elif isinstance(e.code, int):
                    code = e.code
                else:
                    print(e.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
            for t in threading.enumerate():       # the interpreter waits for non-daemon threads
                if t is not threading.current_thread() and not t.daemon:
                    t.join()
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    try:
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise WorldTimeout(f"{program} {' '.join(map(str, argv))} still running after "
                                   f"{timeout:.0f} s")
            time.sleep(0.01)
        code = os.waitstatus_to_exitcode(status)
        return Finished(code, open(out_path).read(), open(err_path).read())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
