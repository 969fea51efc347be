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

A model whose loss needs more than h between stages declares it (stage.pipeline_aux: an MoE's
load-balancing loss); its small side vectors ride with h and dL/dh (side_vectors.py): the
executor calls side.after_forward after each F and side.before_backward before each B, and
knows nothing of what they hold.

A stage keeps (x, out) and everything autograd saved between F(c, m) and B(c, m), and the
linears' inputs and output gradients until W(c, m): that is the activation memory the schedules
differ in (schedules.py). Only receives block, so a rank waits
exactly when the data it needs has not been computed yet: the bubble.

Gradient accumulation over the m micro-batches: parameters used by several micro-batches add up
their gradients. Data parallelism must reduce once per step, not per micro-batch: the caller's
hooks (hooks.py, ScheduleHooks.before_backward(action, last)), called before every B and W, learn
which is this rank's last gradient action of the step (the last W under a zero-bubble schedule,
the last B where its W's have nothing to compute, a frozen base's: the caller keeps DDP and
ZeRO-3 in no_sync until then, and that action's gradients trigger their reduction of everything,
once). The loss (sum over micro-batches of sum / num_items_in_batch) is returned on the last
stage, zero elsewhere: the caller sums it over dp_cp and pp. The same hooks see every receive
(wait) and every compute (computed): the benchmark's Recorder (hooks.py) draws and measures them.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional

import torch

from .. import comm
from .hooks import ScheduleHooks
from .p2p import StageLink, activation_shape, exchange_plan, forward_plan
from .schedules import Action, schedule_order
from .side_vectors import NoSide, SideVectors, side_sizes


def run_schedule(stage, order: List[Action], pgm, micro_batches: List[Dict[str, torch.Tensor]],
                 num_items_in_batch, *, act_dtype: torch.dtype = torch.float32,
                 hooks: Optional[ScheduleHooks] = None, autocast=contextlib.nullcontext,
                 plan: Optional[list] = None, transport=comm) -> torch.Tensor:
    """One training step's forwards and backwards of `stage` in the order `order`; returns this
    rank's share of the loss (a float64 0-d tensor; zero off the last stage). hooks: what the
    caller adds (hooks.py; None: nothing); plan: this rank's exchanges (p2p.exchange_plan; None:
    computed here for the stage's schedule, whose order `order` must then be); transport: what
    posts and waits (comm; a test may record through it)."""
    m, hooks = len(micro_batches), hooks if hooks is not None else ScheduleHooks()
    device = micro_batches[0]["input_ids"].device
    aux = stage.pipeline_aux                    # the model's side vectors, or None
    if plan is None:
        plan = _own_plan(stage, order, pgm, m, side=aux is not None)
    link = StageLink(pgm, activation_shape(micro_batches[0], pgm, stage.config.hidden_size,
                                           stage.sequence_parallel), act_dtype,
                     device, m, stage.owner, plan, side_sizes=side_sizes(aux), transport=transport)
    # each micro-batch's share of the step's objective weighs the side vectors' loss term
    side = NoSide() if aux is None else SideVectors(stage, link, hooks.wait, 1.0 / (pgm.dp.size * m), device)
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
            x = mb["input_ids"] if stage.is_first_virtual(a.chunk) else \
                hooks.wait(link.recv_forward, vs, a.micro).requires_grad_()
            t = time.perf_counter()
            with autocast():
                out = stage(x, mb["position_ids"], labels=mb["labels"], num_items_in_batch=num_items_in_batch,
                            chunk=a.chunk, document_ids=mb.get("document_ids"))
            out = side.after_forward(a.chunk, a.micro, out)
            hooks.computed(a, t, time.perf_counter())
            if stage.is_last_virtual(a.chunk):
                loss += out.detach().double()
            else:
                link.send_forward(out, vs + 1, a.micro)
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


def _own_plan(stage, order: List[Action], pgm, m: int, side: bool) -> list:
    """The exchanges of `order`, which must be the stage's own schedule's (p2p.exchange_plan)."""
    p, v = pgm.pp.size, stage.num_chunks
    if list(order) != schedule_order(stage.schedule, p, m, pgm.pp.rank, v):
        raise ValueError(f"run_schedule: this order is not {stage.schedule}'s for pp {p}, m {m}: pass "
                         f"plan=p2p.plan_exchanges(<every rank's order>, ...)[rank]")
    return exchange_plan(stage.schedule, p, m, v, pgm.pp.rank, side=side)


@torch.no_grad()
def forward_only(stage, pgm, micro_batch: Dict[str, torch.Tensor], num_items_in_batch, *,
                 act_dtype: torch.dtype = torch.float32, autocast=contextlib.nullcontext,
                 transport=comm) -> torch.Tensor:
    """Evaluation: one micro-batch through every virtual stage, no backward; returns this rank's
    loss share (float64; zero off the last stage)."""
    plan = forward_plan(stage.schedule, pgm.pp.size, stage.num_chunks, pgm.pp.rank)
    shape = activation_shape(micro_batch, pgm, stage.config.hidden_size, stage.sequence_parallel)
    link = StageLink(pgm, shape, act_dtype, micro_batch["input_ids"].device, 1, stage.owner, plan,
                     transport=transport)
    loss = torch.zeros((), dtype=torch.float64, device=micro_batch["input_ids"].device)
    for chunk in range(stage.num_chunks):     # in order of virtual stage on every placement
        link.post(chunk)
        vs = stage.virtual[chunk]
        x = micro_batch["input_ids"] if stage.is_first_virtual(chunk) else link.recv_forward(vs, 0)
        with autocast():
            out = stage(x, micro_batch["position_ids"], labels=micro_batch["labels"],
                        num_items_in_batch=num_items_in_batch, chunk=chunk,
                        document_ids=micro_batch.get("document_ids"))
        if stage.is_last_virtual(chunk):
            loss += out.double()
        else:
            link.send_forward(out, vs + 1, 0)
    link.post(stage.num_chunks)
    link.finish()
    return loss
