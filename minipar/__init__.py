"""minipar: a minimal, readable 5D-parallel trainer for Llama-style models (pipeline, replicated
and sharded data, context and tensor parallelism).

    import minipar
    pgm = minipar.init(minipar.ParallelismConfig(tp_size=2))   # under torchrun, or on one process
    pgm.tp.rank, pgm.dp_shard_cp.group, pgm.cp.next_rank, ...

Read minipar/compose.py first: the techniques applied in one order and one optimizer step under
every dimension; minipar/api.py (prepare) gives it to your own training loop.

The pieces: config.py (the five sizes), mesh.py (the grid and its groups), comm.py (the
collectives; comm_calls.py, how one runs and fails; comm_ledger.py, their ledger), config_files.py
and cli.py (bad files and flags, in one line); one subpackage per technique, data_parallel/,
zero3/, tensor_parallel/, context_parallel/, pipeline_parallel/; the trainer around them in trainer/
(its config/, data/ and checkpoint/ packages, then the run); the planner in plan/. models/llama.py
builds the reference decoder from them; docs/README.md gives the reading order, docs/design.md the
layers of imports.
"""
from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

# Before any group exists: this module binds `group=group.WORLD` as default arguments when first
# imported. Imported later (torch.optim pulls it in through torch._dynamo with the first
# optimizer), it would hold the default group, and its gloo threads, past destroy_process_group
# until interpreter shutdown, where a thread dropping a finished work's tensor aborts the process
# ("terminate called without an active exception"). See trainer/lifecycle.py.
import torch.distributed.nn.functional  # noqa: F401,E402

from . import cuda_env
from .config import ParallelismConfig

if TYPE_CHECKING:                  # the annotation only; see __getattr__ for why not imported here
    from .mesh import ProcessGroupManager

__all__ = ["ParallelismConfig", "ProcessGroupManager", "init", "default_device"]


def __getattr__(name):
    # minipar.mesh is imported on first use, not here: `python -m minipar.mesh` imports this
    # package first, and runpy warns when the module it is about to run is already imported
    if name == "ProcessGroupManager":
        from .mesh import ProcessGroupManager
        return ProcessGroupManager
    raise AttributeError(f"module 'minipar' has no attribute {name!r}")


def default_device() -> torch.device:
    """The device the backend communicates on: CUDA under NCCL. A gloo world keeps its tensors on
    the CPU even on a machine with GPUs (the tests fork gloo ranks), since gloo lacks several
    collectives for CUDA tensors."""
    gloo_world = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
    if torch.cuda.is_available() and not gloo_world:   # LOCAL_RANK among the devices this process sees
        return torch.device("cuda", cuda_env.device_index(os.environ, torch.cuda.device_count()))
    return torch.device("cpu")


def init(config: ParallelismConfig = None, timeout_s: float = 1800) -> "ProcessGroupManager":
    """Set up the default process group if needed and return this rank's ProcessGroupManager.

    Under torchrun the world comes from its environment (RANK, WORLD_SIZE, MASTER_ADDR, ...);
    without it, one process forms a world of one. NCCL when CUDA is there, gloo otherwise. The
    config is resolved (an unset dp_shard_size takes the remainder) and checked against the world
    size on every rank before any group is created, so a bad config raises instead of hanging.
    With CUDA, cuda_env.py first settles the environment NCCL and the kernels need (and refuses a
    process that would share a GPU).
    `timeout_s` (the trainer's `ddp_timeout`) bounds every collective, on the default group and on
    every group of the grid: a rank whose peer is stuck fails after it instead of waiting forever.
    """
    config = config if config is not None else ParallelismConfig.from_env()
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        config.resolve(world_size)          # fail before any rendezvous
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():      # the environment NCCL and the kernels need, then the device
            notes = cuda_env.prepare(config.resolve(world_size).tp_async_overlap)
            if int(os.environ.get("RANK", 0)) == 0:
                print("".join(f"minipar.init: {note}\n" for note in notes), end="", flush=True)
            torch.cuda.set_device(default_device())
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            if world_size != 1:
                raise ValueError(f"WORLD_SIZE={world_size} but no RANK/MASTER_ADDR: launch with torchrun")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    from .mesh import ProcessGroupManager
    return ProcessGroupManager(config, timeout=timeout)
