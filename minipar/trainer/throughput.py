"""How fast a step ran against how fast the hardware could run it: TFLOP/s per device and MFU.

    tflops_per_s         model FLOPs of the step / step seconds / world, in 10^12 (one device's share)
    mfu                  tflops_per_s / peak_tflops                   attention's causal half counted
    mfu_full_attention   the same with attention counted whole        torchtitan's and Megatron-LM's

The FLOPs are models/flops.py's, the count the planner (minipar/plan) divides by too, so the
summary can set a run's MFU beside the planner's prediction for the same layout. The step time is
the wall clock of train_step (it ends with loss.item(), so a GPU's queue is drained). Activation
checkpointing's recompute is not model FLOPs: it lowers MFU, as it should.

The peak (TFLOP/s of one device), in this order:
    peak_tflops          the config's, when set (a GPU missing from the table, or another dtype)
    a GPU                minipar/gpus.py's table, by the name torch reports: dense (not sparse)
                         bf16 tensor-core TFLOP/s from the vendors' datasheets; a float32 run is held
                         against it too (set peak_tflops for TF32's). An unknown GPU has no MFU
                         until peak_tflops is set (said once in the log): a guess would mislead.
    a CPU                measured at start: the best of a few (1024 x 1024) matmuls in the run's
                         compute dtype, by each rank (rank 0's is logged). Ranks that share cores
                         measure while the others do, so it is the share a rank gets; on a loaded
                         machine it is low. So the measured peak is a lower bound, raised to any
                         step's achieved TFLOP/s that exceeds it (the hardware did that much): a CPU's
                         MFU never reads above 100 %, and the summary says when the peak was raised.
                         A configured or tabled peak is never changed: an MFU above 100 % against it
                         is not printed as a number, the summary names the peak as too low instead.
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

from minipar.gpus import gpu_peak_tflops
from models.flops import step_flops


def measure_cpu_tflops(dtype: torch.dtype = torch.float32, n: int = 1024, repeats: int = 5) -> float:
    """TFLOP/s of the best of `repeats` (n x n) @ (n x n) matmuls (2 n^3 FLOPs each), after one warm-up."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e12


def find_peak(configured: Optional[float], device: torch.device,
              dtype: torch.dtype) -> Tuple[Optional[float], str]:
    """(peak TFLOP/s of one device or None, where it came from), by the rules of the docstring."""
    if configured is not None:
        return configured, "peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name)
        if peak is None:
            return None, f"{name} is not in minipar/gpus.py's table: set peak_tflops for MFU"
        return peak, f"{name}, dense bf16"
    return measure_cpu_tflops(dtype), f"CPU, measured at start ({str(dtype).replace('torch.', '')} matmul)"


class Throughput:
    """The FLOPs of this run's step and the peak; of_step(seconds) -> the metrics of one step."""

    def __init__(self, cfg, world: int, device: torch.device, dtype: torch.dtype):
        # the rows of a step: rl: dpo counts pairs, two rows each (its reference's forward is not
        # counted, as a recomputed forward is not: the model FLOPs of MFU)
        self.rows = cfg.global_batch_size * (2 if getattr(cfg, "rl", None) else 1)
        self.flops = step_flops(cfg.model, self.rows, cfg.sequence_len)
        self.world = world
        self.peak, self.peak_source = find_peak(cfg.peak_tflops, device, dtype)
        self.measured = cfg.peak_tflops is None and device.type != "cuda"   # a lower bound, raised
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None

    def of_step(self, seconds: float) -> dict:
        """{tflops_per_s, mfu, mfu_full_attention} of a step that took `seconds` (no mfu without a peak)."""
        per_device = self.flops.causal / seconds / self.world / 1e12
        out = dict(tflops_per_s=per_device)
        if self.measured and per_device > self.peak:     # the start's measurement ran on a loaded CPU
            self.peak = per_device
            self.peak_source = "CPU, raised to the fastest step's rate (the start's matmul ran slower)"
        if self.peak:
            out.update(mfu=per_device / self.peak,
                       mfu_full_attention=self.flops.full / seconds / self.world / 1e12 / self.peak)
        return out

    def describe(self) -> str:
        peak = f"{self.peak:.3g} TFLOP/s per device ({self.peak_source})" if self.peak else self.peak_source
        return (f"model FLOPs per step: {self.flops.causal / 1e12:.4g} T (causal attention; "
                f"{self.flops.full / 1e12:.4g} T counting attention whole); peak {peak}")
