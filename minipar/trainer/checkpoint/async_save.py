"""Asynchronous checkpoints (`async_save: true`): training stalls for the host copy only.

A synchronous save stops every rank for the whole write: serialise, hash, fsync, rename, rotate.
For a large model that is minutes per save (torchtitan's users measured 394 s on Llama 3 8B
before its checkpoint.async_mode). The state a save needs is small next to the time to write
it, so the save is cut in two at the step boundary:

    main thread, at the step boundary       background thread, while training goes on
    ---------------------------------       -------------------------------------------------
    wait for the previous save (if any)
    copy what this rank writes to host      torch.save to bytes, write, fsync, sha256 each file
      memory: its shards and optimizer        (atomic.write_file), then atomic.atomic_save's
      states (pinned on CUDA, one            protocol: name broadcast, barrier, rank 0's manifest
      synchronize for all of them), RNG,     and rename step-N.tmp-<...> -> step-N, rotation,
      scheduler, extra, the manifest fields   barrier, over the CHECKPOINT GROUP below
    resume training

So the stall is the copy (save_load.prepare_save with to_host), and the guarantees are the
synchronous save's: the write is the same atomic.atomic_save, so a kill -9 during it leaves a
step-N.tmp-<...> that no reader counts and the previous step-N the newest that verifies;
rotation (save_total_limit) runs after the rename, so it counts only checkpoints that finished.

At most one save in flight: save() first joins the previous one, and when it had to wait says so
in one line (how long: the write is slower than save_steps steps). A failed write (a full disk)
is raised on the main thread as the CheckpointWriteError it was, on every rank at the same step:
at the next save, at a SIGTERM stop or at the end of the run (which all join the pending save),
or earlier, at the first step boundary after any rank saw it fail: failed() rides on the stop
flag's per-step all-reduce (train_loop.py), so all ranks learn it after the same step.

The collectives of a save, and why they have a group of their own. gloo and NCCL require every
rank to issue the collectives of one group in the same order. A background save's broadcast and
barriers, on the training groups, would interleave with the step's all-reduces in an order that
differs between ranks (each rank's thread reaches its barrier at its own moment): mismatched
collectives, wrong data or a deadlock. The two ways out: (a) finish each save on the main thread
at a later step boundary (the agreement then costs a collective every step, or the commit waits
for the next save, leaving the newest completed checkpoint one save_steps behind), or (b) a
process group of every rank used by checkpoints alone. We choose (b), as torchtitan's async mode
does: __init__ creates one gloo group over the world (a collective: every rank constructs the
AsyncCheckpointer at the same point, on the main thread, before training), its collectives move
a few bytes on the host (no CUDA stream is shared with training, also under NCCL), and since at
most one save is in flight, only one thread ever uses that group at a time, in the same order on
every rank. It costs gloo's connections and threads for one more group; close() joins the last
save and drops the group before the process groups are torn down (lifecycle.teardown).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from minipar.mesh import MeshDim
from minipar.trainer.checkpoint import atomic as cio
from minipar.trainer.checkpoint.layout import host_clone
from minipar.trainer.checkpoint.save_load import prepare_save


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """The rule of the snapshot: a CUDA tensor is copied into fresh pinned host memory without
    waiting (AsyncCheckpointer.save synchronises once, after every copy is queued; pinned memory
    is what lets the copy run asynchronously, by DMA); a CPU tensor is cloned."""
    if t.device.type != "cuda":
        return host_clone(t)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t.detach(), non_blocking=True)


class AsyncCheckpointer:
    """Saves in a background thread, one at a time, over a process group of its own (see above).
    Construct it on every rank at the same point (it creates a group); `log`: rank 0's logger."""

    def __init__(self, pgm, log: Callable[[str], None] = print, timeout=None):
        self.pgm, self.log = pgm, log
        ranks = list(range(pgm.world_size))
        group = (dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
                 if pgm.world_size > 1 else None)
        self.group = MeshDim("checkpoint", ranks, pgm.global_rank, group)
        self._pending: Optional[dict] = None     # the save in flight: thread, path, and its outcome
        self.last_copy_s = 0.0                   # the host copy of the last save (the stall it cannot avoid)

    def save(self, directory: str, model, optimizer, *, step: int, scheduler=None, extra=None,
             state_dict_type: str = "SHARDED_STATE_DICT", keep_last: Optional[int] = None) -> dict:
        """Wait for the previous save, copy this rank's state to the host, start writing `directory`
        in the background; returns {waited_s, copy_s}. Collective only over FULL_STATE_DICT's
        gathers (on the training groups, here on the main thread, like a synchronous save's)."""
        waited = self.wait("async_save: at most one save in flight")
        t0 = time.perf_counter()
        device = next(iter(model.parameters())).device
        write, manifest = prepare_save(directory, model, optimizer, self.pgm, step=step, scheduler=scheduler,
                                       extra=extra, state_dict_type=state_dict_type, to_host=host_copy)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()   # the pinned copies are done
        copy_s = self.last_copy_s = time.perf_counter() - t0
        box = dict(path=directory, error=None, started=time.perf_counter())
        box["thread"] = threading.Thread(target=self._write, args=(box, write, manifest, keep_last),
                                         name=f"minipar-save-step-{step}")
        self._pending = box
        box["thread"].start()
        return dict(waited_s=waited, copy_s=copy_s)

    def _write(self, box: dict, write, manifest, keep_last) -> None:
        try:
            cio.atomic_save(box["path"], self.pgm, "cpu", write, manifest, keep_last, over=self.group)
            self.log(f"saved checkpoint {box['path']} (written in the background in "
                     f"{time.perf_counter() - box['started']:.2f} s)")
        except BaseException as e:               # noqa: BLE001 - the main thread raises it (wait)
            box["error"] = e

    @property
    def pending(self) -> Optional[str]:
        """The directory being written, or None."""
        return self._pending["path"] if self._pending is not None else None

    def failed(self) -> bool:
        """Whether the save in flight has ended with an error on this rank (no waiting)."""
        box = self._pending
        return box is not None and not box["thread"].is_alive() and box["error"] is not None

    def wait(self, why: str = "a stop and the run's end wait for it") -> float:
        """Join the save in flight (if any) and raise its error here, on the main thread; returns
        the seconds waited for it (0.0 when it had finished) and says so when it was not done."""
        box, self._pending = self._pending, None
        if box is None:
            return 0.0
        t0, busy = time.perf_counter(), box["thread"].is_alive()
        box["thread"].join()
        waited = time.perf_counter() - t0
        if busy:
            self.log(f"waited {waited:.2f} s for the checkpoint {box['path']} to finish writing "
                     f"({why})")
        if box["error"] is not None:
            raise box["error"]
        return waited

    def close(self, raise_error: bool = True) -> None:
        """Join the last save, then let go of the group (before lifecycle.teardown destroys the
        groups). raise_error False: on a path that is already failing, its error is dropped."""
        try:
            self.wait()
        except BaseException:                    # noqa: BLE001
            if raise_error:
                raise
        finally:
            self.group.group = None
