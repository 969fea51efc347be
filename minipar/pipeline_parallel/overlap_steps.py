"""Stages that step alone (pipeline_overlap_steps): the next step's pipeline fill under this one's
drain, at the price of a log that comes a step late.

A synchronous step ends with the loss and the gradient norm summed over pp, so every stage waits
for the slowest and each step starts from an empty pipeline, paying its fill. Without clipping a
stage needs nothing of the others to update its own layers: it steps at once and runs the next
step's schedule, whose sends wait for the neighbour's receives, and the next fill overlaps this
one's drain (zbv's whole bubble at t_F = t_B = t_W; simulate.py).

    step k      schedule k (the caller's: forwards, backwards, gradients reduced over dp)
                sq = this stage's squared gradient norm (optim.stage_grad_sq: over tp, dp_shard_cp)
                update now (AdamW, the schedule, zero_grad)
                [loss, sq] / (ranks of the stage) all-reduced over the WORLD, started, not waited
    later       pending(): waits for it, gives (loss, grad_norm) (read by the train loop a step late)

The world's group, not pp's, so that on NCCL it queues behind no send; each rank's share is divided
by the ranks of its stage, which all hold it. The updates are the synchronous run's; only the log
comes later. With clipping (max_grad_norm > 0) the update is optimistic and post_validate.py checks
it once the norm has arrived, after the next step's schedule, redoing both when clipping was due
(settle() checks the last step before a save, an evaluation or the end).

Communication per step: one all-reduce of 2 float64 over the world, in the background.
"""
from __future__ import annotations

from typing import Callable

import torch

from minipar import comm
from minipar.optim import OptimizerStep, stage_grad_sq

from .post_validate import PostValidator


class OverlapSteps:
    """One step of a stage that steps alone: `schedule(n_items, micro)` runs the stage's schedule
    (gradients reduced, the loss summed over dp_cp), `tail` is the optimizer's step."""

    def __init__(self, schedule: Callable, tail: OptimizerStep, params: Callable, pgm):
        self.schedule, self.tail, self.params, self.pgm = schedule, tail, params, pgm
        self.validator = PostValidator(tail.optimizer, tail.scheduler, tail.max_grad_norm, tail.update) \
            if tail.max_grad_norm else None
        self.in_flight = None                     # (work, sums) of the last optimistic update, unchecked

    def __call__(self, n_items, micro) -> dict:
        loss = self.schedule(n_items, micro)
        if self.in_flight is not None and self._check():
            loss = self.schedule(n_items, micro)  # its gradients came from weights now redone
        pgm = self.pgm
        sq = stage_grad_sq(self.params(), pgm)
        if self.validator is not None:            # what the optimistic update changes, to undo it
            self.validator.keep()
        lr = self.tail.update()
        shares = torch.stack([loss.to(sq.device, sq.dtype), sq]) / (pgm.world.size // pgm.pp.size)
        work = comm.all_reduce(shares, pgm.world, async_op=True)
        if self.validator is not None:
            self.in_flight = (work, shares)

        def pending() -> dict:                    # device tensors, read where logged (train_loop.py)
            work.wait()
            return dict(loss=shares[0], grad_norm=shares[1].sqrt().float())   # as optim.py's
        return dict(lr=lr, moe={}, pending=pending)

    def _check(self) -> bool:
        """Post-validation of the last optimistic update: wait for its norm (started a step ago),
        redo it clipped if clipping was due; True when it was redone."""
        (work, sums), self.in_flight = self.in_flight, None
        work.wait()
        return self.validator.check(sums[1].sqrt().float())

    def settle(self) -> None:
        """Check the last update now (before a save, an evaluation, the end): nothing ran on it yet."""
        if self.in_flight is not None:
            self._check()
