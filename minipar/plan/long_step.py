"""A long pipeline step planned from three short ones.

pipeline_stage.replay_stage walks a stage's whole action list: O(m) actions for m micro-batches,
each through the ZeRO-3 replay. A planner asked about a global batch of thousands of micro-batches
(Llama 3's 16M tokens at pp 16) must not walk them all, and need not: past the warm-up, every
micro-batch of AFAB, 1F1B, ZB-H1 and ZB-V (every group of p under interleaving) repeats the same
actions from the same state, so every count grows by the same amount per period and every peak
stops growing. plan_stage replays m1 = 2p, m1 + period and m1 + 2 period micro-batches; where the
three answers agree leaf by leaf (constant, or growing by the same step) the answer at m is
m1's plus (m - m1) / period steps, which is what the full replay gives (tests/test_plan.py holds
the two equal); where they do not, it replays the whole step.

Cost: three short replays instead of one of length m; no communication.
"""
from __future__ import annotations

import dataclasses

from .inputs import Batch, Layout, ModelShape, Options
from .pipeline_stage import Pipeline, replay_stage
from .stage_units import Stage


def plan_stage(model: ModelShape, layout: Layout, pipe: Pipeline, st: Stage, batch: Batch,
               opts: Options) -> dict:
    """Memory, activations and ledger of one stage (one rank of it: all its ranks are alike):
    replay_stage's answer, for m > 4p extended from three short replays (the module docstring;
    a backward ends with nothing gathered and the learned orders do not change, so the state
    repeats)."""
    M = batch.micro_steps(layout)
    # the interleaved schedule repeats per group of p micro-batches, the others per micro-batch
    period = pipe.pp if pipe.schedule == "interleaved_1f1b" else 1
    m1 = 2 * pipe.pp
    if M <= 4 * pipe.pp or batch.global_batch_size % M or (M - m1) % period:
        return replay_stage(model, layout, pipe, st, batch, opts)
    per = batch.global_batch_size // M                   # samples of one micro-step, over dp
    r1, r2, r3 = (replay_stage(model, layout, pipe, st, dataclasses.replace(batch, global_batch_size=per * m),
                               opts) for m in (m1, m1 + period, m1 + 2 * period))
    out = _extend(r1, r2, r3, (M - m1) // period)
    return out if out is not None else replay_stage(model, layout, pipe, st, batch, opts)


def _extend(a, b, c, k):
    """a + k (b - a) leaf by leaf, where c - b == b - a everywhere; None where they disagree."""
    if isinstance(a, dict):
        if not (isinstance(b, dict) and isinstance(c, dict) and a.keys() == b.keys() == c.keys()):
            return None
        out = {key: _extend(a[key], b[key], c[key], k) for key in a}
        return None if any(v is None for v in out.values()) else out
    if isinstance(a, (list, tuple)):
        if not (len(a) == len(b) == len(c)):
            return None
        out = [_extend(x, y, z, k) for x, y, z in zip(a, b, c)]
        return None if any(v is None for v in out) else type(a)(out)
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        return a if a == b == c else None
    return a + k * (b - a) if c - b == b - a else None
