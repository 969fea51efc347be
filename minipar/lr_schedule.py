"""Learning-rate schedules: the multiplier of the base rate at each optimizer step.

The schedule: linear warmup from lr/warmup to lr over `warmup_steps`, then half a cosine down to
min_lr_ratio * lr at `max_steps` (the shape of Llama's and nanotron's recipes); or, by the HF
Trainer's lr_scheduler names, a straight line down (linear), flat after the warmup
(constant_with_warmup) or flat from the start (constant): SCHEDULES. A resume with another
max_steps (warmup_steps, min_lr_ratio) follows THIS run's schedule from the checkpoint's step on,
as the Hugging Face Trainer does (adopt_schedule says why and how).

Each schedule is a callable object, not a lambda, so torch's LambdaLR.state_dict() saves its
settings and a resumed run continues at exactly the same multiplier. No communication.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


class WarmupCosine:
    """lr multiplier of step s (0-based optimizer steps taken before this one):

        s < W:          (s + 1) / W                                       linear warmup
        W <= s:         m + (1 - m) * (1 + cos(pi * p)) / 2,  p = min(1, (s - W) / (S - W))

    A callable object (not a lambda), so LambdaLR.state_dict() saves its settings and a resumed run
    continues at exactly the same multiplier.
    """

    def __init__(self, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1):
        if warmup_steps < 0 or max_steps < 1:
            raise ValueError(f"warmup_steps ({warmup_steps}) must be >= 0 and max_steps ({max_steps}) >= 1")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")
        self.warmup_steps, self.max_steps = int(warmup_steps), int(max_steps)
        self.min_lr_ratio = float(min_lr_ratio)

    def __call__(self, step: int) -> float:
        w, s, m = self.warmup_steps, self.max_steps, self.min_lr_ratio
        if step < w:
            return (step + 1) / w
        progress = min(1.0, (step - w) / max(1, s - w))
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupLinear(WarmupCosine):
    """lr_scheduler linear (the HF Trainer's): the same warmup, then a straight line from 1 to
    min_lr_ratio (0 in HF's) at max_steps."""

    def __call__(self, step: int) -> float:
        w, s, m = self.warmup_steps, self.max_steps, self.min_lr_ratio
        if step < w:
            return (step + 1) / w
        return m + (1.0 - m) * (1.0 - min(1.0, (step - w) / max(1, s - w)))


class WarmupConstant(WarmupCosine):
    """lr_scheduler constant_with_warmup: the same warmup, then 1 to the end."""

    def __call__(self, step: int) -> float:
        return (step + 1) / self.warmup_steps if step < self.warmup_steps else 1.0


class Constant(WarmupCosine):
    """lr_scheduler constant (the HF Trainer's): 1 from the first step, no warmup (HF ignores it too)."""

    def __call__(self, step: int) -> float:
        return 1.0


# lr_scheduler (Axolotl's / the HF Trainer's names) -> the multiplier; cosine_with_min_lr is cosine
# down to min_lr_ratio, which minipar's cosine always is (HF's plain cosine is min_lr_ratio 0)
SCHEDULES = {"cosine": WarmupCosine, "cosine_with_min_lr": WarmupCosine, "linear": WarmupLinear,
             "constant": Constant, "constant_with_warmup": WarmupConstant}


def make_schedule(kind: str, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1) -> WarmupCosine:
    """The multiplier object of lr_scheduler `kind` (one of SCHEDULES)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler {kind!r} is not supported; supported: {list(SCHEDULES)}")
    return SCHEDULES[kind](warmup_steps, max_steps, min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int,
                    min_lr_ratio: float = 0.1, kind: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over the schedule `kind` (WarmupCosine by default); call scheduler.step() after each
    optimizer.step(). Its state_dict() / load_state_dict() resume it exactly (callable objects)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, make_schedule(kind, warmup_steps, max_steps,
                                                                      min_lr_ratio))


SCHEDULE_KEYS = ("warmup_steps", "max_steps", "min_lr_ratio")


def adopt_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, warmup_steps: int, max_steps: int,
                   min_lr_ratio: float = 0.1, kind: str = "cosine") -> Optional[str]:
    """Call after scheduler.load_state_dict(checkpoint): keep the checkpoint's position (last_epoch,
    base_lrs) but THIS run's schedule, and return a note naming what changed (None if nothing did).

    Why it is needed: LambdaLR.state_dict() saves a callable object's __dict__, and load_state_dict()
    writes it back into the lambda, so WarmupCosine would come back with the checkpoint's max_steps:
    raised on resume, the rate would sit at its minimum past the old end, with no word.

    The reference, the Hugging Face Trainer (transformers/trainer.py: create_scheduler, then
    _load_optimizer_and_scheduler): it builds the scheduler from the NEW arguments
    (num_training_steps = the new max_steps) and then loads the saved scheduler state. Its lambda is
    a functools.partial (transformers/optimization.py), whose __dict__ is empty, so loading restores
    last_epoch and base_lrs only: from the checkpoint's step on the rate is the new schedule's. So
    here. One difference: HF's first resumed step still uses the rate the optimizer state saved (the
    old schedule's); minipar sets the group's rate now, so steps s+1.. are a fresh run's exactly.
    """
    new = make_schedule(kind, warmup_steps, max_steps, min_lr_ratio)
    old = scheduler.lr_lambdas[0]
    changed = [f"{k} {getattr(old, k, None)} -> {getattr(new, k)}" for k in SCHEDULE_KEYS
               if getattr(old, k, None) != getattr(new, k)]
    if not changed:
        return None
    scheduler.lr_lambdas = [new] * len(scheduler.lr_lambdas)
    lrs = [base * new(scheduler.last_epoch) for base in scheduler.base_lrs]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        if isinstance(group["lr"], torch.Tensor):     # a tensor lr (capturable/fused) is updated in place
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    scheduler._last_lr = lrs                          # what get_last_lr() answers
    return (f"note: resumed at step {scheduler.last_epoch} with {', '.join(changed)} (checkpoint -> this "
            f"run): the learning-rate schedule is rebuilt for this run's settings from that step on, as "
            f"the Hugging Face Trainer does")
