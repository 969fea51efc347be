"""One run per output_dir, and an output_dir that can be written, both checked before step 1.

Two runs writing into one output_dir destroy each other: one's checkpoint rotation deletes the
other's step-N, both append to metrics.jsonl, the last export wins. And a run whose output_dir
cannot be written (a path under a regular file, a read-only file system) would train every step
and die at the final save. Both are checked in run_setup, after the config and before
minipar.init creates any group, so a refusal is a clear ValueError on every rank (exit 2):

    every rank   check_writable: create output_dir and the metrics file's directory, write and
                 delete a probe file named after this host and pid (cheap, and each rank checks
                 the file system it will write from)
    every rank   read output_dir/minipar.lock, if there is one:
                   held by a live process of another launch        -> refuse, naming pid, host, start
                   held by a dead process on this host             -> fine (rank 0 takes it over)
                   written by this launch's rank 0 a moment ago    -> fine ("this launch": the same
                                                                      MASTER_ADDR:MASTER_PORT and
                                                                      torchrun run id on every rank)
    rank 0       under filelock's flock of output_dir/minipar.lock.guard (held only while the
                 record is read and written): refuse a live holder, take over a dead one with a
                 note, write this process's record (renamed into place: whole or not at all)
    rank 0       release it when the run ends (Trainer.train's finally), and on every other way
                 out of the process (atexit, in the process that took it, not in a forked child);
                 only a run killed outright (SIGKILL) leaves it behind, and the next run takes it
                 over as above

The record, not a flock held for the whole run, is the lock: it names the holder for the refusal,
and a flock does not reach another host on every network file system; a dead pid is its staleness.
filelock only serialises two rank 0s starting at the same moment: one takes it, the other reads the
winner's record and refuses (its launch's other ranks fail in minipar.init once it has exited). A
lock on another host cannot be checked for liveness: it is refused, and the message says to delete
the file if that run is gone.

A process is alive when its pid exists, is not a zombie, and (on Linux) started at the time the
lock records, so a recycled pid does not hold a dead run's lock forever.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import time
from contextlib import contextmanager, suppress
from typing import List, Optional

from filelock import FileLock, Timeout

LOCK_NAME = "minipar.lock"
GUARD_WAIT_S = 30      # the guarded read-and-write takes milliseconds; longer is a stuck file system


def host() -> str:
    return socket.gethostname()


def _start_ticks(pid: int) -> Optional[int]:
    """The start time of a process in clock ticks since boot (Linux), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int, on_host: Optional[str] = None, start_ticks: Optional[int] = None) -> bool:
    """Whether `pid` on `on_host` still runs. Another host's process counts as alive (we cannot look)."""
    if on_host is not None and on_host != host():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:                 # another user's process: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False                # exited, not yet reaped by its parent
    except (OSError, IndexError):
        pass
    if start_ticks is not None:
        now = _start_ticks(int(pid))
        if now is not None and now != start_ticks:
            return False                    # the pid was recycled by an unrelated process
    return True


def launch_id() -> str:
    """A string that every rank of one launch computes alike, without communicating."""
    env = os.environ
    if env.get("MASTER_ADDR"):
        return f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}/{env.get('TORCHELASTIC_RUN_ID', '')}"
    return f"{host()}/ppid-{os.getppid()}"   # forked ranks (tests), one-process runs


def _owner() -> dict:
    return dict(pid=os.getpid(), host=host(), start_ticks=_start_ticks(os.getpid()), launch=launch_id(),
                started=time.strftime("%Y-%m-%d %H:%M:%S %Z"))


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            info = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"the lock file {path} cannot be read ({e}); if no run is using this output_dir, "
                         f"delete it") from None
    if not isinstance(info, dict) or "pid" not in info or "host" not in info:
        raise ValueError(f"the lock file {path} is not a minipar lock; if no run is using this output_dir, "
                         f"delete it")
    return info


def _alive(info: dict) -> bool:
    return process_alive(info["pid"], info["host"], info.get("start_ticks"))


def _refuse(path: str, output_dir: str, info: dict) -> ValueError:
    where = "" if info["host"] == host() else " (on another host: its liveness cannot be checked from here)"
    return ValueError(f"output_dir {output_dir} is in use by another run: "
                      f"pid {info['pid']} on {info['host']}, "
                      f"started {info.get('started', '?')}{where}. Use another output_dir, wait for that run "
                      f"to end, or delete {path} if it is gone")


