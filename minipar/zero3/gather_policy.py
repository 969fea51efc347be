"""ZeRO-3's gather policy: at each hook event, which units to free and which to gather (the unit
itself and the `prefetch` next ones), and the forward and backward orders it learns. Pure: no
tensor, no process group, no communication. shard_manager.py's hooks ask it and run its answers
(the all-gathers, the frees); minipar/plan/zero3_replay.py asks it too, on the planner's unit names,
so the planner counts the very gathers a run launches, not a copy of the rule that could drift.

    event                    answer                                    (units[0] is the root)
    pre_forward(u)           free: every unit when u is the root (a new pass: a forward left
                             without backward may have gathered stale shards); gather: u, and if
                             u runs where the learned forward order expects it, the next
                             `prefetch` units of that order
    post_forward(u, grad)    free: u (reshard_after_forward, or no grad: no backward will come);
                             at the root, the pass's end: every other unit (prefetched but unused
                             too), never the root while grad is on (the first unit of backward,
                             FSDP2's default); the forward order relearned if this pass differed
    start_backward()         a new backward pass: its seen list restarts
    pre_backward(u)          gather: as pre_forward on the backward order; nothing for a unit
                             whose backward reads no weight (an embedding: gather_for_backward)
    end_backward()           free: every unit; the backward order relearned if the pass differed
                             (a pass that gathered nothing, a pipeline's W, teaches nothing)

Before the first step the orders are a static guess, so step 1 prefetches too: forward in
registration order, backward its reverse with the root first (the loss is its output). A model
that runs its units in another order, or skips one, is learned after its first pass: the next
pass prefetches what it will really run. Under pipeline parallelism the passes alternate between
model chunks, and each relearns the order from the other (plan/zero3_replay.py counts what that
costs). Units are compared by identity where a position is checked (`order[i] is u`) and by `==`
where a pass is compared with the learned order, as both callers' unit objects allow.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple


def gather_with(order: Sequence, position: int, unit, prefetch: int) -> list:
    """The units to gather when `unit` runs as the position-th of its pass: itself first, and, if
    the learned order has it there, the next `prefetch` units of that order (in flight while it
    computes)."""
    ahead = order[position + 1:position + 1 + prefetch] if position < len(order) and order[position] is unit \
        else []
    return [unit] + list(ahead)


class GatherPolicy:
    """The decisions of ZeRO-3's hooks over the units (root first), and the learned orders."""

    def __init__(self, units: Sequence, prefetch: int, reshard_after_forward: bool,
                 gather_for_backward: Callable[[object], bool]):
        self.units, self.root = list(units), units[0]
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.gather_for_backward = gather_for_backward
        self.forward_order: List = list(units)
        self.backward_order: List = [self.root] + [u for u in reversed(self.units[1:])
                                                   if gather_for_backward(u)]
        self._fwd_seen: List = []
        self._bwd_seen: List = []

    def pre_forward(self, u) -> Tuple[list, list]:
        """(free, gather) before u's forward: the root starts a pass and frees everything first."""
        free = []
        if u is self.root:
            self._fwd_seen = []
            free = list(self.units)
        self._fwd_seen.append(u)
        return free, gather_with(self.forward_order, len(self._fwd_seen) - 1, u, self.prefetch)

    def post_forward(self, u, grad: bool = True) -> list:
        """What to free after u's forward (grad: autograd records, so a backward will come)."""
        if u is not self.root:
            return [u] if self.reshard_after_forward or not grad else []
        free = [v for v in self.units if (v is not self.root and self.reshard_after_forward) or not grad]
        if grad and self._fwd_seen != self.forward_order:
            self.forward_order = list(self._fwd_seen)           # relearn: this pass ran otherwise
        return free

    def start_backward(self) -> None:
        self._bwd_seen = []

    def pre_backward(self, u) -> list:
        """What to gather before u's backward (nothing where its backward reads no weight)."""
        if not self.gather_for_backward(u):
            return []
        self._bwd_seen.append(u)
        return gather_with(self.backward_order, len(self._bwd_seen) - 1, u, self.prefetch)

    def end_backward(self) -> list:
        """What to free when the backward pass ends: everything (prefetched but unused, or kept)."""
        if self._bwd_seen and self._bwd_seen != self.backward_order:
            self.backward_order = list(self._bwd_seen)          # relearn (a W pass gathers nothing)
        return list(self.units)
