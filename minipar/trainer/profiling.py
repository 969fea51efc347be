"""profile_steps: [a, b] -- a torch.profiler trace of steps a..b on every rank, to see the overlap.

    <output_dir>/traces/rank<r>.pt.trace.json     Chrome trace format: open it in Perfetto
                                                  (ui.perfetto.dev) or chrome://tracing, or put the
                                                  directory under TensorBoard's profiler plugin

What a trace shows (CPU ops, and on a GPU the CUDA kernels and their streams):
    "train_step N"             one span per traced step (the loop's; metrics.jsonl's step N)
    "all_gather:dp_shard_cp"   every collective, named as the comm ledger names it (op:group,
                               minipar/comm_calls.py), where it was issued; "wait:all_gather:dp_shard_cp"
                               where the rank waited for an async one. ZeRO-3's prefetch is the
                               next layer's gather issued inside this layer's forward; a short
                               wait means the gather was hidden behind compute.
A test (tests/test_observability.py) holds the collective spans of each traced step equal to the
planner's count of a step (minipar/plan/collective_counts.py, from the shapes), and the ledger's
bytes of that step to the planner's bytes.

Costs: the profiler records every op of the traced steps (a few microseconds each), so those steps
run slower and their tokens_per_s and mfu say so; the trace is written after step b (seconds for
a large model). Steps outside [a, b] are not recorded at all. Record shapes and stacks are off.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, List, Optional

import torch


class StepProfiler:
    """Starts torch.profiler before step a and writes the trace after step b; around(step) wraps a step."""

    def __init__(self, steps: Optional[List[int]], output_dir: str, rank: int, device: torch.device,
                 log: Callable[[str], None]):
        self.first, self.last = steps if steps else (None, None)
        self.log = log
        self.path = os.path.join(output_dir, "traces", f"rank{rank}.pt.trace.json")
        self.device, self.profiler = device, None

    @contextlib.contextmanager
    def around(self, number: int):
        """Run step `number` (1-based, as metrics.jsonl counts) inside the trace when it is one of a..b."""
        if self.first is None or not self.first <= number <= self.last:
            yield
            return
        if self.profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        with torch.profiler.record_function(f"train_step {number}"):
            yield
        if number == self.last:
            self.close()

    def close(self) -> Optional[str]:
        """Stop and write the trace (also when the run ends inside the window); its path, or None."""
        if self.profiler is None:
            return None
        self.profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.profiler.export_chrome_trace(self.path)
        self.profiler = None
        self.log(f"profile trace of steps {self.first}-{self.last}: {self.path} (and one per rank)")
        return self.path
