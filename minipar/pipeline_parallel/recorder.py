"""What a pipeline step really did on one rank: a ScheduleHooks (executor.py's hook points) that
records, for the benchmark (benchmarks/bench_pp.py) and the tests that draw a step.

    rec = Recorder(); run_schedule(stage, order, pgm, batches, n, hooks=rec)
    rec.events     (kind, chunk, micro, start, end) of every compute
    rec.waits      (start, end) of every wait in a receive: this rank's real bubble (waiting for a
                   neighbour)
    rec.peak_live  the most micro-batch chunks held for backward at once; rec.peak_held_w the most
                   bytes a split backward kept for W
    rec.t_end      when the step's last exchange finished

What is neither compute nor waiting is the executor's own time (posting sends, Python between
actions). Times are seconds after t0, the step's start (perf_counter: one clock for every process
of a machine, so the ranks' rows can be drawn on one axis). Recording communicates nothing.
"""
from __future__ import annotations

import time
from typing import Callable, List

from .executor import ScheduleHooks
from .schedules import Action


class Recorder(ScheduleHooks):
    """What a step really did on this rank: compute events, waits, and the peak of live activations;
    t_end is when the step's last exchange finished (seconds after t0)."""

    def __init__(self):
        super().__init__()
        self.events: List[tuple] = []           # (kind, chunk, micro, start, end)
        self.waits: List[tuple] = []            # (start, end) blocked in a receive
        self.live = self.peak_live = 0
        self.peak_held_w = 0                    # bytes the split backward kept for W, at most
        self.t0 = self.t_end = None
        self.freed_by, self.store = "B", None

    def step_begins(self, freed_by: str, store) -> None:
        self.t0 = time.perf_counter()
        self.events, self.waits, self.live, self.peak_live, self.peak_held_w = [], [], 0, 0, 0
        self.freed_by, self.store = freed_by, store

    def wait(self, receive: Callable, *args):
        """receive(*args), its span kept as waiting."""
        t = time.perf_counter()
        out = receive(*args)
        self.waits.append((t - self.t0, time.perf_counter() - self.t0))
        return out

    def computed(self, action: Action, start: float, end: float) -> None:
        self.live += 1 if action.kind == "F" else -1 if action.kind == self.freed_by else 0
        self.peak_live = max(self.peak_live, self.live)
        self.events.append((action.kind, action.chunk, action.micro, start - self.t0, end - self.t0))
        if action.kind == "B" and self.store is not None:     # what B left queued for W
            self.peak_held_w = max(self.peak_held_w, self.store.held_bytes())

    def step_ends(self) -> None:
        self.t_end = time.perf_counter() - self.t0
