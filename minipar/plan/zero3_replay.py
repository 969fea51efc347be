"""ZeRO-3's gathers, replayed on unit names: which all-gathers a step launches, and its peak.

Under pipeline parallelism the order in which a stage's units run is the schedule's, not one
forward then one backward: the stage module (the ZeRO-3 root) runs once per model chunk and
micro-batch, 1F1B interleaves forwards and backwards, and the interleaved schedule alternates
between chunks whose units differ. zero3/shard_manager.py learns a forward and a backward order
from the last pass it saw and prefetches the next `prefetch` units of it; when the next pass runs
other units (the other chunk), the prefetched ones are freed unused and gathered again later.
A closed formula would have to guess all that; this file replays the hooks themselves, on names:

    root pre-forward      free every unit; the pass's seen list restarts
    unit pre-forward      gather it (a no-op if gathered or empty), and if it sits where the
                          learned order expects it, prefetch the next `prefetch` units of the order
    unit post-forward     free it (reshard_after_forward); the root stays gathered into backward
    root post-forward     free every other unit (prefetched, unused); relearn the forward order
    unit pre-backward     as pre-forward, on the backward order (embeddings need no gather)
    unit post-backward    free it (only units that got gradients in this pass)
    end of backward       free everything; relearn the backward order

The peak is taken where zero3 takes it (after each gather and its prefetch), so it equals
`zero3.peak_gathered_bytes`; tests/test_plan.py holds both counts against real runs.
"""
from __future__ import annotations

from typing import Dict, List

from .model import Unit


class Zero3Replay:
    """zero3/shard_manager.py's hooks, replayed on unit names: which all-gathers a step launches
    and the peak of gathered bytes (start_gather is a no-op on a gathered or empty unit)."""

    def __init__(self, us: List[Unit], nbytes: Dict[str, int], prefetch: int, reshard: bool):
        self.us, self.nbytes, self.prefetch, self.reshard = us, nbytes, prefetch, reshard
        self.root = us[0]
        self.fwd_order = list(us)
        self.bwd_order = [self.root] + [u for u in reversed(us[1:]) if u.kind != "embedding"]
        self.gathered = set()
        self.held = 0                      # the bytes of `gathered`, kept as it changes
        self.calls: Dict[str, int] = {u.name: 0 for u in us}
        self.peak = 0

    def _start(self, u):
        if u.name not in self.gathered and u.numel:
            self.gathered.add(u.name)
            self.held += self.nbytes[u.name]
            self.calls[u.name] += 1

    def _free(self, name):
        if name in self.gathered:
            self.gathered.discard(name)
            self.held -= self.nbytes[name]

    def _keep_only(self, keep):
        for name in [n for n in self.gathered if n not in keep]:
            self._free(name)

    def _gather_now(self, u, order, pos):
        self._start(u)
        if pos < len(order) and order[pos] is u:
            for v in order[pos + 1:pos + 1 + self.prefetch]:
                self._start(v)
        self.peak = max(self.peak, self.held)

    def forward(self, seq: List[Unit]):
        seen = []
        for u in seq:
            if u is self.root:
                self._keep_only(())
            seen.append(u)
            self._gather_now(u, self.fwd_order, len(seen) - 1)
            if u is not self.root and self.reshard:
                self._free(u.name)
        if self.reshard:
            self._keep_only((self.root.name,))
        if seen != self.fwd_order:
            self.fwd_order = seen

    def backward(self, seq: List[Unit], head: bool):
        seen = []
        for u in seq:
            if u.kind == "embedding":
                continue
            seen.append(u)
            self._gather_now(u, self.bwd_order, len(seen) - 1)
            if u is not self.root or head:                 # post-backward: the unit's grads are in
                self._free(u.name)                         # (the root has none in a headless chunk)
        self._keep_only(())                                # end of backward: free everything
        if seen != self.bwd_order:
            self.bwd_order = seen
