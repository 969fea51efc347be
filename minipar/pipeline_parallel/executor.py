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
load-balancing loss pools the routing counts of all layers, models/moe_aux.py): after F a small
side vector goes on with h (each stage adds its part; the last adds the loss term), and after B
the vector the earlier stages' gradient terms need goes back with dL/dh; the executor only passes
them on and adds the model's term to each backward.

A stage keeps (x, out) and everything autograd saved between F(c, m) and B(c, m), and the
linears' inputs and output gradients until W(c, m): that is the activation memory the schedules
differ in (schedules.py). Only receives block, so a rank waits
exactly when the data it needs has not been computed yet: the bubble.

Gradient accumulation over the m micro-batches: parameters used by several micro-batches add up
their gradients. Data parallelism must reduce once per step, not per micro-batch: the caller's
`before_backward(action, last)` hook, called before every B and W, learns which is this rank's
last gradient action of the step (the last W under a zero-bubble schedule, the last B where its
W's have nothing to compute, a frozen base's: the caller keeps DDP and ZeRO-3 in no_sync until
then, and that action's gradients trigger their reduction of everything, once). The
loss (sum over micro-batches of sum / num_items_in_batch) is returned on the last stage, zero
elsewhere: the caller sums it over dp_cp and pp.

`recorder`, when given, receives (action, start, end) of every compute with wall-clock times, the
spans this rank sat blocked in a receive (its real bubble: waiting for a neighbour) and the count
of live micro-batch chunks: what benchmarks/bench_pp.py draws and measures. What is neither compute
nor waiting is the executor's own time (posting sends, Python between actions).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, List, Optional

import torch

from .. import comm
from .p2p import StageLink, activation_shape, exchange_plan, forward_plan
from .schedules import Action, schedule_order


class Recorder:
    """What a step really did on this rank: compute events and the peak of live activations.
    Times are seconds after t0, the step's start (perf_counter: one clock for every process of
    a machine, so the ranks' rows can be drawn on one axis); t_end is when the step returned."""

    def __init__(self):
        self.events: List[tuple] = []           # (kind, chunk, micro, start, end)
        self.waits: List[tuple] = []            # (start, end) blocked in a receive
        self.live = self.peak_live = 0
        self.peak_held_w = 0                    # bytes the split backward kept for W, at most
        self.t0 = self.t_end = None

    def start(self):
        self.t0 = time.perf_counter()
        self.events, self.waits, self.live, self.peak_live, self.peak_held_w = [], [], 0, 0, 0

    def stop(self):
        self.t_end = time.perf_counter() - self.t0

    def waited(self, receive: Callable, *args):
        """receive(*args), its span kept as waiting."""
        t = time.perf_counter()
        out = receive(*args)
        self.waits.append((t - self.t0, time.perf_counter() - self.t0))
        return out

    def note(self, a: Action, start: float, end: float, freed_by: str = "B"):
        self.live += 1 if a.kind == "F" else -1 if a.kind == freed_by else 0
        self.peak_live = max(self.peak_live, self.live)
        self.events.append((a.kind, a.chunk, a.micro, start - self.t0, end - self.t0))


def run_schedule(stage, order: List[Action], pgm, micro_batches: List[Dict[str, torch.Tensor]],
                 num_items_in_batch, *, act_dtype: torch.dtype = torch.float32,
                 before_backward: Optional[Callable[[Action, bool], None]] = None,
                 autocast=contextlib.nullcontext, recorder: Optional[Recorder] = None,
                 plan: Optional[list] = None, transport=comm) -> torch.Tensor:
    """One training step's forwards and backwards of `stage` in the order `order`; returns this
    rank's share of the loss (a float64 0-d tensor; zero off the last stage). plan: this rank's
    exchanges (p2p.exchange_plan; None: computed here for the stage's schedule, whose order `order`
    must then be); transport: what posts and waits (comm; a test may record through it)."""
    m = len(micro_batches)
    device = micro_batches[0]["input_ids"].device
    aux = stage.pipeline_aux                    # the model's side vectors, or None
    aux_weight = 1.0 / (pgm.dp.size * m)        # each micro-batch's share of the step's objective
    if plan is None:
        p, v = pgm.pp.size, stage.num_chunks
        if list(order) != schedule_order(stage.schedule, p, m, pgm.pp.rank, v):
            raise ValueError(f"run_schedule: this order is not {stage.schedule}'s for pp {p}, m {m}: pass "
                             f"plan=p2p.plan_exchanges(<every rank's order>, ...)[rank]")
        plan = exchange_plan(stage.schedule, p, m, v, pgm.pp.rank, side=aux is not None)
    link = StageLink(pgm, activation_shape(micro_batches[0], pgm, stage.config.hidden_size), act_dtype,
                     device, m, stage.owner, plan,
                     side_sizes=(aux.size, aux.back_size) if aux is not None else (0, 0), transport=transport)
    sides: Dict[tuple, tuple] = {}              # (chunk, micro) -> (this chunk's sums, back or None)
    store = stage.weight_grads                  # a WeightGradStore when the backward is split
    split = any(a.kind == "W" for a in order)
    if split and store is None:
        raise ValueError("this schedule has W actions, but the stage's backward is not split: build it "
                         "with build_stage(..., schedule=<zb_h1 | zbv>)")
    freed_by = "W" if split else "B"
    # this rank's last gradient action; a W computes none where nothing is deferred (a frozen base)
    final = max(i for i, a in enumerate(order) if a.kind in ("BW" if split and store.defers() else "B"))
    saved: Dict[tuple, tuple] = {}              # (chunk, micro) -> (input, output) awaiting backward
    loss = torch.zeros((), dtype=torch.float64, device=device)
    if recorder is not None:
        recorder.start()
    recv = recorder.waited if recorder is not None else (lambda receive, *args: receive(*args))
    for i, a in enumerate(order):
        link.post(i)                            # the exchanges due before this action (p2p.py)
        vs, mb = stage.virtual[a.chunk], micro_batches[a.micro]
        if a.kind == "W":
            if before_backward is not None:
                before_backward(a, i == final)
            t = time.perf_counter()
            store.weight_grads((a.chunk, a.micro))
            if recorder is not None:
                recorder.note(a, t, time.perf_counter(), freed_by)
        elif a.kind == "F":
            if stage.is_first_virtual(a.chunk):
                x = mb["input_ids"]
            else:
                x = recv(link.recv_forward, vs, a.micro).requires_grad_()
            t = time.perf_counter()
            with autocast():
                out = stage(x, mb["position_ids"], labels=mb["labels"], num_items_in_batch=num_items_in_batch,
                            chunk=a.chunk, document_ids=mb.get("document_ids"))
            if aux is not None:                 # the side vector: received, this chunk's part added
                side = torch.zeros(aux.size, device=device) if stage.is_first_virtual(a.chunk) \
                    else recv(link.recv_side_forward, vs, a.micro)
                side, sums = aux.forward_side(stage.chunk_layers(a.chunk), side)
                back = None
                if stage.is_last_virtual(a.chunk):
                    term, back = aux.last(side, sums, aux_weight)
                    out = out + term
                sides[(a.chunk, a.micro)] = (sums, back)
            if recorder is not None:
                recorder.note(a, t, time.perf_counter(), freed_by)
            if stage.is_last_virtual(a.chunk):
                loss += out.detach().double()
            else:
                link.send_forward(out, vs + 1, a.micro)
                if aux is not None:
                    link.send_side_forward(side, vs + 1, a.micro)
            saved[(a.chunk, a.micro)] = (x, out)
        else:
            x, out = saved.pop((a.chunk, a.micro))
            grad = None if stage.is_last_virtual(a.chunk) else \
                recv(link.recv_backward, vs, a.micro).to(out.dtype)
            outs, grads = [out], [grad]
            if aux is not None:
                sums, back = sides.pop((a.chunk, a.micro))
                if back is None:                # an earlier stage: the counts of all layers came back
                    back = recv(link.recv_side_backward, vs, a.micro)
                    if sums is not None:
                        outs.append(aux.earlier(back, sums, aux_weight))
                        grads.append(None)
            if before_backward is not None:
                before_backward(a, i == final)
            t = time.perf_counter()
            with store.inputs_only((a.chunk, a.micro)) if split else contextlib.nullcontext():
                torch.autograd.backward(outs, grads)
            if recorder is not None:
                recorder.note(a, t, time.perf_counter(), freed_by)
                if split:
                    recorder.peak_held_w = max(recorder.peak_held_w, store.held_bytes())
            if not stage.is_first_virtual(a.chunk):
                link.send_backward(x.grad, vs - 1, a.micro)
                if aux is not None:
                    link.send_side_backward(back, vs - 1, a.micro)
            del x, out, outs
    link.post(len(order))
    link.finish()
    if recorder is not None:
        recorder.stop()
    if saved or (split and store.pending()):
        raise RuntimeError(f"pipeline schedule left micro-batches without a backward: {sorted(saved)}, "
                           f"or without W: {store.pending() if split else []}")
    return loss



@torch.no_grad()
def forward_only(stage, pgm, micro_batch: Dict[str, torch.Tensor], num_items_in_batch, *,
                 act_dtype: torch.dtype = torch.float32, autocast=contextlib.nullcontext,
                 transport=comm) -> torch.Tensor:
    """Evaluation: one micro-batch through every virtual stage, no backward; returns this rank's
    loss share (float64; zero off the last stage)."""
    plan = forward_plan(stage.schedule, pgm.pp.size, stage.num_chunks, pgm.pp.rank)
    link = StageLink(pgm, activation_shape(micro_batch, pgm, stage.config.hidden_size), act_dtype,
                     micro_batch["input_ids"].device, 1, stage.owner, plan, transport=transport)
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
