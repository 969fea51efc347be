"""A world of ranks as threads of one process, exchanging through memory: several ranks on ONE GPU.

Why: a lent GPU comes one at a time, and NCCL refuses two ranks on one device, so a multi-rank
technique (ZeRO-3's gather/free/reduce-scatter, ring attention's K/V hops) cannot run there as
processes. As threads it can: every thread is a rank with its own default process group, all of
them on the same device, and what would cross a link is copied from one thread's tensor into
another's. The kernels, the CUDA streams and events, the autograd functions and the bookkeeping of
the technique run exactly as in a real run; only the transport is memory instead of NCCL (the
NCCL transport itself is what `benchmarks/device_p2p.py` checks, where NCCL can be made to run).

    run_threads(fn, n, *args)  ->  [fn(rank 0, *args), ..., fn(rank n-1, *args)]

How: torch's own threaded process group (torch.testing._internal.distributed.multi_threaded_pg,
which its unit tests use for DTensor) gives the collectives: all_reduce, all_gather(_single),
reduce_scatter(_single), all_to_all, broadcast, barrier; each is joined by every thread and
executed once on their tensors. It has no point-to-point, which ring attention and the pipeline
need, so `MemoryGroup` adds send and recv: a send copies its tensor into the (src, dst) mailbox
at once (a queue: messages between one pair arrive in order, as NCCL's), a receive's wait takes
the next message from the mailbox and copies it into the receive buffer. A wait that finds no
message within `timeout` seconds raises instead of hanging.

Cost: each message is one device-to-device copy on the sender and one on the receiver; the
collectives copy the same way. Nothing here is fast; it is there to be right.
"""
from __future__ import annotations

import queue
import threading
import traceback
from typing import Callable, List

import torch
import torch.distributed as dist

_BACKEND = "minipar_threads"


def _threaded_pg():
    """torch's testing module, imported on first use: it is internal API (present from torch 2.0)."""
    from torch.testing._internal.distributed import multi_threaded_pg
    return multi_threaded_pg


class _Received(dist.Work):
    """A receive's work: wait() takes the pair's next message and copies it into the buffers."""

    def __init__(self, box: "queue.Queue", tensors: List[torch.Tensor], timeout: float):
        super().__init__()
        self.box, self.tensors, self.timeout, self.done = box, tensors, timeout, False

    def wait(self, timeout=None):
        if not self.done:
            try:
                message = self.box.get(timeout=self.timeout)
            except queue.Empty:
                raise TimeoutError(f"thread world: no message arrived within {self.timeout} s") from None
            for t, m in zip(self.tensors, message):
                t.copy_(m)
            self.done = True
        return True

    def is_completed(self):
        return self.done


def _memory_group_class():
    mt = _threaded_pg()

    class MemoryGroup(mt.ProcessLocalGroup):
        """torch's threaded group plus send/recv through per-pair mailboxes (see the module)."""
        mailboxes: dict = {}
        lock = threading.Lock()
        timeout = 120.0
        generation = 0                      # one per run_threads: a world's mailboxes are its own

        @classmethod
        def box(cls, key):
            with cls.lock:
                return cls.mailboxes.setdefault(key, queue.Queue())

        def _key(self, src: int, dst: int):
            # the group's name is the same on every thread (groups are created in one order)
            return (MemoryGroup.generation, self.pg_name, src, dst)

        def send(self, tensors, dst, tag=0):
            self.box(self._key(self._rank, dst)).put([t.detach().clone() for t in tensors])
            fut = torch.futures.Future()
            fut.set_result(tensors)
            return mt._create_work_from_future(fut)

        def recv(self, tensors, src, tag=0):
            return _Received(self.box(self._key(src, self._rank)), tensors, self.timeout)

    return MemoryGroup


def install() -> None:
    """Register the backend and give each thread its own world (once per process; not undone:
    run a thread world in a process of its own, as the device check's steps do). Returns the
    group class."""
    if getattr(install, "group", None) is not None:
        return install.group
    group = _memory_group_class()
    dist.Backend.register_backend(_BACKEND, lambda store, rank, size, timeout: group(rank, size),
                                  devices=["cpu", "cuda"])
    set_isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    if set_isolation is not None:           # each thread's groups registered under its own names
        set_isolation(True)
    _threaded_pg()._install_threaded_pg()
    install.group = group
    return group


def run_threads(fn: Callable, world_size: int, *args, timeout: float = 300, **kwargs) -> list:
    """fn(*args, **kwargs) on `world_size` threads, each rank of a thread world (its default group
    initialised; minipar.init(config) then builds the grid on it as on a real world). Returns the
    ranks' results in rank order; re-raises the first rank's error, naming the rank."""
    group = install()
    group.generation += 1
    store = dist.HashStore()
    results, errors = [None] * world_size, {}

    def rank_main(rank: int):
        try:
            dist.init_process_group(_BACKEND, rank=rank, world_size=world_size, store=store)
            results[rank] = fn(*args, **kwargs)
        except BaseException as err:        # noqa: BLE001 - reported below with its rank
            errors[rank] = (err, traceback.format_exc())
            _threaded_pg().ProcessLocalGroup.exception_handle(err)   # wake the others' collectives
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise TimeoutError(f"thread world: ranks {stuck} still running after {timeout} s")
    if errors:
        rank = min(errors)
        raise RuntimeError(f"thread world: rank {rank} failed:\n{errors[rank][1]}") from errors[rank][0]
    return results