class RunLock:
    """What acquire() returns on every rank; only rank 0's holds the file."""

    def __init__(self, path: str, owner: Optional[dict]):
        self.path, self.owner = path, owner
        if owner is not None:               # whatever error ends the process, the lock goes with it
            atexit.register(self._release_at_exit)

    def _release_at_exit(self) -> None:
        # a forked child inherits the handler and the owner record: only the holder itself releases
        if self.owner is not None and self.owner["pid"] == os.getpid():
            self.release()

    @property
    def held(self) -> bool:
        return self.owner is not None

    def release(self) -> None:
        """Remove the lock if it is still ours. Safe to call twice, and on every rank."""
        if self.owner is None:
            return
        with suppress(ValueError, FileNotFoundError):     # unreadable or gone: not ours to remove
            info = _read(self.path)
            if info and (info["pid"], info["host"]) == (self.owner["pid"], self.owner["host"]):
                os.remove(self.path)
        self.owner = None


@contextmanager
def _guard(path: str):
    """filelock's flock on <path>.guard around a read-decide-write of the record. The guard file is
    removed before the flock is let go; filelock reopens the path when it finds that the file it
    locked was unlinked meanwhile, so a waiter never holds a removed guard."""
    guard = f"{path}.guard"
    lock = FileLock(guard, timeout=GUARD_WAIT_S)
    try:
        lock.acquire()
    except Timeout:
        raise ValueError(f"could not take {guard} within {GUARD_WAIT_S} s: is another run starting into "
                         f"{os.path.dirname(path)}? If none is, delete {guard}") from None
    try:
        yield
    finally:
        with suppress(FileNotFoundError):
            os.remove(guard)
        lock.release()


def _write(path: str, record: dict) -> None:
    """The record, whole or not at all: written to a temporary file, then renamed into place."""
    tmp = f"{path}.{record['host']}-{record['pid']}"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def acquire(output_dir: str, rank: int, notes: Optional[List[str]] = None) -> RunLock:
    """Refuse (ValueError) when a live run holds output_dir; rank 0 takes the lock. No communication."""
    notes = [] if notes is None else notes
    path = os.path.join(output_dir, LOCK_NAME)
    if rank != 0:
        info = _read(path)
        if info is not None and info.get("launch") != launch_id() and _alive(info):
            raise _refuse(path, output_dir, info)
        return RunLock(path, None)
    me = _owner()
    os.makedirs(output_dir, exist_ok=True)
    with _guard(path):
        info = _read(path)
        if info is not None and (info["pid"], info["host"]) != (me["pid"], me["host"]):   # not ours already
            if _alive(info):
                raise _refuse(path, output_dir, info)
            notes.append(f"took over {path} from pid {info['pid']} on {info['host']} (started "
                         f"{info.get('started', '?')}), which is no longer running")
        _write(path, me)
    return RunLock(path, me)


def check_writable(output_dir: str, metrics_path: str) -> None:
    """Create output_dir and the metrics file's directory and write a probe file into each;
    a ValueError of one line naming the path and the reason otherwise. Every rank calls it."""
    probe_name = f".minipar-write-probe-{host()}-{os.getpid()}"
    for key, directory in (("output_dir", output_dir),
                           ("metrics_file", os.path.dirname(metrics_path) or ".")):
        try:
            os.makedirs(directory, exist_ok=True)
            probe = os.path.join(directory, probe_name)
            with open(probe, "w") as f:
                f.write("minipar write probe\n")
            os.remove(probe)
        except OSError as e:
            raise ValueError(f"{key} {directory!r} cannot be written: {_reason(directory, e)}; "
                             f"choose another "
                             f"{key}") from None
    if os.path.isdir(metrics_path):
        raise ValueError(f"metrics_file {metrics_path!r} is a directory; choose a file path")
    if os.path.exists(metrics_path) and not os.access(metrics_path, os.W_OK):
        raise ValueError(f"metrics_file {metrics_path!r} cannot be written (no write permission); choose "
                         f"another metrics_file")


def _reason(directory: str, err: OSError) -> str:
    path = os.path.abspath(directory)
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path} is a regular file, not a directory"
    return err.strerror or str(err)
