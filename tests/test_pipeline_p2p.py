"""Pipeline p2p traffic that NCCL cannot deadlock (minipar/pipeline_parallel/p2p.py, p2p_plan.py).

A real gloo run of the trainer records, on every rank, each batch_isend_irecv it posts and each
wait (tests/nccl_replay.py's Recording, installed as the pipeline's transport); nccl_replay.replay
then runs those records under NCCL's rules (FIFO streams per rank and per pair of ranks, a batch
after the works waited on before it, a send done only when its receive runs, sends and receives
paired by order, not by tag) and fails on a deadlock or on a pair whose tags or sizes differ.
Fast: every schedule on pp 2 (m = p, and m = 2p for 1F1B and ZB-V, whose steps also run back to
back), and an MoE (side vectors) under 1F1B. Slow: every schedule on pp 4 at m = p and 2p, the
rest of pp 2, and the MoE under ZB-V and interleaved. Pure: the plan replayed for p up to 4 and several m
(interleaved with 2 and 3 chunks, with and without side vectors), every exchange mirrored by its
neighbour's, the receive buffers posted ahead a few whatever m, and the replay catching the order
minipar posted before (each send and receive alone), which deadlocks every schedule but AFAB, and a
pair with the wrong tag or size; the forwards alone (an evaluation: forward_order, forward_plan)
replayed for p up to 4 and m from 1 to 4p.
"""
import pytest
import torch
from harness import run_world
from nccl_replay import Deadlock, Mismatch, Recording, replay
from test_pipeline import _argv

from minipar.pipeline_parallel import (
    SCHEDULES,
    chunk_stages,
    exchange_plan,
    forward_order,
    forward_plan,
    schedule_order,
)
from minipar.pipeline_parallel.p2p import ACTIVATION, GRADIENT, SIDE_FORWARD, message_tag
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

STREAMS = ("rank", "peer")


def _v(name, v=2):
    return v if name in ("interleaved_1f1b", "zbv") else 1


def _messages(name, p, m, v, rank, side=False, forward=False):
    """Per action of `rank`: the tags it needs (with their sender's pp rank) and the tags it makes
    (with their receiver's); the zbv turn, inside one rank, is no message. forward: the forwards
    alone (forward_order: an evaluation)."""
    owner = {k: r for r in range(p) for k in chunk_stages(name, p, r, v)}
    stages, last = chunk_stages(name, p, rank, v), p * v - 1
    need, make = [], []
    for a in (forward_order if forward else schedule_order)(name, p, m, rank, v):
        vs = stages[a.chunk]
        frm, to = (vs - 1, vs + 1) if a.kind == "F" else (vs + 1, vs - 1)
        kind = ACTIVATION if a.kind == "F" else GRADIENT
        kinds = (kind, kind + SIDE_FORWARD)[:1 + side]
        got, out = [], []
        if a.kind != "W" and 0 <= frm <= last and owner[frm] != rank:
            got = [(owner[frm], message_tag(k, vs, a.micro, m)) for k in kinds]
        if a.kind != "W" and 0 <= to <= last and owner[to] != rank:
            out = [(owner[to], message_tag(k, to, a.micro, m)) for k in kinds]
        need.append(got)
        make.append(out)
    return need, make


def _old_posting(name, p, m, v):
    """The events of minipar's executor before the exchanges: each send posted alone as soon as
    it was made, each receive posted alone when needed and waited at once, in the order its
    sender posted (p2p's former arrival_order: zbv's receiver took an early message first)."""
    made = {r: _messages(name, p, m, v, r)[1] for r in range(p)}
    queue = {}                                     # (sender, receiver) -> tags in posting order
    for r in range(p):
        for out in made[r]:
            for q, tag in out:
                queue.setdefault((r, q), []).append(tag)
    traces = {}
    for r in range(p):
        need, make = _messages(name, p, m, v, r)
        events, early = [], set()

        def post(op, peer, tag):
            events.append(("post", len([e for e in events if e[0] == "post"]), [(op, peer, tag, (1,), "f")]))
        for got, out in zip(need, make):
            for q, tag in got:
                while tag not in early:
                    first = queue[(q, r)].pop(0)
                    post("recv", q, first)
                    events.append(("wait", events[-1][1]))
                    early.add(first)
                early.discard(tag)
            for q, tag in out:
                post("send", q, tag)
        traces[r] = events
    return traces


