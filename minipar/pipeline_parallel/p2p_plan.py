"""The plan of a pipeline's point-to-point traffic: which exchanges each rank posts before each of
its actions, so that a backend which ignores tags (NCCL) cannot deadlock (p2p.py says NCCL's
rules, and StageLink there follows the plan).

    plan_exchanges(orders, name, v, m, side)  every rank's plan[rank][slot]: the exchanges to post
                                              before action `slot` (slot len(order): after the last)
    exchange_plan(name, p, m, v, rank, side)  this rank's, for schedule `name`'s own action lists
    forward_plan(name, p, v, rank, m)         m micro-batches forward only, pipelined (an evaluation:
                                              schedules.forward_order)

The posting order. plan_exchanges() runs every rank's action list on the ideal machine of
simulate.py with every action one time unit long. Each message then has a time t: the end of
the action that produced it. All messages between two neighbours at one time t (at most one each
way: a rank ends one action at a time) form one EXCHANGE, one batch on both ends: its sends, then
its receives, the side vectors right after their tensor. Each rank posts its exchanges in the
order (t, edge) between its actions: after every action that ends by t, before every action that
starts at t or later (the sender has just made its tensor; the receiver needs it no earlier).
1F1B's steady state comes out as Megatron's pairs, [send A(i) -> s + 1, recv G(j) <- s + 1] then
[send G(j) -> s - 1, recv A(i + 1) <- s - 1]; the fill and the drain send or receive alone.
Why that cannot deadlock, under NCCL's rules (p2p.py): number the exchanges by (t, edge) with edges
(low rank, high rank) in one global order. Both ends of an exchange post it; before posting it a
rank waited only on exchanges of earlier times (a receive waited on before an action starting at
s comes from an exchange at t <= s, and an exchange posted after that action has t > s); its stream
runs only exchanges numbered lower before it. So, by induction on the number, every exchange
starts and finishes. The k-th exchange of rank r with q is the mirror of the k-th of q with r (one
sorted list of both), so every send meets its receive, tags and sizes equal, whatever order the
ranks consume in (zbv's receiver takes some messages later than they come: they wait, received,
in p2p.StageLink's `arrived`). Steps run back to back (pipeline_overlap_steps) repeat the list,
numbered after the last step's. tests/test_pipeline_p2p.py records a real run's posts and waits
and replays them under these rules.

Pure: no tensor, no process group; every rank computes the whole plan (O(p x actions) steps) and
keeps its own part. The composition (minipar/compose.py) makes it once per run and hands it to the
executor (run_schedule's plan=); a stage asked for its own (stage.py's PipelineStage.exchange_plan)
makes it here too.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Dict, List

from .p2p import ACTIVATION, GRADIENT, SIDE_FORWARD, Exchange, message_tag
from .schedules import Action, chunk_stages, forward_order, schedule_order, sends_to, stage_owners
from .simulate import simulate


def plan_exchanges(orders: List[List[Action]], name: str, v: int, num_micro: int,
                   side: bool = False) -> List[List[List[Exchange]]]:
    """The exchanges of every rank of a pipeline running the action lists `orders` (one per pp rank),
    as plan[rank][slot]: the exchanges to post before action `slot` (slot len(order): after the
    last). The module docstring says why this order is safe. Pure: every rank computes all of it."""
    p = len(orders)
    stages = [chunk_stages(name, p, r, v) for r in range(p)]
    owner = stage_owners(name, p, v)
    events, _ = simulate(orders, v, name=name, duration=lambda rank, a: 1.0)
    messages: Dict[tuple, list] = {}            # (time, low rank, high rank) -> [(sender, tags)]
    for r in range(p):
        for a, _, end in events[r]:
            to = sends_to(a, stages[r], owner)       # None: nothing crosses ranks
            if to is None:
                continue
            kind = ACTIVATION if a.kind == "F" else GRADIENT
            tags = [message_tag(kind, to, a.micro, num_micro)]
            if side:
                tags.append(message_tag(kind + SIDE_FORWARD, to, a.micro, num_micro))
            q = owner[to]
            messages.setdefault((end, min(r, q), max(r, q)), []).append((r, tags))
    plan = [[[] for _ in range(len(order) + 1)] for order in orders]
    ends = [[e for _, _, e in ev] for ev in events]
    for (t, lo, hi), parts in sorted(messages.items()):
        for r, q in ((lo, hi), (hi, lo)):
            sends = tuple(tag for s, tags in parts if s == r for tag in tags)
            recvs = tuple(tag for s, tags in parts if s == q for tag in tags)
            slot = bisect_right(ends[r], t)      # after the actions ending by t, before those starting at t
            plan[r][slot].append(Exchange(q, sends, recvs))
    return plan


def exchange_plan(name: str, p: int, m: int, v: int, rank: int, side: bool = False) -> List[List[Exchange]]:
    """This rank's slots of plan_exchanges for schedule `name` (p stages, m micro-batches, v chunks)."""
    orders = [schedule_order(name, p, m, r, v) for r in range(p)]
    return plan_exchanges(orders, name, v, m, side)[rank]


def forward_plan(name: str, p: int, v: int, rank: int, m: int = 1) -> List[List[Exchange]]:
    """The slots of m micro-batches' forwards alone (an evaluation: no backward), in
    schedules.forward_order, the forward half of AFAB."""
    orders = [forward_order(name, p, m, r, v) for r in range(p)]
    return plan_exchanges(orders, name, v, m)[rank]
