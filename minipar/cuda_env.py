"""The environment a GPU run needs, settled before CUDA and NCCL start (minipar.init calls
prepare() first; a CPU run, or a gloo one, is left exactly as it was).

    LOCAL_RANK -> device    torchrun numbers the processes of a node 0..n-1; each takes the CUDA
                            device of that index among those it can see. A process that sees one
                            device only because CUDA_VISIBLE_DEVICES gives each process its own
                            (a scheduler's binding) takes that one, device 0. Anything else is two
                            processes on one GPU, which NCCL refuses later with far less to go on:
                            refused here, saying how many devices the process sees.
    CUDA_DEVICE_MAX_CONNECTIONS=1   with tp_async_overlap on (tensor_parallel/async_linear.py).
                            The device takes work from several hardware queues (8 by default); with
                            one, kernels start in the order the host issued them, so the all-gather
                            issued before a matmul is running when the matmul starts and overlaps it,
                            instead of waiting behind it. The driver reads the variable when the
                            CUDA context is created, so it is set here if CUDA has not started, as
                            Megatron-LM requires of its overlapped tensor parallelism; a process whose
                            CUDA already started without it, or that set another value, is refused
                            with the line to add to the launch.
    TORCH_NCCL_AVOID_RECORD_STREAMS=1   on torch before 2.8. Older ProcessGroupNCCL marks every
                            tensor of an async collective with record_stream, so the caching
                            allocator will not hand its memory out again until the communication
                            stream has caught up with the moment of the free (checked at later
                            allocations); a freed ZeRO-3 unit then stays reserved a while, and the
                            planner's "root + 1 + prefetch units" gathered at once become more.
                            With the variable, the process group keeps a reference to the tensors
                            until wait() instead, and a freed unit is reusable at once. torch 2.8
                            does this by default and calls the variable deprecated, so it is left
                            unset there. A value the launch set is kept.

prepare() returns the notes of what it set (minipar.init prints them on rank 0); the functions
below take the environment and the facts about CUDA as arguments, so the rules are tested without a
GPU. One thing starts CUDA before minipar.init on a train.py run: `bf16: auto` asks the device
whether it has bfloat16 (trainer/config/keys.py), so it calls settle() first.
"""
from __future__ import annotations

import os
from typing import List, MutableMapping, Optional

MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
AVOID_RECORD_STREAMS = "TORCH_NCCL_AVOID_RECORD_STREAMS"
STASHES_BY_DEFAULT = (2, 8)          # the first torch whose ProcessGroupNCCL avoids record_stream itself


def device_index(environ: MutableMapping[str, str], visible: int) -> int:
    """The index, among the `visible` CUDA devices, of this process's device (see above)."""
    local = int(environ.get("LOCAL_RANK", 0))
    if local < visible:
        return local
    bound = environ.get("CUDA_VISIBLE_DEVICES") is not None
    if visible == 1 and bound:
        return 0                     # each process was given its own device
    shown = f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}" if bound else "all of the node's"
    raise ValueError(f"LOCAL_RANK={local}, but this process sees {visible} CUDA device(s) ({shown}): "
                     f"launch at most {visible} process(es) per node (torchrun --nproc-per-node "
                     f"{visible}), or give each process its own device with CUDA_VISIBLE_DEVICES")


def _version(text: str) -> tuple:
    parts = []
    for p in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def settle(environ: MutableMapping[str, str], *, tp_async_overlap: bool, cuda_started: bool,
           torch_version: str) -> List[str]:
    """Set what a NCCL run on CUDA needs in `environ` (see above); returns notes of what was set.
    Raises a ValueError naming the line to add when it is too late to set it."""
    notes = []
    if tp_async_overlap and environ.get(MAX_CONNECTIONS) != "1":
        have = environ.get(MAX_CONNECTIONS)
        if have is not None or cuda_started:
            why = f"it is {have!r}" if have is not None else "CUDA started before minipar.init could set it"
            raise ValueError(f"tp_async_overlap needs {MAX_CONNECTIONS}=1 before CUDA starts ({why}), so "
                             f"that each all-gather runs beside the matmul issued after it: add "
                             f"`export {MAX_CONNECTIONS}=1` to the launch, or set tp_async_overlap false")
        environ[MAX_CONNECTIONS] = "1"
        notes.append(f"{MAX_CONNECTIONS}=1 set for tp_async_overlap (kernels start in issue order)")
    if AVOID_RECORD_STREAMS not in environ and _version(torch_version) < STASHES_BY_DEFAULT:
        environ[AVOID_RECORD_STREAMS] = "1"
        notes.append(f"{AVOID_RECORD_STREAMS}=1 set (torch {torch_version}): a freed ZeRO-3 unit's memory "
                     f"is reusable at once")
    return notes


def prepare(tp_async_overlap: bool, environ: Optional[MutableMapping[str, str]] = None) -> List[str]:
    """For a NCCL run on CUDA, before the process group and the device are set: settle() on this
    process's environment and check its device (device_index). Nothing without CUDA."""
    import torch
    if not torch.cuda.is_available():
        return []
    environ = os.environ if environ is None else environ
    notes = settle(environ, tp_async_overlap=tp_async_overlap, cuda_started=torch.cuda.is_initialized(),
                   torch_version=torch.__version__)
    device_index(environ, torch.cuda.device_count())
    return notes
