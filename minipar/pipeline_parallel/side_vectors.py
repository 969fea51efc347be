"""Side vectors: what a model's loss needs carried between pipeline stages besides h.

A model declares it as stage.pipeline_aux (an MoE's load-balancing loss pools the routing counts of
all L layers, so every stage's gradient needs the counts of the later ones: models/moe_aux.py
computes the vectors; this file only moves them). Per micro-batch and stage boundary:

    after F(c, m)   side (aux.size,) fp32: received with h (zeros on the first virtual stage), this
                    chunk's counts and sums added (aux.forward_side), sent on with h; on the last
                    virtual stage aux.last turns it into the loss term (added to the loss) and `back`
    before B(c, m)  back (aux.back_size,) fp32: received with dL/dh (made by aux.last on the last
                    virtual stage), this chunk's gradient term added to the backward
                    (aux.earlier, weighted by the micro-batch's share of the objective), and sent
                    back with dL/dx

They ride in the same exchanges as h and dL/dh (p2p.py's SIDE_FORWARD / SIDE_BACKWARD tags, planned
with side=True), so they cost 2E + 1 and E + 1 floats per boundary and micro-batch, and no message
of their own. NoSide is the model without such a need: nothing received, added or sent. The stage
makes one or the other for each step (stage.py's PipelineStage.side_vectors) and hands it to the
executor, which calls it after each F and before each B.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import torch


class NoSide:
    """A model whose loss needs only h: no side vector."""

    def after_forward(self, chunk: int, micro: int, out: torch.Tensor) -> torch.Tensor:
        return out

    def before_backward(self, chunk: int, micro: int, outs: List, grads: List) -> None:
        pass


class SideVectors(NoSide):
    """The side vectors of one step of `stage` (its pipeline_aux), moved over `link` (p2p.StageLink);
    `wait` is the receive wrapper (executor.py's ScheduleHooks.wait); weight each micro-batch's share
    of the step's objective (1 / (dp x m))."""

    def __init__(self, stage, link, wait: Callable, weight: float, device):
        self.stage, self.aux, self.link, self.wait = stage, stage.pipeline_aux, link, wait
        self.weight, self.device = weight, device
        self.kept: Dict[tuple, Tuple] = {}        # (chunk, micro) -> (this chunk's sums, back or None)

    def after_forward(self, chunk: int, micro: int, out: torch.Tensor) -> torch.Tensor:
        """The side vector received, this chunk's part added and sent on; on the last virtual stage
        the loss term added to `out`. Returns out."""
        stage, aux, vs = self.stage, self.aux, self.stage.virtual[chunk]
        side = torch.zeros(aux.size, device=self.device) if stage.is_first_virtual(chunk) \
            else self.wait(self.link.recv_side_forward, vs, micro)
        side, sums = aux.forward_side(stage.chunk_layers(chunk), side)
        back = None
        if stage.is_last_virtual(chunk):
            term, back = aux.last(side, sums, self.weight)
            out = out + term
        else:
            self.link.send_side_forward(side, vs + 1, micro)
        self.kept[(chunk, micro)] = (sums, back)
        return out

    def before_backward(self, chunk: int, micro: int, outs: List, grads: List) -> None:
        """`back` received (an earlier stage), this chunk's gradient term appended to (outs, grads),
        and `back` sent on towards the first stage."""
        stage, vs = self.stage, self.stage.virtual[chunk]
        sums, back = self.kept.pop((chunk, micro))
        if back is None:                # an earlier stage: the counts of all layers came back
            back = self.wait(self.link.recv_side_backward, vs, micro)
            if sums is not None:
                outs.append(self.aux.earlier(back, sums, self.weight))
                grads.append(None)
        if not stage.is_first_virtual(chunk):
            self.link.send_side_backward(back, vs - 1, micro)
