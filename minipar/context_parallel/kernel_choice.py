"""Which attention kernel runs, why, and when a failure may fall back: said once per run.

A run's attention goes through one of a few kernels, and a silent fallback from a flash kernel to
O(T^2) fp32 math costs memory and time that nobody sees in the loss. So the choice is a pure
function of the call's device, dtype and head_dim and of the `attention_backend` asked for
(`choose_kernel`, for tests and benchmarks/device_check.py), and every attention path reports the
kernel it used to an `AttentionLog`, which prints each new (path, kernel, reason) once.

    attention_backend   CUDA fp16/bf16        CUDA fp32          CPU
    auto                flash                 efficient          the CPU flash kernel
    flash               flash                 refused            the CPU flash kernel
    efficient           efficient             efficient          refused
    cudnn               cp 1 unpacked only (SDPA's cuDNN backend); refused elsewhere
    math                the reference math (block_attention.py), every device

(legacy names: impl "fused" = the auto kernel, refused if there is none; "torch" = math.) head_dim
must be a multiple of 8 and at most 256 for the CUDA kernels, else auto takes math and a forced
kernel is refused (ValueError, raised before any kernel runs).

Packed documents (documents.py) cut some blocks into per-document sub-blocks: on CUDA with the
flash kernel one varlen call takes them all (cumulative lengths); elsewhere the block's kernel runs
once per document.

Failures. A kernel that exists may still refuse a call (an old GPU, a shape it does not take).
`is_unsupported` tells those RuntimeErrors ("only supports", "not supported", ...) from real
failures: on CUDA only they fall back (auto), and anything else -- an illegal memory access, a
device-side assert, out of memory -- is raised, since a sticky CUDA error would poison every later
call anyway. On CPU auto falls back from any RuntimeError but out-of-memory, as before, and says so.
"""
from __future__ import annotations

import re
from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from ..config import ATTENTION_BACKENDS as BACKENDS

IMPLS = BACKENDS + ("fused", "torch")
CPU_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

_UNSUPPORTED = re.compile(r"only supports?|not supported|does not support|unsupported|no available kernel|"
                          r"not implemented|head dimension|head_dim|compute capability|sm8|sm9",
                          re.IGNORECASE)
_REAL_FAILURE = re.compile(r"CUDA error|illegal memory|device-side assert|out of memory|CUBLAS_STATUS|"
                           r"cuDNN error|unspecified launch failure|misaligned address", re.IGNORECASE)


class KernelChoice(NamedTuple):
    """kind: "cpu" (the CPU flash kernel), "cuda_flash", "cuda_efficient", "sdpa" (cp 1 unpacked:
    torch's SDPA, the backend forced when not auto) or "torch" (the reference math); reason: why."""
    kind: str
    reason: str


def _cuda_shape_ok(head_dim: int) -> bool:
    return head_dim % 8 == 0 and head_dim <= 256


