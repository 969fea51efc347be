"""What a mixture of experts adds to a step's record in metrics.jsonl: its aux loss, how evenly the
router spread the tokens, and how many copies a capacity factor dropped.

Each forward of an MoE model leaves `model.moe_metrics` (models/moe_aux.py): the micro-batch's aux
loss and its (L, E) counts of routed copies per MoE layer and expert (both already summed over cp,
and over tp under sequence parallelism, so the same on those ranks), and the copies this rank
dropped. A step adds them up over its M micro-batches, then one all-reduce over dp_cp sums them
over the dp ranks (each dp rank's micro-batches are other micro-batches of the global batch; the
cp ranks hold equal aux and counts, so those sums are divided by cp, and their own drops, which are
summed):

    moe_aux_loss     mean over the G = dp * M micro-batches of their aux loss (the objective adds
                     router_aux_loss_coef times it to the cross-entropy)
    moe_imbalance    per MoE layer, max_e / mean_e of the copies routed to expert e over the
                     global batch: 1.0 is perfectly even, E is everything on one expert
    moe_dropped      copies dropped past capacity in the step (0 when dropless)

(summed over tp too under sequence parallelism, where each tp rank routes its own tokens). The
figures do not depend on the layout, except moe_dropped under cp or sequence parallelism, where
the capacity is a rank's (models/moe.py). Under pipeline parallelism models/moe_aux.py's
PipelineAux sums the same figures over the stages (when the aux loss is on).
"""
from __future__ import annotations

from typing import Optional

import torch

from minipar import comm
from minipar.mesh import ProcessGroupManager


class MoEStepMetrics:
    """Sums a step's micro-batch figures; `reduce()` -> the record's entries (collective over dp_cp)."""

    def __init__(self, pgm: ProcessGroupManager, device):
        self.pgm, self.device = pgm, device
        # each tp rank routed (and dropped) its own tokens under sequence parallelism: read once here
        self.sp = pgm.config.sequence_parallel and pgm.tp.size > 1
        self.total: Optional[torch.Tensor] = None
        self.micro_batches, self.layers = 0, 0

    def add(self, metrics: Optional[dict]) -> None:
        if metrics is None:                         # a dense model
            return
        row = torch.cat([metrics["aux_loss"].detach().reshape(1).double(),
                         metrics["counts"].detach().reshape(-1).double(),
                         torch.full((1,), float(metrics["dropped"]), dtype=torch.float64,
                                    device=metrics["counts"].device)])         # a fill, not a copy
        self.total = row if self.total is None else self.total + row
        self.micro_batches += 1
        self.layers = metrics["counts"].shape[0]

    def reduce(self) -> dict:
        """The record's entries as device tensors (0-d, (L,), 0-d): the train loop reads them with
        the loss where it logs, and `finish` gives them their final form, so a step reads none."""
        if self.total is None:
            return {}
        pgm, total = self.pgm, self.total
        comm.all_reduce(total, pgm.dp_cp)
        if self.sp:                             # each tp rank dropped its own tokens'
            total[-1:] = comm.all_reduce(total[-1:].clone(), pgm.tp)
        cp = pgm.cp.size
        aux = total[0] / cp / (self.micro_batches * pgm.dp.size)
        counts = total[1:-1].view(self.layers, -1) / cp
        imbalance = counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)
        self.total, self.micro_batches = None, 0
        return dict(moe_aux_loss=aux, moe_imbalance=imbalance, moe_dropped=total[-1])


def finish(record: dict) -> dict:
    """An MoE record's entries once read (floats): the imbalance rounded, the drops an int."""
    if isinstance(record.get("moe_imbalance"), list):
        record["moe_imbalance"] = [round(x, 6) for x in record["moe_imbalance"]]
    if isinstance(record.get("moe_dropped"), float):
        record["moe_dropped"] = int(round(record["moe_dropped"]))
    return record
