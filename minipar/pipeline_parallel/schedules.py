"""Pipeline schedules: in which order each stage runs the forward (F) and backward (B) passes of
the m micro-batches of one step. A schedule here is a pure function of (p stages, m micro-batches,
this stage's rank) that returns that order as a list of Actions; executor.py runs the list, with
the sends and receives between neighbours that it implies. Nothing here communicates.

The bubble: a stage idles while it waits for the first activation (forward fill) and for the last
gradient (backward drain). With t_F, t_B the times of one micro-batch's forward and backward on
one stage, every schedule here takes (m + p - 1) (t_F + t_B) per step for m (t_F + t_B) of work:

    bubble fraction = (p - 1) / (m + p - 1)         AFAB and 1F1B
                    = (p - 1) / (v m + p - 1)       interleaved 1F1B, v model chunks per rank

So more micro-batches shrink the bubble. What differs is MEMORY: a stage keeps the activations
of every micro-batch whose forward ran and whose backward has not:

    AFAB      all m, at the end of the forwards                    (grows with m)
    1F1B      at most p - rank (p on the first stage)              (independent of m)
    interl.   at most 2 (p - rank - 1) + (v - 1) p + 1 chunks of 1/v of the layers each:
              that is (2 (p - rank - 1) + (v - 1) p + 1) / v micro-batches' worth: 5.5 on rank 0
              of p = 4, v = 2, where 1F1B holds 4 (a little more memory for the smaller bubble)

References: GPipe (Huang et al., 2019: all forward, all backward); PipeDream-Flush, i.e. 1F1B
(Narayanan et al., 2019/2021); the interleaved schedule of Megatron-LM (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", 2021).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

SCHEDULES = ("afab", "1f1b", "interleaved_1f1b")


class Action(NamedTuple):
    kind: str        # "F" or "B"
    chunk: int       # model chunk of this rank (0 unless interleaved)
    micro: int       # micro-batch index


def afab(p: int, m: int, rank: int) -> List[Action]:
    """All forward, all backward (GPipe). p = 4, m = 4 (numbers are micro-batches; time ->):

        stage 0   F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
        stage 1   .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .
        stage 2   .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .
        stage 3   .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .      (drawn with t_B = t_F)


    Simple, and every stage holds the activations of all m micro-batches before the first backward.
    """
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


def one_f_one_b(p: int, m: int, rank: int) -> List[Action]:
    """1F1B (PipeDream-Flush): warm up with p - rank - 1 forwards, then alternate one forward and
    one backward, then drain the remaining backwards. p = 4, m = 8:

        stage 0   F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        stage 1   .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        stage 2   .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        stage 3   .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .

    The same bubble as AFAB, but a backward frees a micro-batch's activations as soon as
    possible: stage `rank` never holds more than p - rank of them, however large m is.
    """
    warmup = min(p - rank - 1, m)
    order = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):                       # steady state: one forward, one backward
        order += [Action("F", 0, warmup + i), Action("B", 0, i)]
    order += [Action("B", 0, i) for i in range(m - warmup, m)]
    return order


def interleaved_1f1b(p: int, m: int, rank: int, v: int = 2) -> List[Action]:
    """Interleaved 1F1B (Megatron-LM): each rank holds v model chunks (virtual stages rank,
    rank + p, ...), and micro-batches go through the chunks in groups of p. p = 2, v = 2, m = 4
    (a/b = chunk 0/1; a micro-batch visits rank 0a, 1a, 0b, 1b):

        rank 0   F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a .   B2b .   B3b B2a B3a
        rank 1   .   F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a .
                 (drawn with t_B = t_F; one slot is one chunk, 1/v of a rank's layers)

    Each step of the fill is 1/v of a stage's layers, so the bubble shrinks by v; the price is v
    times as many sends per micro-batch, and m must be a multiple of p. The k-th forward of a
    rank is micro-batch (k // (p v)) p + k % p of chunk (k // p) % v; the k-th backward the same
    micro-batch of chunk v - 1 - (k // p) % v. Warm-up: (p - rank - 1) * 2 + (v - 1) * p forwards.
    """
    total = m * v

    def forward(k):
        return Action("F", (k // p) % v, (k // (p * v)) * p + k % p)

    def backward(k):
        return Action("B", v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def schedule_order(name: str, p: int, m: int, rank: int, v: int = 1) -> List[Action]:
    """The action list of `rank` for schedule `name` (one of SCHEDULES)."""
    if name == "afab":
        return afab(p, m, rank)
    if name == "1f1b":
        return one_f_one_b(p, m, rank)
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, rank, v)
    raise ValueError(f"pipeline_schedule={name!r}: use one of {', '.join(SCHEDULES)}")


def check_schedule(name: str, p: int, m: int, v: int) -> None:
    """Raise a ValueError naming the minimum when m micro-batches cannot run `name` on p stages
    (v chunks per rank). Local: every rank raises the same error before any collective."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    if name != "interleaved_1f1b" and v != 1:
        raise ValueError(f"pipeline_virtual_stages={v} only applies to pipeline_schedule interleaved_1f1b "
                         f"(got {name}); leave it unset")
    if name == "interleaved_1f1b" and v < 2:
        raise ValueError(f"interleaved_1f1b needs pipeline_virtual_stages >= 2 model chunks per rank, "
                         f"got {v}")
    need = 1 if name == "afab" else p
    why = ("1F1B's steady state needs the pipeline full" if name == "1f1b" else
           "the interleaved schedule sends micro-batches through the chunks in groups of p")
    fix = ("lower micro_batch_size (the count is global_batch_size / (micro_batch_size x dp)), raise "
           "global_batch_size, or use pipeline_schedule afab")
    if m < need:
        raise ValueError(f"pipeline_schedule {name} on {p} stages needs at least {need} micro-batches "
                         f"per step ({why}), but this run has {m}: {fix}")
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(f"pipeline_schedule interleaved_1f1b needs the micro-batch count "
                         f"to be a multiple of pipeline_parallel_size {p} ({why}), "
                         f"but this run has {m}: {fix}")


# ------------------------------------------------------------------------- a model of the timing
def simulate(orders: List[List[Action]], v: int = 1, t_f: float = 1.0, t_b: float = 2.0
             ) -> Tuple[List[List[Tuple[Action, float, float]]], float]:
    """Run the action lists of all p ranks on an ideal machine (compute takes t_f / t_b per chunk,
    a send arrives at once): ([(action, start, end)] per rank, step time). Raises RuntimeError if
    the lists deadlock. What bench_pp.py draws as the theory, and what the tests use to check that
    every schedule completes. Virtual stage of (rank, chunk) = chunk * p + rank."""
    p = len(orders)
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
            vs = a.chunk * p + r
            if a.kind == "F":
                dep = ("F", vs - 1, a.micro) if vs > 0 else None
            else:
                dep = ("B", vs + 1, a.micro) if vs < last_vs else ("F", vs, a.micro)
            if dep is not None and dep not in done:
                continue
            start = max(clock[r], done[dep] if dep is not None else 0.0)
            end = start + (t_f if a.kind == "F" else t_b) / v
            done[(a.kind, vs, a.micro)] = clock[r] = end
            events[r].append((a, start, end))
            pos[r] += 1
            progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(p) if pos[r] < len(orders[r])}
            raise RuntimeError(f"the schedule deadlocks: ranks wait on {stuck}")
    return events, max(clock)


def peak_in_flight(order: List[Action]) -> int:
    """The most micro-batch chunks whose forward ran and whose backward has not, on one rank."""
    live = peak = 0
    for a in order:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def theory_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    return (p - 1) / ((v if name == "interleaved_1f1b" else 1) * m + p - 1)
