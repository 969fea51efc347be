"""ZeRO-3's gathers, replayed on unit names: which all-gathers a step launches, and its peak.

Under pipeline parallelism the order in which a stage's units run is the schedule's, not one
forward then one backward: the stage module (the ZeRO-3 root) runs once per model chunk and
micro-batch, 1F1B interleaves forwards and backwards, and the interleaved schedule alternates
between chunks whose units differ. zero3/shard_manager.py learns a forward and a backward order
from the last pass it saw and prefetches the next `prefetch` units of it; when the next pass runs
other units (the other chunk), the prefetched ones are freed unused and gathered again later.
A closed formula would have to guess all that; this file runs the hooks' own decisions
(minipar/zero3/shard_manager.py's GatherPolicy, the one its hooks ask) on the planner's
units, and only does the gathering and freeing by name:

    root pre-forward      free every unit; the pass's seen list restarts
    unit pre-forward      gather it (a no-op if gathered or empty), and if it sits where the
                          learned order expects it, prefetch the next `prefetch` units of the order
    unit post-forward     free it (reshard_after_forward); the root stays gathered into backward
    root post-forward     free every other unit (prefetched, unused); relearn the forward order
    unit pre-backward     as pre-forward, on the backward order (embeddings need no gather)
    unit post-backward    free it (only units that got gradients in this pass): here, not the policy's
    end of backward       free everything; relearn the backward order

The peak is taken where zero3 takes it (after each gather and its prefetch), so it equals
`zero3.peak_gathered_bytes`; tests/test_plan.py holds both counts against real runs.
"""
from __future__ import annotations

from typing import Dict, List

from minipar.zero3.shard_manager import GatherPolicy

from .model import Unit


class Zero3Replay:
    """zero3/shard_manager.py's hooks, replayed on unit names: which all-gathers a step launches
    and the peak of gathered bytes (start_gather is a no-op on a gathered or empty unit)."""

    def __init__(self, us: List[Unit], nbytes: Dict[str, int], prefetch: int, reshard: bool):
        self.us, self.nbytes = us, nbytes
        self.root = us[0]
        self.policy = GatherPolicy(us, prefetch, reshard, lambda u: u.kind != "embedding")
        self.gathered = set()
        self.held = 0                      # the bytes of `gathered`, kept as it changes
        self.calls: Dict[str, int] = {u.name: 0 for u in us}
        self.peak = 0

    def _start(self, u):
        if u.name not in self.gathered and u.numel:
            self.gathered.add(u.name)
            self.held += self.nbytes[u.name]
            self.calls[u.name] += 1

    def _free(self, units):
        for u in units:
            if u.name in self.gathered:
                self.gathered.discard(u.name)
                self.held -= self.nbytes[u.name]

    def _gather_now(self, gather):
        for u in gather:                   # the unit, then what the policy prefetches
            self._start(u)
        self.peak = max(self.peak, self.held)

    def forward(self, seq: List[Unit]):
        for u in seq:                      # the root's pre-forward first, its post-forward last
            free, gather = self.policy.pre_forward(u)
            self._free(free)
            self._gather_now(gather)
            if u is not self.root:
                self._free(self.policy.post_forward(u))
        self._free(self.policy.post_forward(self.root))

    def backward(self, seq: List[Unit], head: bool):
        self.policy.start_backward()
        for u in seq:
            gather = self.policy.pre_backward(u)
            if not gather:                                 # an embedding: no weights read
                continue
            self._gather_now(gather)
            if u is not self.root or head:                 # post-backward: the unit's grads are in
                self._free([u])                            # (the root has none in a headless chunk)
        self._free(self.policy.end_backward())             # end of backward: free everything
