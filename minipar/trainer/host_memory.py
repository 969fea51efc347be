"""Host memory on a CPU run: give freed tensors back to the operating system, so that the resident
memory of a rank is what it holds, not the most it ever held.

On the CPU, torch allocates a tensor with the C library's malloc. glibc serves a request of at least
M_MMAP_THRESHOLD bytes (128 KiB at start) with its own mmap, which free() hands back to the kernel at
once; smaller requests come from the heap, which only shrinks from its top. But glibc raises that
threshold, up to 32 MiB, each time such a mapped block is freed ("dynamic mmap threshold": to spare
programs that allocate and free one large buffer in a loop). After the first training step nearly
every activation, gathered ZeRO-3 unit and gradient of a small model is under 32 MiB, so all of them
come from the heap, and a heap freed in the middle stays resident: the backward frees activations
while it allocates gradients elsewhere in the heap, the optimizer's temporaries land after them,
and the peak resident memory becomes the sum of what was live at different moments.

Measured on the SmolLM-135M shape of benchmarks/bench_memory.py (fp32, dp_shard 4, 1 x 256 tokens
per rank): the peak resident memory per rank grew by 41 to 56 MiB per decoder layer, where the
tensors alive at once grow by 22 (the parameter and AdamW shards, one micro-batch's activations).
Fixing the threshold at 128 KiB (mallopt(M_MMAP_THRESHOLD), which also turns the dynamic rule off)
keeps every tensor of 128 KiB or more in its own mapping, returned when freed; the growth falls to
what the tensors need (19 to 22 MiB per layer from 15 layers on). The cost is a page fault per
4 KiB page of each new large tensor (the kernel hands out zeroed pages, and every step maps and
unmaps them again), and it is not small: the default one-process run (train.py, 40 steps, 2 cores)
went from 11,070 to 6,787 tokens/s with it. So it is opt-in: MINIPAR_RETURN_FREED_MEMORY=1 in the
environment turns it on for a CPU run, when resident memory is the limit or is what is measured
(benchmarks/bench_memory.py compares both, and the planner's per-layer memory is held to runs with
it on).

Cheaper middle grounds, measured on the same shape (peak growth per layer from 1 to 8 layers, where
the tensors grow by 13.5 MiB; before ZeRO-3 freed a tied root early, which moved these peaks):
glibc's default 75 MiB; malloc_trim(0) after every step 49 (it gives back only what is free between
steps; the heap's holes in the middle of a step stay); a fixed threshold of 4 MiB 28, of 1 MiB 25,
1 MiB with the trim 25 (a layer's activations, 0.2 to 1.5 MiB each, still share the heap with
gradients freed at other times); 128 KiB 13.7. None but the last gets within 20 % of the tensors,
so none replaces it and the default stays glibc's.

A GPU run is not affected (torch's CUDA caching allocator serves its tensors; the summary
reports its max_memory_allocated, what the planner predicts, and max_memory_reserved). Another
allocator preloaded (jemalloc, tcmalloc via LD_PRELOAD) ignores the setting; a C library without
mallopt (musl, macOS) is left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3          # glibc's malloc.h
THRESHOLD_BYTES = 128 * 1024   # glibc's own starting value, now fixed


def asked() -> bool:
    """Whether this process was asked to return freed memory (MINIPAR_RETURN_FREED_MEMORY=1)."""
    return os.environ.get("MINIPAR_RETURN_FREED_MEMORY") == "1"


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold for this process (see the module docstring); whether it took."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES))
    except (OSError, AttributeError, TypeError):   # no C library by that name, or no mallopt in it
        return False