def choose_kernel(backend: str, device, dtype: torch.dtype, head_dim: int,
                  path: str = "ring") -> KernelChoice:
    """The kernel attention blocks of this device, dtype and head_dim run, for `backend` (BACKENDS,
    or the legacy "fused" / "torch"). path "ring" covers ring attention, Ulysses, USP and packed
    documents at cp 1; path "sdpa" is plain causal attention at cp 1 (torch's SDPA). ValueError
    when a forced backend cannot run here."""
    if backend not in IMPLS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    dev = torch.device(device).type
    dtype_name = str(dtype).replace("torch.", "")
    where = f"{dev} {dtype_name} head_dim {head_dim}"
    if backend in ("math", "torch"):
        return KernelChoice("torch", f"attention_backend {backend}: the reference math")
    if path == "sdpa":
        if backend == "auto":
            return KernelChoice("sdpa", "cp 1, no packed documents: torch's SDPA picks its kernel")
        if dev != "cuda" and backend in ("cudnn", "efficient"):
            raise ValueError(f"attention_backend {backend} needs CUDA; this run attends on {where}: use "
                             f"auto, flash or math")
        return KernelChoice("sdpa", f"cp 1, no packed documents: SDPA forced to its {backend} backend")
    if backend == "cudnn":
        raise ValueError("attention_backend cudnn runs only through SDPA at cp 1 without sample_packing; "
                         "ring attention, Ulysses and packed documents need a kernel that returns the "
                         "log-sum-exp to merge: use auto, flash, efficient or math")
    if dev == "cpu":
        if dtype in CPU_FUSED_DTYPES and backend in ("auto", "fused", "flash"):
            return KernelChoice("cpu", f"{where}: the CPU flash kernel")
        if backend == "auto":
            return KernelChoice("torch", f"{where}: no CPU kernel for this dtype, the reference math")
        raise ValueError(f"attention_backend {backend} cannot run on {where}: use auto or math")
    if dev == "cuda":
        flash_ok = dtype in (torch.float16, torch.bfloat16) and _cuda_shape_ok(head_dim)
        efficient_ok = dtype in (torch.float16, torch.bfloat16, torch.float32) and _cuda_shape_ok(head_dim)
        if backend in ("auto", "fused") and flash_ok:
            return KernelChoice("cuda_flash", f"{where}: flash")
        if backend in ("auto", "fused", "efficient") and efficient_ok:
            why = "efficient forced" if backend == "efficient" else "flash needs fp16/bf16"
            return KernelChoice("cuda_efficient", f"{where}: memory-efficient ({why})")
        if backend == "flash" and flash_ok:
            return KernelChoice("cuda_flash", f"{where}: flash forced")
        if backend == "auto":
            return KernelChoice("torch", f"{where}: no fused kernel (head_dim must be a multiple of 8, at "
                                         f"most 256; dtype fp16/bf16/fp32), the reference math")
        raise ValueError(f"attention_backend {backend} cannot run on {where} (flash: fp16/bf16; efficient: "
                         f"also fp32; head_dim a multiple of 8 up to 256): use auto or math")
    if backend == "auto":
        return KernelChoice("torch", f"{where}: no fused kernel on this device, the reference math")
    raise ValueError(f"attention_backend {backend} cannot run on {where}: use auto or math")


def is_unsupported(err: BaseException) -> bool:
    """A RuntimeError that says "this kernel does not take this call" (fall back), not a failure."""
    msg = str(err)
    return (isinstance(err, RuntimeError) and not isinstance(err, torch.cuda.OutOfMemoryError)
            and _REAL_FAILURE.search(msg) is None and _UNSUPPORTED.search(msg) is not None)


def may_fall_back(err: BaseException, device, impl: str) -> bool:
    """Whether `err` from a fused kernel falls back to the reference math: only under auto; on CUDA
    only a "not supported" refusal; on CPU any RuntimeError but out-of-memory."""
    if impl != "auto" or not isinstance(err, RuntimeError) or isinstance(err, torch.cuda.OutOfMemoryError):
        return False
    if torch.device(device).type == "cuda":
        return is_unsupported(err)
    return "out of memory" not in str(err).lower()


class AttentionLog:
    """Which kernel each attention path ran, printed once per (path, kernel, reason) and kept in
    `entries` for programs (benchmarks/device_check.py). One per model (LlamaModel makes it); `echo`
    False records without printing (rank > 0 prints fallbacks only)."""

    def __init__(self, echo: bool = True, printer: Optional[Callable[[str], None]] = None):
        self.echo, self.printer = echo, printer or _print
        self.entries: List[Tuple[str, str, str]] = []

    def note(self, path: str, kind: str, reason: str, fallback: bool = False) -> None:
        if torch.compiler.is_compiling():   # traced once by torch.compile: a print would break the
            return                          # graph; the eager boundaries (ring, Ulysses) still note
        entry = (path, kind, reason)
        if entry in self.entries:
            return
        self.entries.append(entry)
        if self.echo or fallback:
            self.printer(f"[minipar] attention {path}: {kind} ({reason})")

    def kernels(self, path: Optional[str] = None) -> List[str]:
        """The kernels noted (for `path` only, if given), in order."""
        return [k for p, k, _ in self.entries if path is None or p == path]


def _print(msg: str) -> None:
    print(msg, flush=True)


def note(log: Optional[AttentionLog], path: str, kind: str, reason: str, fallback: bool = False) -> None:
    if log is not None:
        log.note(path, kind, reason, fallback)
