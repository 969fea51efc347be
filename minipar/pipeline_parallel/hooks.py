"""What a caller may add to a pipeline step without the executor knowing why: named hook points.

run_schedule (executor.py) calls, on the one ScheduleHooks it is given:

    step_begins(freed_by, store)     before the first action: which action kind frees a micro-batch's
                                     activations ("B", or "W" under a split backward) and the
                                     WeightGradStore (split_backward.py) or None
    wait(receive, *args)             every blocking receive goes through it: receive(*args), returned
    before_backward(action, last)    before every B and W; last: this rank's final gradient action
                                     of the step (the last W under a zero-bubble schedule, the last B
                                     where its W's compute nothing)
    computed(action, start, end)     after every compute, with its perf_counter span
    step_ends()                      after the last exchange of the step has finished

The default does nothing (wait just receives). Two uses:

  data parallelism (minipar/compose.py): ScheduleHooks(before_backward=...) keeps DDP
      and ZeRO-3 in no_sync until `last`, whose gradients then trigger one reduction of everything;
  the benchmark (benchmarks/bench_pp.py): Recorder, the spans of every compute and of every wait in
      a receive (this rank's real bubble: waiting for a neighbour) and the peak of live micro-batch
      chunks. What is neither compute nor waiting is the executor's own time (posting sends,
      Python between actions). Times are seconds after t0, the step's start (perf_counter: one
      clock for every process of a machine, so the ranks' rows can be drawn on one axis).

No hook communicates, so a hook cannot change what the ranks exchange (p2p.py's plan).
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional

from .schedules import Action


class ScheduleHooks:
    """The hook points of run_schedule, each a no-op; subclass to observe, or pass before_backward."""

    def __init__(self, before_backward: Optional[Callable[[Action, bool], None]] = None):
        self._before_backward = before_backward

    def step_begins(self, freed_by: str, store) -> None:
        pass

    def wait(self, receive: Callable, *args):
        return receive(*args)

    def before_backward(self, action: Action, last: bool) -> None:
        if self._before_backward is not None:
            self._before_backward(action, last)

    def computed(self, action: Action, start: float, end: float) -> None:
        pass

    def step_ends(self) -> None:
        pass


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