def _planned_posting(name, p, m, v, side=False, steps=1, forward=False):
    """The events the executor makes from p2p_plan.exchange_plan (post a slot's exchanges, wait on one
    when the next action needs a tag it receives, wait on the rest at the end), `steps` steps.
    forward: forward_only's, from p2p_plan.forward_plan."""
    traces = {}
    for r in range(p):
        plan = forward_plan(name, p, v, r, m) if forward else exchange_plan(name, p, m, v, r, side)
        need, _ = _messages(name, p, m, v, r, side, forward)
        events, count = [], 0
        for _ in range(steps):
            open_ = {}                             # tag -> batch not yet waited on
            for slot, exchanges in enumerate(plan):
                for ex in exchanges:
                    ops = [("send", ex.peer, t, (1,), "f") for t in ex.sends]
                    ops += [("recv", ex.peer, t, (1,), "f") for t in ex.recvs]
                    events.append(("post", count, ops))
                    open_.update({t: count for t in ex.sends + ex.recvs})
                    count += 1
                for _, tag in (need[slot] if slot < len(need) else []):
                    if tag in open_:
                        b = open_[tag]
                        events.append(("wait", b))
                        open_ = {t: x for t, x in open_.items() if x != b}
            events += [("wait", b) for b in sorted(set(open_.values()))]
        traces[r] = events
    return traces


# ------------------------------------------------------------------------------ pure checks
def test_the_replay_deadlocks_minipars_former_order_for_every_schedule_but_afab():
    # the example, 1F1B at pp 2, m 4: rank 0 posts send A0, send A1, recv G0; rank 1 recv A0,
    # send G0, recv A1: send A1 waits for recv A1, behind send G0, which waits for recv G0, behind send A1
    old = _old_posting("1f1b", 2, 4, 1)
    assert [e[2][0][:3] for e in old[0] if e[0] == "post"][:3] == [("send", 1, 16), ("send", 1, 20),
                                                                   ("recv", 1, 1)]
    for streams in STREAMS:
        with pytest.raises(Deadlock):
            replay(old, streams)
    for name in SCHEDULES:
        for p in (2, 4):
            for m in (p, 2 * p):
                old = _old_posting(name, p, m, _v(name))
                if name == "afab":
                    assert replay(old) == replay(old, "peer") > 0
                else:
                    with pytest.raises(Deadlock):
                        replay(old, "peer")


def test_the_replay_catches_a_pair_of_different_tags_or_sizes():
    good = _planned_posting("1f1b", 2, 4, 1)
    assert replay(good) > 0
    swapped = {r: list(ev) for r, ev in good.items()}
    i = next(i for i, e in enumerate(swapped[1]) if e[0] == "post" and e[2][0][0] == "send")
    _, b, ops = swapped[1][i]
    swapped[1][i] = ("post", b, [(ops[0][0], ops[0][1], ops[0][2] + 4) + ops[0][3:]] + ops[1:])
    with pytest.raises(Mismatch, match="tag, shape, dtype"):
        replay(swapped)
    resized = {r: list(ev) for r, ev in good.items()}
    resized[1][i] = ("post", b, [ops[0][:3] + ((2,), "f")] + ops[1:])
    with pytest.raises(Mismatch):
        replay(resized)


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_plan_replays_without_deadlock(name):
    for p in (2, 3, 4):
        for m in sorted({p, p + 1, 2 * p}):
            if name == "interleaved_1f1b" and m % p:
                continue
            for v in ((2, 3) if name == "interleaved_1f1b" else (_v(name),)):
                for side in (False, True):
                    for streams in STREAMS:
                        replay(_planned_posting(name, p, m, v, side, steps=2), streams)


@pytest.mark.parametrize("name", SCHEDULES)
def test_the_forward_only_plan_replays_without_deadlock(name):
    # an evaluation's forwards alone, pipelined (executor.forward_only): any m, the chunks placed for
    # `name` (interleaved: m need not be a multiple of p; its last group is shorter)
    for p in (2, 3, 4):
        for m in sorted({1, p - 1, p, p + 1, 2 * p, 4 * p}):
            for v in ((2, 3) if name == "interleaved_1f1b" else (_v(name),)):
                for streams in STREAMS:
                    assert replay(_planned_posting(name, p, m, v, forward=True), streams) > 0


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_exchange_is_its_neighbours_mirror(name):
    # the k-th exchange of r with q holds what the k-th of q with r receives and sends; each
    # rank sends a message after the action making it and receives it before the one needing it
    for p in (2, 4):
        for m in (p, 2 * p):
            v = _v(name)
            plans = [exchange_plan(name, p, m, v, r) for r in range(p)]
            lists = {(r, ex.peer): [] for r in range(p) for slot in plans[r] for ex in slot}
            for r in range(p):
                need, make = _messages(name, p, m, v, r)
                made = set()
                for slot, exchanges in enumerate(plans[r]):
                    for ex in exchanges:
                        assert set(ex.sends) <= made
                        made -= set(ex.sends)
                        lists[(r, ex.peer)].append(ex)
                    if slot < len(make):
                        made |= {tag for _, tag in make[slot]}
                assert not made
            for (r, q), mine in lists.items():
                assert [(ex.sends, ex.recvs) for ex in mine] == [(ex.recvs, ex.sends) for ex in lists[(q, r)]]
    # an evaluation: one micro-batch down every chunk, and m = 5 pipelined: m times its sends
    for m in (1, 5):
        plans = [forward_plan(name, 2, _v(name), r, m) for r in range(2)]
        assert sum(len(ex.sends) for plan in plans for slot in plan for ex in slot) == \
            m * (2 * _v(name) - 1 - (name == "zbv"))


