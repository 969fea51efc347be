"""Post-validation (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 5): clipping by the
global gradient norm for pipeline stages that step alone (pipeline_overlap_steps, overlap_steps.py).

A stage that steps alone updates its own layers as soon as its last W of the step is done, and starts
the next step at once: that is what lets the next step's fill run under this one's drain. But
clipping scales every update by min(1, max_norm / ||g||), and ||g|| is the WHOLE model's norm, the
sum of every stage's squares, which the stage cannot know yet. So it updates optimistically, as if
no clipping were due, keeps what it needs to undo that, and checks once the norm has arrived:

    step k on one stage
        schedule k                 gradients g_k (its parameters' or ZeRO-3 shards' .grad)
        keep()                     the parameters, AdamW's state (m, v, step), the lr schedule, g_k
        update with g_k as it is   ||g_k||^2 summed over the world in the background
    step k + 1
        schedule k + 1             on the optimistic weights
        check(||g_k||)             coef = min(1, max_norm / (||g_k|| + 1e-6)), as clip_grad_norm_
            coef = 1               the update was the synchronous one: forget what was kept
            coef < 1               roll back: restore the parameters, AdamW's state and the schedule,
                                   update with coef x g_k (exactly the synchronous step's update),
                                   and the caller runs schedule k + 1 again, since its gradients came
                                   from weights that are now undone (its batch is a function of the
                                   step, so it is the same batch)

The norm's all-reduce was started a whole step earlier, so the check waits for nothing in the
steady state (every stage's step k ended before any stage's step k + 1 can). Every rank reads the
same norm, so every stage rolls back together and the schedules stay paired. A save, an evaluation
and the run's end check the last step first (no schedule has run on it yet, so no rerun).

What it costs: the kept copies, 16 bytes per element a rank's optimizer holds (fp32 parameter, m,
v, gradient; under ZeRO-3 its 1/N shards), copied every step; and one schedule run again for each
step whose update had to be clipped. Early in training, when most steps clip, that is about a
second schedule per step: the overlap then costs more than it hides, and the synchronous step (no
pipeline_overlap_steps) is the faster choice. The run's summary says how many updates were redone.
"""
from __future__ import annotations

import copy

import torch


class PostValidator:
    """keep() before an optimistic update, check(norm) once the norm arrives; `update` is the
    optimizer step's tail (OptimizerStep.update: AdamW, the schedule, zero_grad)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler, max_norm: float, update):
        self.optimizer, self.scheduler, self.max_norm, self.update = optimizer, scheduler, max_norm, update
        self.kept = None
        self.checked = self.redone = 0

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def keep(self) -> None:
        """Copy what an optimistic update changes, and the gradients it uses."""
        params = self._params()
        self.kept = dict(params=[p.detach().clone() for p in params],
                         grads=[None if p.grad is None else p.grad.detach().clone() for p in params],
                         optimizer=copy.deepcopy(self.optimizer.state_dict()),
                         scheduler=copy.deepcopy(self.scheduler.state_dict()))

    def check(self, norm: torch.Tensor) -> bool:
        """Validate the update kept last against the whole model's gradient norm; redo it clipped
        when clipping was due. True when it was redone (what ran on those weights must run again)."""
        kept, self.kept = self.kept, None
        self.checked += 1
        coef = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        if float(coef) >= 1.0:
            return False
        with torch.no_grad():
            for p, saved, grad in zip(self._params(), kept["params"], kept["grads"]):
                p.copy_(saved)
                p.grad = None if grad is None else grad.mul_(coef.to(grad.device))
        self.optimizer.load_state_dict(kept["optimizer"])
        self.scheduler.load_state_dict(kept["scheduler"])
        self.update()
        self.redone += 1
        return True

    def describe(self) -> str:
        return (f"post-validation (pipeline_overlap_steps with max_grad_norm {self.max_norm:g}): "
                f"{self.redone} of {self.checked} optimistic updates redone clipped, each with its next "
                f"step's schedule run again")
