"""The schedules on an ideal machine: every action of every rank takes a fixed time and a send
arrives at once. What is left of a step beyond a rank's own work is then the bubble the schedule
itself makes, with nothing of the machine in it.

    simulate(orders, v, t_f, t_b, t_w, name)   events per rank and the step time
    back_to_back(orders, m, steps)             several steps' lists with nothing between them
    steady_state(events, m)                    their step time once the steps overlap, idle per rank
    theory_bubble(name, p, m, v, steady)       the closed forms (schedules.py's docstring)
    forward_span(name, p, m, v)                the forwards alone (an evaluation), in stage forwards
    peak_in_flight(order)                      the most chunks one rank holds for backward

How simulate runs: each rank walks its action list (schedules.py) in order; an action starts when
its rank is free and its input exists: F of virtual stage s after F of s - 1 (the activation),
B after B of s + 1 (the gradient; the last stage's B after its own F: the loss), W after the same
stage's B (it needs the (x, dy) pairs B queued). A rank whose next action waits idles; if no rank
can move while actions remain, the lists deadlock (a wrong schedule), which is how the tests
check every schedule completes. A chunk's F, B, W take t_f / v, t_b / v, t_w / v (t_b is the whole
backward for the schedules without W), or, with `duration`, each action what the caller says: a
stage's own measured means (a slower stage, the one with the embedding or the loss, then delays
the others as on a real machine), or each action's measured time (a replay: what is left between
the replay and the real step is the cost of the sends and of the executor).

Steps back to back. A trainer that ends every step with a collective over all stages (the global
gradient norm for clipping, the loss for the log) makes each step start from an empty pipeline,
and each step pays its fill and its drain: what simulate() of one step shows. Without such a
collective each stage steps its own optimizer and starts the next step's forwards at once, so the
first stages' fill of step k + 1 overlaps the last stages' drain of step k. 1F1B and ZB-H1 gain
nothing from it (a stage's drain is idle time whose neighbour is still busy), but the V of zbv
ends on rank 0 (the loss and the first chunk are both there) while the others finish with the W's
they kept back, so the next step's forwards fill exactly that time: with the V full (m >= 2p - 1)
and t_F = t_B = t_W the steady step has NO bubble, the "zero bubble" of Qi et al., whose trainer
drops the step's collective for an optimizer step validated after the fact (their "post
validation": step, then roll back in the rare step that clipping or an inf would have changed).
back_to_back() renumbers the micro-batches of step k to k m .. k m + m - 1, so simulate() runs the
chain unchanged; steady_state() measures each rank from its first action of step 1 to that of the
last step, leaving out the chain's own fill (step 0) and drain (the last step).

The cost of this file's model is nothing: no tensor, no process group; O(p x actions) steps.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from .schedules import Action, chunk_stages, forward_order


def simulate(orders: List[List[Action]], v: int = 1, t_f: float = 1.0, t_b: float = 2.0, t_w: float = 0.0,
             name: str = "1f1b", duration: Optional[Callable[[int, Action], float]] = None,
             ) -> Tuple[List[List[Tuple[Action, float, float]]], float]:
    """Run the action lists of all p ranks of schedule `name` on an ideal machine (the module
    docstring): ([(action, start, end)] per rank, step time). A chunk's F, B, W take t_f / v,
    t_b / v, t_w / v, or duration(rank, action) where given. Raises RuntimeError if
    the lists deadlock. Virtual stages: chunk_stages(name, ...)."""
    p = len(orders)
    stages = [chunk_stages(name, p, r, v) for r in range(p)]
    even = {"F": t_f / v, "B": t_b / v, "W": t_w / v}
    took = duration or (lambda rank, a: even[a.kind])
    done: Dict[Tuple[str, int, int], float] = {}       # (kind, virtual stage, micro) -> end time
    pos, clock = [0] * p, [0.0] * p
    events: List[List[Tuple[Action, float, float]]] = [[] for _ in range(p)]
    last_vs = p * v - 1
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            a = orders[r][pos[r]]
            vs = stages[r][a.chunk]
            if a.kind == "F":
                dep = ("F", vs - 1, a.micro) if vs > 0 else None
            elif a.kind == "B":
                dep = ("B", vs + 1, a.micro) if vs < last_vs else ("F", vs, a.micro)
            else:                                       # W: after this stage's own B
                dep = ("B", vs, a.micro)
            if dep is not None and dep not in done:
                continue
            start = max(clock[r], done[dep] if dep is not None else 0.0)
            end = start + took(r, a)
            done[(a.kind, vs, a.micro)] = clock[r] = end
            events[r].append((a, start, end))
            pos[r] += 1
            progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise RuntimeError(f"the schedule deadlocks: ranks wait on {stuck}")
    return events, max(clock)


def back_to_back(orders: List[List[Action]], m: int, steps: int) -> List[List[Action]]:
    """Each rank's list repeated for `steps` steps, step k's micro-batches numbered k m + i, with
    nothing between the steps (no collective over the stages at a step's end)."""
    return [[Action(a.kind, a.chunk, a.micro + k * m) for k in range(steps) for a in order]
            for order in orders]


def steady_state(events: List[List[Tuple[Action, float, float]]], m: int) -> Tuple[float, List[float]]:
    """(step time, [idle time per step of each rank]) of a back_to_back chain's events, over the
    steps between the first and the last (their fill and drain left out): a rank's step runs from
    the start of its first action of one step to that of the next, and is its work plus its idle
    time (never negative, whatever the times); the step time is their mean over ranks."""
    steps = 1 + max(a.micro for ev in events for a, _, _ in ev) // m
    if steps < 3:
        raise ValueError(f"steady_state needs a chain of at least 3 steps (the first and the last are "
                         f"its fill and drain), got {steps}")
    spans, idle = [], []
    for ev in events:
        first = [min(s for a, s, _ in ev if a.micro // m == k) for k in (1, steps - 1)]
        inside = [(s, e) for a, s, e in ev if 1 <= a.micro // m < steps - 1]
        spans.append((first[1] - first[0]) / (steps - 2))
        idle.append(spans[-1] - sum(e - s for s, e in inside) / (steps - 2))
    return sum(spans) / len(spans), idle


def peak_in_flight(order: List[Action]) -> int:
    """The most micro-batch chunks whose forward ran and whose backward has not (whose W has not,
    under a zero-bubble schedule: B keeps the linears' inputs for W), on one rank."""
    freed_by = "W" if any(a.kind == "W" for a in order) else "B"
    live = peak = 0
    for a in order:
        live += 1 if a.kind == "F" else -1 if a.kind == freed_by else 0
        peak = max(peak, live)
    return peak


def theory_bubble(name: str, p: int, m: int, v: int = 1, steady: bool = False) -> float:
    """The idle fraction of a step with every chunk's F, B (and W) equally long per stage:
    t_F = t_B for the whole-backward schedules, t_F = t_B = t_W for the split ones. `steady`: of a
    step among steps run back to back (the module docstring), which changes zbv's alone."""
    if name == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    if name == "zbv":                          # in half-stage slots: p - 1, or more while the V is not full
        idle = max(0 if steady else p - 1, 4 * p - 2 - 2 * m)   # back to back the fill hides in the drain
        return idle / (6 * m + idle)
    return (p - 1) / ((v if name == "interleaved_1f1b" else 1) * m + p - 1)


def forward_span(name: str, p: int, m: int, v: int = 1) -> float:
    """The time of m micro-batches' forwards alone (schedules.forward_order, executor.forward_only), in
    units of one stage's forward of one micro-batch: m + p - 1 for v = 1, (m v + p - 1) / v
    interleaved with p dividing m, m + p - 1 on zbv's V; one after the other it was m p."""
    orders = [forward_order(name, p, m, r, v) for r in range(p)]
    return simulate(orders, v, t_f=1.0, t_b=0.0, name=name)[1]
