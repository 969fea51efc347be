"""The closing summary of a run: what it did, the memory it took and how fast it went, beside the
planner's prediction for the same layout.

    done: N steps in T s, loss a -> b, val_loss v        the steps this run took (after a resume:
                                                         not the ones before the checkpoint)
    peak memory per rank                                 CUDA: max_memory_allocated (what the planner
                                                         predicts) and max_memory_reserved (the caching
                                                         allocator's pool); CPU: the peak resident set
    throughput and MFU                                   the mean after the first step (throughput.py)
    planner                                              trainer.predict: prediction.py's planner_prediction,
                                                         minipar/plan/'s count of this run's layout

Communication: one all-gather of each rank's peaks over the world (every rank calls report).
"""
from __future__ import annotations

import resource
from typing import Optional

import torch

from minipar import comm
from minipar.trainer import metrics_file


def report(loop, elapsed: float, last_val: Optional[float]) -> None:
    """The summary of the run `loop` (train_loop.TrainLoop) drove, logged on rank 0."""
    cuda = loop.device.type == "cuda"         # (a gloo run on a GPU machine trains on the CPU)
    if cuda:   # the tensors alive at the peak, and the caching allocator's pool around them
        peak = [torch.cuda.max_memory_allocated(loop.device) / 2 ** 20,
                torch.cuda.max_memory_reserved(loop.device) / 2 ** 20]
    else:
        peak = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024]   # KiB -> MiB on Linux
    peaks = comm.all_gather(torch.tensor([peak], dtype=torch.float64, device=loop.device), loop.pgm.world)
    if not loop.is_main:
        return
    png = metrics_file.plot_loss_curve(loop.history, loop.cfg.output_dir, loop.pgm.grid_shape,
                                       loop.log) if loop.cfg.loss_curve else None
    # what THIS run did: after a resume the history also holds the steps before the checkpoint
    start_step = loop.trainer.start_step
    ran = [r for r in loop.history if r["step"] > start_step]
    first = ran[0]["loss"] if ran else float("nan")
    final = ran[-1]["loss"] if ran else float("nan")
    span = f" ({start_step + 1}-{start_step + len(ran)})" if start_step and ran else ""
    lines = [f"done: {len(ran)} steps{span} in {elapsed:.1f} s, loss {first:.4f} -> {final:.4f}"
             + (f", val_loss {last_val:.4f}" if last_val is not None else ""),
             f"metrics: {loop.cfg.metrics_path}" + (f", loss curve: {png}" if png else ""),
             *memory_lines(peaks.tolist(), cuda)]
    validator = loop.trainer.step.validator
    if validator is not None:
        lines.append(validator.describe())
    loop.log("\n".join(lines + speed_lines(loop, ran, max(p[0] for p in peaks.tolist()), cuda)))


def speed_lines(loop, ran, peak_mib: float, cuda: bool = False) -> list:
    """The run's throughput and MFU (after the first step, which warms up), beside the planner's
    prediction for this layout at the same peak (trainer.predict, prediction.py's)."""
    steps = ran[1:] if len(ran) > 1 else ran
    if not steps:
        return []
    mean = {k: sum(r[k] for r in steps) / len(steps) for k in steps[0]
            if k in ("tokens_per_s", "tflops_per_s", "mfu", "mfu_full_attention")}
    tp = loop.throughput
    if "mfu" in mean:                     # against the final peak (a CPU's may have been raised)
        ratio = mean["tflops_per_s"] / tp.peak
        full = ratio * mean["mfu_full_attention"] / mean["mfu"]
        mfu = (f", MFU {100 * ratio:.1f} % (full attention {100 * full:.1f} %) of {tp.peak:.3g} TFLOP/s "
               f"({tp.peak_source})" if ratio <= 1 else
               f", MFU not given: the run was faster than the peak {tp.peak:.3g} TFLOP/s ({tp.peak_source}); "
               f"set peak_tflops to the device's real peak")
    else:
        mfu = f" ({tp.peak_source})"
    lines = [f"throughput (steps {steps[0]['step']}-{steps[-1]['step']}): {mean['tokens_per_s']:.0f} "
             f"tokens/s, {mean['tflops_per_s']:.3g} TFLOP/s per device{mfu}"]
    predict = getattr(loop.trainer, "predict", None)
    if predict is not None and tp.peak:
        try:
            p = predict(tp.peak, tp.device_name)
        except ValueError as err:             # a run the planner cannot model: said, not fatal
            return lines + [f"planner: no prediction for this run ({err})"]
        hw = f"{p['gpu']}'s memory and links" if p.get("gpu") else "its default links"
        measured = (f"its prediction of max_memory_allocated; measured above: {peak_mib:.0f} MiB; "
                    f"max_memory_reserved adds the allocator's rounding and fragmentation, which its "
                    f"reserve covers" if cuda else f"the measured peak above: {peak_mib:.0f} MiB")
        lines.append(f"planner (python -m minipar.plan, at this peak, {hw} and its efficiencies): "
                     f"{p['tokens_per_s']:.0f} tokens/s, MFU {100 * p['mfu']:.1f} %, "
                     f"{p['memory_bytes'] / 2 ** 20:.0f} MiB of tensors per rank ({measured})")
    return lines


def memory_lines(peaks: list, cuda: bool) -> list:
    """The summary's memory lines from every rank's [allocated, reserved] peaks in MiB (CUDA:
    torch.cuda.max_memory_allocated, what the planner predicts, and max_memory_reserved, the caching
    allocator's pool: the allocated peak plus rounding, fragmentation and the blocks it keeps cached)
    or [resident] (the CPU: the process's peak resident set)."""
    def row(k):
        return " ".join(f"r{i}={p[k]:.0f}" for i, p in enumerate(peaks))
    if not cuda:
        return [f"peak resident memory per rank (MiB): {row(0)}"]
    return [f"peak CUDA memory allocated per rank (MiB): {row(0)}",
            f"peak CUDA memory reserved per rank (MiB): {row(1)}"]
