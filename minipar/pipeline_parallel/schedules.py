"""Pipeline schedules: in which order each stage runs the forward (F) and backward (B) passes of
the m micro-batches of one step (and, for the zero-bubble schedules, the backward split in two: B
the input gradient, W the weight gradient; split_backward.py). A schedule here is a pure function
of (p stages, m micro-batches, this stage's rank) that returns that order as a list of Actions;
executor.py runs the list, with the sends and receives between neighbours that it implies.
Nothing here communicates.

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

The zero-bubble schedules (zb_h1, zbv) split each backward
into B (dL/dx: the previous stage waits for it) and W (dL/dW: nobody does) and put the W's in the
bubbles. With t_F = t_B = t_W = t (the split backward: B + W = the old backward):

    1F1B      (p - 1) 3t idle per stage       bubble (p - 1) / (m + p - 1)
    ZB-H1     (p - 1) t                        bubble (p - 1) / (3 m + p - 1)       a third of 1F1B's
    ZB-V      (p - 1) t / 2 for m >= 2p - 1    bubble (p - 1) / (6 m + p - 1)       a sixth
              (the V's two chunks per rank halve the fill; the first forward must still cross
              p - 1 half-stages before the last rank starts, so not quite zero in one step; with
              steps run back to back, no collective between them, the next step's fill hides
              in this one's drain and the V's bubble is zero: simulate.py)

and memory counted as chunks whose F ran and whose W has not (the linears' inputs live until W):
ZB-H1 p on every rank (1F1B: p - rank, so the same peak as 1F1B's first stage), ZB-V min(2p,
m + rank + 1) chunks of half a stage (p micro-batches' worth at most, again 1F1B's peak).

References: GPipe (Huang et al., 2019: all forward, all backward); PipeDream-Flush, i.e. 1F1B
(Narayanan et al., 2019/2021); the interleaved schedule of Megatron-LM (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", 2021); zero bubble (Qi et
al., "Zero Bubble Pipeline Parallelism", ICLR 2024: ZB-H1; "Pipeline Parallelism with Controllable
Memory", 2024: the V-shape).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

SCHEDULES = ("afab", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
SPLIT_BACKWARD = ("zb_h1", "zbv")        # the schedules with W actions (split_backward.py)


class Action(NamedTuple):
    kind: str        # "F", "B" (the whole backward, or under a zero-bubble schedule dL/dx only) or "W"
    chunk: int       # model chunk of this rank (0 unless interleaved or zbv)
    micro: int       # micro-batch index


def chunk_stages(name: str, p: int, rank: int, v: int = 1) -> List[int]:
    """The virtual stage of each model chunk of `rank`: a loop for interleaving (chunk j is
    j * p + rank: a micro-batch visits ranks 0..p-1, then 0..p-1 again), a V for zbv (chunk 0 is
    rank, chunk 1 is 2p - 1 - rank: down the ranks and back up, so rank p - 1 passes its own chunk
    0's output to its chunk 1 without sending, and rank 0 holds both the embedding and the loss)."""
    if name == "zbv":
        return [rank, 2 * p - 1 - rank]
    return [j * p + rank for j in range(v)]


def stage_owners(name: str, p: int, v: int = 1) -> List[int]:
    """The pp rank holding each of the p v virtual stages (chunk_stages inverted): whom a send addresses."""
    owner = [0] * (p * v)
    for r in range(p):
        for k in chunk_stages(name, p, r, v):
            owner[k] = r
    return owner


def sends_to(a: Action, virtual: List[int], owner: List[int]) -> Optional[int]:
    """The virtual stage to which action `a` of a rank (its chunks' virtual stages: chunk_stages) sends
    its result over the wire: an F's h to the next virtual stage, a B's dL/dh to the previous one.
    None where nothing crosses ranks: the last virtual stage's F (it ends in the loss), the first's B,
    a W, or a neighbour on the same rank (zbv's turn at rank p - 1: handed over in memory). p2p.py
    pairs these messages; the planner counts them (minipar/plan/pipeline_stage.py)."""
    vs = virtual[a.chunk]
    to = vs + 1 if a.kind == "F" else vs - 1 if a.kind == "B" else None
    if to is None or not 0 <= to < len(owner) or owner[to] == owner[vs]:
        return None
    return to


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


def zb_h1(p: int, m: int, rank: int) -> List[Action]:
    """ZB-H1 (Qi et al. 2024): 1F1B with each backward split into B and W, and rank r's W's
    postponed by r micro-batches, so that they fill the gaps where 1F1B's drain waits for the next
    gradient. p = 4, m = 6 (b = B, w = W; time ->, t_F = t_B = t_W):

        stage 0   F0 F1 F2 F3 .  .  .  b0 w0 F4 b1 w1 F5 b2 w2 b3 w3 b4 w4 b5 w5
        stage 1   .  F0 F1 F2 .  .  b0 F3 b1 w0 F4 b2 w1 F5 b3 w2 b4 w3 b5 w4 w5
        stage 2   .  .  F0 F1 .  b0 F2 b1 F3 b2 w0 F4 b3 w1 F5 b4 w2 b5 w3 w4 w5
        stage 3   .  .  .  F0 b0 F1 b1 F2 b2 F3 b3 w0 F4 b4 w1 F5 b5 w2 w3 w4 w5

    B is all the critical path carries, so a gradient crosses a stage in t_B instead of t_B + t_W:
    the fill and drain cost (p - 1)(t_F + t_B - t_W) where 1F1B pays (p - 1)(t_F + t_B + t_W). Rank r
    holds at most p micro-batches (F done, W not): the peak of 1F1B's first stage, on every stage.
    """
    warmup = min(p - rank - 1, m)
    order = [Action("F", 0, i) for i in range(warmup)]
    w = 0                                              # the next micro-batch whose W is due
    for i in range(m):
        if warmup + i < m:
            order.append(Action("F", 0, warmup + i))
        order.append(Action("B", 0, i))
        if i >= rank:                                  # W lags B by `rank` micro-batches
            order.append(Action("W", 0, w))
            w += 1
    return order + [Action("W", 0, i) for i in range(w, m)]


def zbv(p: int, m: int, rank: int) -> List[Action]:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; torchtitan's
    ZBVZeroBubble): 2 chunks per rank in a V, chunk 0 (a) going down the ranks, chunk 1 (b) coming
    back up (chunk_stages), B and W split. p = 2, m = 3 (each slot a half stage; time ->):

        rank 0  F0a F1a F2a F0b b0b w0b F1b b1b w1b b0a w0a F2b b2b w2b b1a w1a b2a w2a .
        rank 1  .   F0a F0b F1a F1b b0b w0b F2a b0a w0a F2b b1b w1b b1a b2b b2a w1a w2b w2a

    (simulate.py with t_F = t_B = t_W; a micro-batch visits 0a, 1a, 1b, 0b: rank 1 hands its chunk a's
    output to its chunk b without a send.) The phases of rank r, which keep every rank busy from its
    first forward to its last W when m >= 2p - 1:
      1. 2 (p - r) - 1 forwards of chunk 0: the descending arm fills (rank p - 1: one);
      2. r pairs (F chunk 1, F chunk 0): the ascending arm reaches rank r;
      3. p - r triples (F, B, W) of chunk 1: the bottom of the V turns round;
      4. steady state: F a, B a, W a, F b, B b, W b, until every forward has run;
      5. drain: r pairs (B a, B b) with their W's postponed, p - r pairs (B a, W a), the W's left.
    Built for n = max(m, 2p - 1) micro-batches, keeping the actions of the first m (with fewer than
    2p - 1 the V does not fill: the bubble grows, see simulate.theory_bubble). Peak chunks held (F done, W
    not): min(2p, m + r + 1), i.e. at most p micro-batches' worth, 1F1B's first-stage peak.
    """
    n = max(m, 2 * p - 1)
    order: List[Action] = []
    count = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}

    def run(kind, chunk):
        order.append(Action(kind, chunk, count[kind][chunk]))
        count[kind][chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        run("F", 0)
    for _ in range(rank):
        run("F", 1)
        run("F", 0)
    for _ in range(p - rank):
        for kind in "FBW":
            run(kind, 1)
    while count["F"][0] < n or count["F"][1] < count["F"][0]:
        if count["F"][0] < n:
            run("F", 0)
        for kind, chunk in (("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)):
            run(kind, chunk)
    for _ in range(rank):
        run("B", 0)
        run("B", 1)
    for _ in range(p - rank):
        run("B", 0)
        run("W", 0)
    for chunk in (1, 0):
        while count["W"][chunk] < count["B"][chunk]:
            run("W", chunk)
    return [a for a in order if a.micro < m]


def schedule_order(name: str, p: int, m: int, rank: int, v: int = 1) -> List[Action]:
    """The action list of `rank` for schedule `name` (one of SCHEDULES)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, rank, v)
    return {"afab": afab, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zbv": zbv}[name](p, m, rank)


def forward_order(name: str, p: int, m: int, rank: int, v: int = 1) -> List[Action]:
    """The forwards alone (an evaluation, a reference's log-probs: no backward), the forward half of
    AFAB on the chunks placed for `name`: micro-batches in groups of p, each group through chunk 0,
    then chunk 1, ... (interleaved_1f1b's forward order where p divides m; v = 1: F0 F1 .. F(m-1));
    zbv: the F's of its own order. Rank s runs micro-batch i while rank s + 1 runs i - 1, so m
    micro-batches take m + p - 1 stage forwards ((m v + p - 1) / v interleaved; m + p - 1 on zbv's V)
    where one at a time took m p."""
    if name == "zbv":
        return [a for a in zbv(p, m, rank) if a.kind == "F"]
    return [Action("F", c, i) for g in range(0, m, p) for c in range(v) for i in range(g, min(g + p, m))]


def forward_window(p: int) -> int:
    """How many batches an evaluation sends down the pipeline at once: 4 p, a forward bubble of
    (p - 1) / (5 p - 1) (under a fifth), with at most that many h's in flight on a rank."""
    return 4 * p


def chunks_per_rank(name: str, configured: int = None) -> int:
    """Model chunks per rank (pipeline_virtual_stages): the configured count, or 2 for
    interleaved_1f1b and zbv, 1 otherwise."""
    if configured is not None:
        return configured
    return 2 if name in ("interleaved_1f1b", "zbv") else 1


def check_schedule(name: str, p: int, m: int, v: int) -> None:
    """Raise a ValueError naming the minimum when m micro-batches cannot run `name` on p stages
    (v chunks per rank). Local: every rank raises the same error before any collective."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={name!r}: use one of {', '.join(SCHEDULES)}")
    chunks = {"interleaved_1f1b": "2 or more", "zbv": "2"}.get(name, "1")
    if name not in ("interleaved_1f1b", "zbv") and v != 1:
        raise ValueError(f"pipeline_virtual_stages={v} only applies to pipeline_schedule interleaved_1f1b "
                         f"(got {name}); leave it unset")
    if (name == "interleaved_1f1b" and v < 2) or (name == "zbv" and v != 2):
        raise ValueError(f"{name} needs pipeline_virtual_stages = {chunks} model chunks per rank, got {v}; "
                         f"leave it unset")
    need = 1 if name == "afab" else p
    why = {"1f1b": "1F1B's steady state needs the pipeline full",
           "interleaved_1f1b": "the interleaved schedule sends micro-batches through the chunks in groups "
                               "of p",
           "zb_h1": "ZB-H1 is 1F1B's order with the backward split: its steady state needs the pipeline full",
           "zbv": "with fewer the V never fills and the schedule idles more than 1F1B"}.get(name, "")
    fix = ("lower micro_batch_size (the count is global_batch_size / (micro_batch_size x dp)), raise "
           "global_batch_size, or use pipeline_schedule afab")
    if m < need:
        raise ValueError(f"pipeline_schedule {name} on {p} stages needs at least {need} micro-batches "
                         f"per step ({why}), but this run has {m}: {fix}")
    if name == "interleaved_1f1b" and m % p:
        raise ValueError(f"pipeline_schedule interleaved_1f1b needs the micro-batch count "
                         f"to be a multiple of pipeline_parallel_size {p} ({why}), "
                         f"but this run has {m}: {fix}")