def _held_receives(name, p, m, v, rank):
    """The most receive buffers `rank` has posted and not yet taken (each the size of h)."""
    need, _ = _messages(name, p, m, v, rank)
    held, peak = set(), 0
    for slot, exchanges in enumerate(exchange_plan(name, p, m, v, rank)):
        held |= {t for ex in exchanges for t in ex.recvs}
        peak = max(peak, len(held))
        held -= {t for _, t in (need[slot] if slot < len(need) else [])}
    return peak


@pytest.mark.parametrize("name", SCHEDULES)
def test_receives_posted_ahead_hold_a_few_buffers_whatever_m(name):
    # a receive is posted when its sender makes the tensor (in the unit-time run), not when it is
    # needed: the buffers that costs stay a few per rank (at most 4 at p 4), the same at m 2p and 4p
    for p in (2, 4):
        peaks = [[_held_receives(name, p, m, _v(name), r) for r in range(p)] for m in (2 * p, 4 * p)]
        assert peaks[0] == peaks[1] and max(peaks[0]) <= 4, peaks


# ------------------------------------------------------------------------------ real gloo runs
MOE = ["--model.model_type", "mixtral", "--model.num_local_experts", "4", "--model.num_experts_per_tok", "2",
       "--model.router_aux_loss_coef", "0.1"]


def _recorded(runs):
    """Each run (argv) trained on this rank with its p2p recorded: [(pp rank, events, losses)]."""
    torch.set_num_threads(1)
    out = []
    for argv in runs:
        trainer = Trainer(setup_run(argv))
        trainer.step.transport = rec = Recording()
        history = trainer.train()
        out.append((trainer.pgm.pp.rank, rec.events, [h["loss"] for h in history]))
    return out


def _run(tmp_path, p, name, micro_batch, *extra, steps=1):
    return _argv(tmp_path / f"{name}-{micro_batch}-{len(extra)}", "--pipeline_parallel_size", str(p),
                 "--pipeline_schedule", name, "--micro_batch_size", str(micro_batch),
                 "--eval_steps", str(steps), *extra, layers=2 * p, steps=steps)


def _check_recorded(tmp_path, p, runs):
    got = run_world(_recorded, p, runs, timeout=300)
    for k in range(len(runs)):
        traces = {rank_runs[k][0]: rank_runs[k][1] for rank_runs in got}
        assert sorted(traces) == list(range(p))
        posts = sum(e[0] == "post" for ev in traces.values() for e in ev)
        for streams in STREAMS:
            assert replay(traces, streams) == posts > 0, runs[k]


def test_recorded_pp2_runs_replay_under_nccls_rules(tmp_path):
    # global batch 8: micro-batches of 4 are m = 2 = p, of 2 m = 4 = 2p; the evaluation (forward
    # only, pipelined) and, for zbv and 1f1b, two steps run back to back (pipeline_overlap_steps)
    # are recorded too
    alone = ("--pipeline_overlap_steps", "true", "--max_grad_norm", "0")
    runs = [_run(tmp_path, 2, name, 4) for name in SCHEDULES]
    runs += [_run(tmp_path, 2, "1f1b", 2, *alone, steps=2), _run(tmp_path, 2, "zbv", 2, *alone, steps=2)]
    runs += [_run(tmp_path, 2, "1f1b", 2, *MOE)]
    # 3 eval batches down the pipeline together (executor.forward_only over a list; 3: not a multiple
    # of p, the interleaved forward order's last group is short)
    runs += [_run(tmp_path, 2, "interleaved_1f1b", 4, "--eval_batches", "3")]
    _check_recorded(tmp_path, 2, runs)


@pytest.mark.slow
def test_recorded_pp4_and_the_rest_of_pp2_replay_under_nccls_rules(tmp_path):
    runs = [_run(tmp_path, 4, name, mb) for name in SCHEDULES for mb in (2, 1)]    # m = 4, 8
    _check_recorded(tmp_path, 4, runs)
    runs = [_run(tmp_path, 2, name, 2) for name in ("afab", "interleaved_1f1b", "zb_h1")]
    runs += [_run(tmp_path, 2, "zbv", 2, *MOE), _run(tmp_path, 2, "interleaved_1f1b", 4, *MOE)]
    _check_recorded(tmp_path, 2, runs)
