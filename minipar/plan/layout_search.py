"""The search: every layout of a world that runs and fits, ranked, and one recommended by rules.

Candidates. Every Layout(dp_replicate, dp_shard, cp, tp) whose product is the world (sequence parallelism
on whenever tp > 1: the same bytes, less memory), and, for each pp that divides the world with 2 <= pp <=
MAX_PP and at least two layers a stage, every pp x layout under each schedule that runs there (PIPELINES:
1F1B, interleaved 1F1B with 2 chunks, ZB-H1, ZB-V; pipeline.py's check refuses too few micro-batches, or a
count that is not a multiple of pp where the interleaved schedule needs one): the estimate weighs each
one's bubble against its sends and the memory of what it keeps in flight. Every layout with cp > 1 comes
once per cp_impl: ring, ulysses (u = cp), and usp for each u dividing cp with 1 < u < cp (`cp_impls`). A
candidate must pass the trainer's checks (feasible.py's `check`: under ulysses / usp u must divide the
query heads of a tp rank, check_ulysses; pipeline.py's for pp: enough micro-batches, a multiple of pp)
and fit: activation checkpointing is switched on only where the activations would not fit without it,
and then the lightest that fits (AC_LEVELS: none, selective per op, which keeps the matmul and attention
outputs and recomputes the rest, then every layer).

Ranking: by estimated step time (estimate.py; under pp, pipeline.py: the slowest stage over
(1 - bubble) plus the sends on the critical path).

The recommendation. The estimate decides: only the layouts within NEAR_TIE (5 %) of the fastest
that fits are eligible, and inside that band these placement rules break the near-tie, each applied
while some eligible layout still satisfies it (so the recommended layout is never more than 5 %
slower than the fastest; a rule never overrides a real slowdown, as "shard groups inside a node"
once did for 70B on 256 GPUs, recommending a layout 2.2x slower than the fastest that fit):
    1. TP within a node (tp <= GPUs per node): its collectives are on the critical path.
    2. PP only across nodes (pp 1 when the job fits in one node). Inside a node ZeRO-3 and TP
       move their bytes over NVLink and a pipeline would only add its bubble; across nodes a
       stage's data-parallel traffic covers 1/pp of the parameters, which is what pp buys, and
       the time estimate weighs it against the bubble.
    3. The smallest cp among the near-ties: CP for length, not for its own sake.
    4. Across nodes, HSDP rather than pure ZeRO-3: shard groups (dp_shard x cp) inside one node if
       that fits; else at least replicas (dp_replicate > 1) over shard groups that span nodes, so no
       all-gather spans the whole job.
    then the fastest left; among those within 1 % of it, the one with the most memory free.
The rules encode what the estimate does not see (a job's tolerance of a slow link, a failed node
taking one replica rather than the whole job); they are worth a few per cent, not a factor.
The cp_impl has no rule of its own: the rules above see a layout's sizes, the same for its three
impls, so the estimate chooses between them. What it weighs: ring's hops (2(C-1) K/V volumes a
layer) hide behind the attention compute until they outgrow it; Ulysses' all-to-alls (about 4 q + 4
k/v volumes x (u-1)/u, not growing with cp) are exposed, and cross nodes once u x tp > GPUs per
node; USP nests them (the all-to-all over u, the ring over cp / u). Near-ties go to the least
memory, which under Ulysses grows by the repeated KV heads when u does not divide them.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

from . import feasible, pipeline_stage
from . import pipeline as pl
from .estimate import Cluster, plan
from .inputs import Batch, Layout, ModelShape, Options

NEAR_TIE = 0.05   # the placement rules choose only among layouts this close to the fastest
AC_LEVELS = (False, "selective", True)                # the cheapest recompute first
MAX_PP = 16    # deeper pipelines: a bubble of (p - 1) / (m + p - 1) and a stage or two of layers
PIPELINES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2))   # (schedule, chunks per rank)


def layouts(world: int) -> List[Layout]:
    """Every Layout(dp_replicate, dp_shard, cp, tp) whose product is `world`, SP on whenever tp > 1."""
    divs = [k for k in range(1, world + 1) if world % k == 0]
    return [Layout(r, world // (r * c * t), c, t, t > 1) for t in divs for c in divs for r in divs
            if world % (r * c * t) == 0]


def cp_impls(lay: Layout) -> List[Layout]:
    """`lay` once per way attention can cross its cp ranks: ring alone when cp is 1; else ring,
    ulysses, and usp for each u dividing cp with 1 < u < cp (whether heads split is check()'s)."""
    if lay.cp == 1:
        return [lay]
    usp = [dataclasses.replace(lay, cp_impl="usp", cp_ulysses_size=u) for u in range(2, lay.cp)
           if lay.cp % u == 0]
    return [dataclasses.replace(lay, cp_impl="ring"), dataclasses.replace(lay, cp_impl="ulysses")] + usp


def candidates(model: ModelShape, batch: Batch, world: int, pipeline: bool = True):
    """(layout, Pipeline or None) for every layout and cp_impl that passes the trainer's checks."""
    deepest = min(world, MAX_PP, model.num_hidden_layers // 2)
    pps = [1] + ([k for k in range(2, deepest + 1) if world % k == 0] if pipeline else [])
    for pp in pps:
        pipes = [pipeline_stage.Pipeline(pp, name, v) for name, v in PIPELINES] if pp > 1 else [None]
        for lay in (v for grid in layouts(world // pp) for v in cp_impls(grid)):
            if feasible.check(model, lay, batch):
                continue
            for pipe in pipes:
                if pipe and pl.check(model, lay, pipe, batch):
                    continue
                yield lay, pipe


def _plan(model, lay, pipe, batch, opts, cluster) -> dict:
    if pipe is None:
        return plan(model, lay, batch, opts, cluster)
    return pl.plan_pipeline(model, lay, pipe, batch, opts, cluster)


def _fits(p: dict) -> bool:
    return p["fits"] if "stages" in p else p["memory"]["fits"]


def pp_of(p: dict) -> int:
    return p["layout"].get("pp", 1)


def search(model: ModelShape, batch: Batch, opts: Options, cluster: Cluster, world: int,
           pipeline: bool = True) -> dict:
    """Every candidate that fits, fastest first, and the recommendation by the rules above."""
    fitting, considered, later = [], 0, []
    first: dict = {}                  # pp x layout -> its 1F1B plan (None: it does not fit)

    def fit(lay, pipe, checkpointing=AC_LEVELS):
        for ac in checkpointing:      # checkpointing only when needed, the lightest that fits
            p = _plan(model, lay, pipe, batch, dataclasses.replace(opts, gradient_checkpointing=ac), cluster)
            if _fits(p):
                fitting.append(p)
                return p
        return None

    for lay, pipe in candidates(model, batch, world, pipeline):
        considered += 1
        if pipe is not None and pipe.schedule != "1f1b":
            later.append((lay, pipe))
            continue
        p = fit(lay, pipe)
        if pipe is not None:
            first[(lay, pipe.pp)] = p
    # the other schedules, where they can matter. Each keeps at least 1F1B's activations in flight
    # on its fullest stage (ZB-H1 and ZB-V p micro-batches' worth plus W's dy, interleaving more):
    # none runs where 1F1B does not fit, and each starts from 1F1B's checkpointing. None beats the
    # slowest stage's work plus 1F1B's sends (no bubble at all): where even that is more than
    # 2 NEAR_TIE above the fastest plan, it could not be recommended, and is not planned.
    fastest = min((p["time"]["step_s"] for p in fitting), default=0.0)
    for lay, pipe in later:
        base = first.get((lay, pipe.pp))
        if base is None:
            continue
        t = base["time"]
        if t["step_s"] - t["work_s"] * t["bubble"] / (1 - t["bubble"]) > (1 + 2 * NEAR_TIE) * fastest:
            continue
        fit(lay, pipe, AC_LEVELS[AC_LEVELS.index(base["options"]["gradient_checkpointing"]):])
    fitting.sort(key=lambda p: p["time"]["step_s"])
    g = cluster.gpus_per_node
    rules = [("TP within a node", lambda p, pool: p["layout"]["tp"] <= g),
             ("PP only across nodes", lambda p, pool: pp_of(p) == 1 or world > g),
             ("the smallest cp among near-ties",
              lambda p, pool: p["layout"]["cp"] == min(q["layout"]["cp"] for q in pool))]
    if world > g:
        rules.append(("shard groups inside a node",
                      lambda p, pool: not p["comm"].get("dp_shard_cp", {}).get("crosses_nodes", False)))
        rules.append(("HSDP rather than ZeRO-3 across nodes",
                      lambda p, pool: p["layout"]["dp_replicate"] > 1))
    fastest = fitting[0]["time"]["step_s"] if fitting else 0.0
    pool = [p for p in fitting if p["time"]["step_s"] <= (1 + NEAR_TIE) * fastest]
    applied = []
    for name, rule in rules:
        kept = [p for p in pool if rule(p, pool)]
        if kept:
            pool = kept
            applied.append(name)
    if pool:       # near-ties (1 %): the most memory left free
        best = pool[0]["time"]["step_s"]
        near = [p for p in pool if p["time"]["step_s"] <= 1.01 * best]
        pool = sorted(near, key=lambda p: p["memory"]["total"])
    return dict(ranked=fitting, recommended=pool[0] if pool else None, rules_applied=applied,
                considered=considered, params=model.num_params(),
                near_tie=NEAR_TIE)


def smallest_world(model: ModelShape, batch: Batch, opts: Options, cluster: Cluster, start: int,
                   limit: int = 4096) -> Optional[int]:
    """The fewest whole nodes (more than `start` GPUs) on which some layout fits, pipelines included
    (a 1F1B stage holds L / p layers of activations for up to p micro-batches, which with
    checkpointing can be what makes a tight model fit); None up to `limit`."""
    g = cluster.gpus_per_node
    budget = cluster.gpu_memory_bytes * (1 - cluster.reserve)
    state_only = -(-16 * model.num_params() // int(budget))      # the persistent state, sharded over all
    world = max(start + 1, state_only)
    world = -(-world // g) * g
    checkpointed = dataclasses.replace(opts, gradient_checkpointing=True)
    while world <= limit:
        if any(_fits(_plan(model, lay, pipe, batch, checkpointed, cluster))
               for lay, pipe in candidates(model, batch, world)):
            return world
        world += g
    return None
