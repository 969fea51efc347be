"""The life of a run across its ranks: agree at the start, stop together, end cleanly.

A multi-process job is only as healthy as its least healthy rank, and the failures that hurt are
the ones where ranks silently disagree: one waits in a collective the others never enter, and
the job hangs until someone notices. Three moments need the ranks to agree:

  start      every rank must run the same config. Two launchers of one job given different flags
             (--max_steps 10 on one node, 20 on the other) would train in lockstep until the
             shorter one stops and the longer one waits forever. Right after the groups exist,
             check_same_config all-gathers an 8-byte digest of each rank's resolved config (one
             tiny all-gather); only on a mismatch does it gather the configs themselves, to name
             the differing keys. Every rank sees the same gathered data, so every rank raises the
             same ValueError (train.py: exit 2).

  preemption a scheduler (SLURM, Kubernetes, torchrun forwarding its own SIGTERM) asks the job to
             stop and kills it after a grace period (torchrun: 30 s; SLURM: KillWait). The signal
             reaches the ranks at different moments, mid-step, so no rank may act on it alone.
             StopFlag's handler only records it (no collectives in a signal handler: it runs
             between two bytecodes of whatever the rank was doing); at the end of every step
             the ranks start an all-reduce of their flags with MAX (one 1-element all-reduce per
             step) and read the one started a step earlier, so all of them see "stop" after the
             same step, save it together and leave with EXIT_PREEMPTED. Reading a step late
             costs no wait (the sum is long done, and on a GPU already copied to the host), at
             the price of one more step before the save: a signal during step k saves step
             k + 1. `resume_from_checkpoint: latest` continues exactly there.

  the end    torch.distributed objects own C++ threads: each gloo group has two worker threads and
             an I/O thread, joined only when the group object is destroyed, that is when Python's
             last reference to it goes. destroy_process_group() forgets the groups but cannot
             free one that something else still references: the process-group manager (and the
             model through it) holds every sub-group, and torch.distributed.nn.functional, once
             imported after the default group exists (torch.optim does so with the first
             optimizer), holds the default group as default arguments. Such a group lives into
             interpreter shutdown. If one of its workers is still dropping the last reference to
             the final collective's work (a loaded machine deschedules it between finishing the
             op and letting go), it needs the GIL to free a tensor, the finalizing interpreter
             ends the thread instead, and unwinding through C++ aborts the process: "terminate
             called without an active exception" (SIGABRT) after a run that saved everything.
             A core file shows exactly that stack (ProcessGroupGloo::runLoop -> ~AsyncWork ->
             ~TensorImpl -> decref_pyobject -> take_gil -> PyThread_exit_thread -> terminate).
             The fix is the order of the end: minipar imports that module before any group
             exists, and teardown() meets at a barrier (no peer still mid-collective), destroys
             every group, drops our references and collects garbage, so each group's destructor
             joins its threads now (torch releases the GIL for it), while Python is whole.
"""
from __future__ import annotations

import gc
import hashlib
import json
import signal
import threading
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

import minipar
from minipar import comm
from minipar.mesh import MeshDim

# 128 + SIGTERM, what a shell reports for a process terminated by SIGTERM: "stopped early on
# request, checkpoint saved; relaunch with resume_from_checkpoint: latest", distinct from 0 (done),
# 1 (crashed) and 2 (bad config).
EXIT_PREEMPTED = 128 + signal.SIGTERM
# what a rank adds to the per-step stop flag when its background save failed (async_save): above
# every signal number, so the MAX says "a save failed" and every rank raises it after the same step
SAVE_FAILED = 1000


# ------------------------------------------------------------------------------ the same config
def flat_config(d: dict, prefix: str = "") -> Dict[str, object]:
    """{'model': {'hidden_size': 64}} -> {'model.hidden_size': 64}"""
    out: Dict[str, object] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flat_config(value, prefix + key + "."))
        else:
            out[prefix + key] = value
    return out


