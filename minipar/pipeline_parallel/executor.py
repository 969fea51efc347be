"""Run a schedule: walk this rank's action list, compute, and move tensors between stages.

    for action in schedule_order(...):                      schedules.py: F / B, chunk, micro-batch
        post the exchanges due before it                     p2p.py: the sends made so far, paired
                                                             with the receives due, one batch each
        F(c, m):  x = input ids (first virtual stage) or recv_forward()       blocks until h arrives
                  out = stage(x, chunk=c)  -> h, or the loss on the last virtual stage
                  send_forward(h) (posted at the next slot); keep (x, out) for the backward
        B(c, m):  g = recv_backward() (not on the last virtual stage)         blocks until dL/dh arrives
                  autograd.backward(out, g)  -> x.grad
                  send_backward(x.grad) (posted at the next slot) unless x were the ids; free (x, out)
                  (zb_h1, zbv: inside stage.weight_grads.inputs_only((c, m)): the Linears compute
                  dL/dx only and queue (x, dy) for W; split_backward.py)
        W(c, m):  stage.weight_grads.weight_grads((c, m)): every queued dW, accumulated through
                  autograd into the parameters' .grad; the kept x and dy are freed

What the executor is handed, rather than knowing (so it reads alone, with p2p.py and schedules.py):

    plan          this rank's exchanges, slot by slot (p2p_plan.py): the composition makes it once
                  (minipar/compose.py); left out, the stage is asked for its own schedule's
                  (stage.exchange_plan)
    side vectors  what a model's loss needs carried between stages besides h (stage.pipeline_aux:
                  an MoE's load-balancing loss); the stage hands over their mover
                  (stage.side_vectors: side_vectors.py), which the executor calls after each F
                  (side.after_forward) and before each B (side.before_backward), knowing nothing
                  of what they hold
    hooks         what a caller adds to a step, below

Forward only (forward_only: an evaluation, DPO's reference log-probs): the F actions alone, in
schedules.forward_order (the forward half of AFAB), the same F(c, m) under torch.no_grad with its
exchanges planned by p2p_plan.forward_plan, so rank s runs micro-batch m while rank s + 1 runs
m - 1: M micro-batches take M + p - 1 stage forwards ((M v + p - 1) / v interleaved; zbv's V, whose
chunks a micro-batch crosses in turn, M + p - 1), not M p one after the other. Nothing
is kept for a backward; each micro-batch's loss share comes back apart.

A stage keeps (x, out) and everything autograd saved between F(c, m) and B(c, m), and the
linears' inputs and output gradients until W(c, m): that is the activation memory the schedules
differ in (schedules.py). Only receives block, so a rank waits
exactly when the data it needs has not been computed yet: the bubble.

Gradient accumulation over the m micro-batches: parameters used by several micro-batches add up
their gradients. Data parallelism must reduce once per step, not per micro-batch: the caller's
hooks (ScheduleHooks.before_backward(action, last)), called before every B and W, learn which is
this rank's last gradient action of the step (the last W under a zero-bubble schedule, the last B
where its W's have nothing to compute, a frozen base's: the caller keeps DDP and ZeRO-3 in no_sync
until then, and that action's gradients trigger their reduction of everything, once). The loss
(sum over micro-batches of sum / num_items_in_batch) is returned on the last stage, zero
elsewhere: the caller sums it over dp_cp and pp.

The hook points, on the one ScheduleHooks run_schedule is given (each a no-op by default; wait
just receives). No hook communicates, so a hook cannot change what the ranks exchange:

    step_begins(freed_by, store)     before the first action: which action kind frees a micro-batch's
                                     activations ("B", or "W" under a split backward) and the
                                     WeightGradStore (split_backward.py) or None
    wait(receive, *args)             every blocking receive goes through it: receive(*args), returned
    before_backward(action, last)    before every B and W; last: this rank's final gradient action
    computed(action, start, end)     after every compute, with its perf_counter span
    step_ends()                      after the last exchange of the step has finished

Two uses: data parallelism (minipar/compose.py: ScheduleHooks(before_backward=...), the no_sync
above), and the benchmark's Recorder (recorder.py: the spans of every compute and every wait,
this rank's real bubble).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, List, Optional

import torch

from .. import comm
from .p2p import StageLink, activation_shape
from .schedules import Action, forward_order


class ScheduleHooks:
    """The hook points of run_schedule (the module docstring), each a no-op; subclass to observe
    (recorder.py's Recorder), or pass before_backward."""

    def __init__(self, before_backward: Optional[Callable[[Action, bool], None]] = None):
        self._before_backward = before_backward

    def step_begins(self, freed_by: str, store) -> None:
        pass

    def wait(self, receive: Callable, *args):
        return receive(*args)

    def before_backward(self, action: Action, last: bool) -> None:
        if self._before_backward is not None:
            self._before_backward(action, last)

    def computed(self, action: Action, start: float, end: float) -> None:
        pass

    def step_ends(self) -> None:
        pass


def run_schedule(stage, order: List[Action], pgm, micro_batches: List[Dict[str, torch.Tensor]],
                 num_items_in_batch, *, act_dtype: torch.dtype = torch.float32,
                 hooks: Optional[ScheduleHooks] = None, autocast=contextlib.nullcontext,
                 plan: Optional[list] = None, transport=comm) -> torch.Tensor:
    """One training step's forwards and backwards of `stage` in the order `order`; returns this
    rank's share of the loss (a float64 0-d tensor; zero off the last stage). hooks: what the
    caller adds (ScheduleHooks; None: nothing); plan: this rank's exchanges (p2p_plan.exchange_plan;
    None: the stage's own, stage.exchange_plan, whose schedule `order` must then be); transport:
    what posts and waits (comm; a test may record through it)."""
    m, hooks = len(micro_batches), hooks if hooks is not None else ScheduleHooks()
    device = micro_batches[0]["input_ids"].device
    if plan is None:
        plan = stage.exchange_plan(order, m)
    aux = stage.pipeline_aux                    # what the model's loss needs besides h, or None
    link = StageLink(pgm, activation_shape(micro_batches[0], pgm, stage.config.hidden_size,
                                           stage.sequence_parallel), act_dtype,
                     device, m, stage.owner, plan, transport=transport,
                     side_sizes=(0, 0) if aux is None else (aux.size, aux.back_size))
    # their mover (side_vectors.py), from the stage; each micro-batch's share of the step's
    # objective, 1 / (dp x m), weighs their loss term
    side = stage.side_vectors(link, hooks.wait, 1.0 / (pgm.dp.size * m), device)
    store = stage.weight_grads                  # a WeightGradStore when the backward is split
    split = any(a.kind == "W" for a in order)
    if split and store is None:
        raise ValueError("this schedule has W actions, but the stage's backward is not split: build it "
                         "with build_stage(..., schedule=<zb_h1 | zbv>)")
    # this rank's last gradient action; a W computes none where nothing is deferred (a frozen base)
    final = max(i for i, a in enumerate(order) if a.kind in ("BW" if split and store.defers() else "B"))
    saved: Dict[tuple, tuple] = {}              # (chunk, micro) -> (input, output) awaiting backward
    loss = torch.zeros((), dtype=torch.float64, device=device)
    hooks.step_begins("W" if split else "B", store if split else None)
    for i, a in enumerate(order):
        link.post(i)                            # the exchanges due before this action (p2p.py)
        mb, vs, key = micro_batches[a.micro], stage.virtual[a.chunk], (a.chunk, a.micro)
        if a.kind == "F":
            # receive h (the ids on the first virtual stage), compute, send h on (or keep the loss)
            x, out = _forward(stage, link, hooks, side, a, mb, num_items_in_batch, autocast, grad=True)
            if stage.is_last_virtual(a.chunk):
                loss += out.detach().double()
            saved[key] = (x, out)
        elif a.kind == "B":
            # receive dL/dh (none on the last virtual stage), backward, send dL/dx back
            x, out = saved.pop(key)
            grad = None if stage.is_last_virtual(a.chunk) else \
                hooks.wait(link.recv_backward, vs, a.micro).to(out.dtype)
            outs, grads = [out], [grad]
            side.before_backward(a.chunk, a.micro, outs, grads)
            hooks.before_backward(a, i == final)
            t = time.perf_counter()
            with store.inputs_only(key) if split else contextlib.nullcontext():
                torch.autograd.backward(outs, grads)
            hooks.computed(a, t, time.perf_counter())
            if not stage.is_first_virtual(a.chunk):
                link.send_backward(x.grad, vs - 1, a.micro)
            del x, out, outs
        else:
            # W: the weight gradients B deferred (split_backward.py); nothing moves
            hooks.before_backward(a, i == final)
            t = time.perf_counter()
            store.weight_grads(key)
            hooks.computed(a, t, time.perf_counter())
    link.post(len(order))
    link.finish()
    hooks.step_ends()
    if saved or (split and store.pending()):
        raise RuntimeError(f"pipeline schedule left micro-batches without a backward: {sorted(saved)}, "
                           f"or without W: {store.pending() if split else []}")
    return loss


def _forward(stage, link, hooks, side, a: Action, mb: dict, num_items_in_batch, autocast, grad: bool):
    """F(c, m): h received (the ids on the first virtual stage), the chunk run, h sent on unless the
    chunk is the last virtual stage; returns (x, out), out the loss there."""
    vs = stage.virtual[a.chunk]
    x = mb["input_ids"] if stage.is_first_virtual(a.chunk) else hooks.wait(link.recv_forward, vs, a.micro)
    if grad and not stage.is_first_virtual(a.chunk):
        x.requires_grad_()
    t = time.perf_counter()
    with autocast():
        out = stage(x, mb["position_ids"], labels=mb["labels"], num_items_in_batch=num_items_in_batch,
                    chunk=a.chunk, document_ids=mb.get("document_ids"))
    if side is not None:                        # forward_only carries no side vector (no aux loss)
        out = side.after_forward(a.chunk, a.micro, out)
    hooks.computed(a, t, time.perf_counter())
    if not stage.is_last_virtual(a.chunk):
        link.send_forward(out, vs + 1, a.micro)
    return x, out


@torch.no_grad()
def forward_only(stage, pgm, micro_batches, num_items_in_batch, *, act_dtype: torch.dtype = torch.float32,
                 autocast=contextlib.nullcontext, transport=comm) -> torch.Tensor:
    """Evaluation: the forwards alone of micro_batches (a list of M; one dict is M = 1), pipelined in
    schedules.forward_order (the forward half of AFAB: rank s runs micro-batch i while rank s + 1
    runs i - 1), the exchanges the stage's (stage.forward_plan(M)). num_items_in_batch: one value
    for all, or a list of one per micro-batch (batches of different token counts), each handed to
    the head unchanged. Returns each micro-batch's loss share, float64 (M,) (0-d for one dict); zero
    off the last stage. No backward state: nothing is kept past its send, no aux side vector."""
    one = isinstance(micro_batches, dict)
    micro = [micro_batches] if one else list(micro_batches)
    m, p, v = len(micro), pgm.pp.size, stage.num_chunks
    many = isinstance(num_items_in_batch, (list, tuple))
    items = list(num_items_in_batch) if many else [num_items_in_batch] * m
    if not m or len(items) != m:
        raise ValueError(f"forward_only: {m} micro-batches and {len(items)} num_items_in_batch values: pass "
                         f"at least one micro-batch, and one value for all or one per micro-batch")
    shapes = [activation_shape(mb, pgm, stage.config.hidden_size, stage.sequence_parallel) for mb in micro]
    device = micro[0]["input_ids"].device
    link = StageLink(pgm, shapes, act_dtype, device, m, stage.owner, stage.forward_plan(m),
                     transport=transport)
    hooks = ScheduleHooks()
    losses = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(m)]
    order = forward_order(stage.schedule, p, m, pgm.pp.rank, v)
    for i, a in enumerate(order):
        link.post(i)
        _, out = _forward(stage, link, hooks, None, a, micro[a.micro], items[a.micro], autocast, grad=False)
        if stage.is_last_virtual(a.chunk):
            losses[a.micro] += out.double()
        del out                                 # h is in the link's outbox (detached) until posted
    link.post(len(order))
    link.finish()
    return losses[0] if one else torch.stack(losses)