def config_digest(flat: Dict[str, object]) -> int:
    text = json.dumps(flat, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def differing_keys(configs: List[Dict[str, object]]) -> List[str]:
    keys = sorted(set().union(*configs))
    missing = object()
    return [k for k in keys if len({json.dumps(c.get(k, missing) if k in c else "<missing>", default=str)
                                    for c in configs}) > 1]


def check_same_config(cfg, pgm) -> None:
    """Raise the same ValueError on every rank unless all ranks resolved the same config."""
    if pgm.world_size == 1:
        return
    flat = flat_config(cfg.to_dict())
    mine = torch.tensor([config_digest(flat)], dtype=torch.int64, device=minipar.default_device())
    digests = comm.all_gather(mine, pgm.world).tolist()
    if len(set(digests)) == 1:
        return
    configs: List[Optional[dict]] = [None] * pgm.world_size
    dist.all_gather_object(configs, flat)          # only on a mismatch: the configs themselves
    keys = differing_keys(configs)
    parts = []
    for k in keys[:8]:
        values: Dict[str, List[int]] = {}
        for rank, c in enumerate(configs):
            values.setdefault(repr(c.get(k, "<missing>")), []).append(rank)
        parts.append(f"{k} (" + "; ".join(f"{v} on {_ranks(r)}" for v, r in values.items()) + ")")
    more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
    raise ValueError(f"the ranks of this job were started with different configs: {', '.join(parts)}{more}. "
                     f"Give every launcher (every node) the same config file and --key value flags")


def _ranks(ranks: List[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


# ------------------------------------------------------------------------------------ preemption
class Preempted(Exception):
    """The ranks stopped early on a signal, after saving `path` (step `step`)."""

    def __init__(self, step: int, path: str, signum: int):
        self.step, self.path, self.signum = step, path, signum
        super().__init__(f"stopped on {signal.Signals(signum).name} after step {step}; saved {path}. "
                         f"Continue "
                         f"with --resume_from_checkpoint latest")


class StopFlag:
    """SIGTERM (and SIGUSR1, what SLURM's --signal sends ahead of a time limit) set a flag; the
    ranks agree on it once per step. install() only from the main thread (Python's rule)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def _handler(self, signum, frame):
        self.signum = signum                      # nothing else: no I/O, no collectives

    def install(self) -> "StopFlag":
        if threading.current_thread() is not threading.main_thread():
            return self                           # (a trainer driven from a thread: no handler)
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    def agreed(self, pgm, device) -> int:
        """The signal number if any rank was signalled, else 0: the same answer on every rank.
        One all-reduce (MAX) of one int over the world; on one process no communication."""
        return self.agree_later(pgm, device)()

    def agree_later(self, pgm, device, save_failed: bool = False):
        """agreed() without waiting: the all-reduce runs in the background, and the returned function
        gives its answer, the signal number or 0, when it is called. The train loop calls it a step
        later (train_loop.py), so that no rank waits for the others at a step's end, and on a GPU
        the host does not wait for the device: the sum is copied, behind the all-reduce on the
        stream, into pinned host memory, and the answer waits only for that copy's event, a step
        old by then (a plain .item() would wait for everything queued since). save_failed: this
        rank's background save failed; the answer is then SAVE_FAILED on every rank."""
        pinned = torch.device(device).type == "cuda"               # a copy the host need not wait for
        flag = torch.tensor([SAVE_FAILED if save_failed else self.signum], dtype=torch.int64,
                            pin_memory=pinned).to(device, non_blocking=True)
        work = comm.all_reduce(flag, pgm.world, op="max", async_op=True)
        if flag.device.type == "cuda":
            work.wait()                           # NCCL: the stream waits, the host does not
            host = flag.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()

            def answer() -> int:
                done.synchronize()                # that copy only, finished a step ago
                return int(host[0])
            return answer

        def answer() -> int:                      # gloo: the sum is on the host once work is done
            work.wait()
            return int(flag.to("cpu", non_blocking=True)[0])
        return answer


# ------------------------------------------------------------------------------------- the end
def teardown(pgm=None, clean: bool = True) -> None:
    """Destroy every process group so that no torch.distributed thread outlives the interpreter.

    clean: every rank got here normally, so a barrier first (on an error path a peer may be dead
    or stuck: no barrier, just the local teardown). Safe to call twice, and with no world."""
    if dist.is_available() and dist.is_initialized():
        if clean and pgm is not None:
            comm.barrier(pgm.world)
        dist.destroy_process_group()               # every group, newest first, then the default
    if pgm is not None:
        for dim in vars(pgm).values():             # every MeshDim: dims, cp_ulysses, cp_ring, world
            if isinstance(dim, MeshDim):
                dim.group = None                   # the last references to the group objects
    gc.collect()                                   # and those held in reference cycles (a model's hooks)
