"""The optimizer side of a step: AdamW with a layout-independent weight-decay rule and clipping by
the global gradient norm across shards (the learning-rate schedule: lr_schedule.py).
OptimizerStep runs them, in that order, at the end of every step (the plain one and the pipeline's).

Global-norm clipping (Pascanu et al., 2013) scales every gradient by min(1, max_norm / ||g||), with
||g|| the L2 norm over ALL gradient elements of the model. Under 4D parallelism no rank holds the
whole gradient, and some elements sit on several ranks. Each distinct element must be counted
once, so a rank sorts the squares of what it holds into four sums:

    what a rank holds                          sum of squares        counted over
    plain param, tp_split_dim = 0 / 1           plain_split          tp (each tp rank has one slice)
    plain param, tp_split_dim = None            plain_repl           nothing (identical on every rank)
    ZeRO-3 flat shard, tp_split_segments        shard_split          tp, then dp_shard_cp
    ZeRO-3 flat shard, the rest                 shard_repl           dp_shard_cp

    ||g||^2 = plain_repl + sum_tp plain_split + sum_dp_shard_cp (shard_repl + sum_tp shard_split)

and with pipeline parallelism that sum of one stage is summed over pp (the stages hold disjoint layers;
a tied embedding's copy on the last stage, marked `tied_copy`, is left out: pipeline_parallel/tied_ends.py).

A ZeRO-3 flat shard (attribute zero3_shard=True) is this rank's 1/N slice of a flat buffer that
concatenates a unit's local (already TP-sliced) parameters plus zero padding; its attribute
tp_split_segments lists the (start, stop) element ranges of the shard that belong to TP-split
weights. A replicated-over-dp copy (DDP, or HSDP across dp_replicate) holds the same gradient on
every replica after the gradient all-reduce, so it is counted once. Parameters without those
attributes count as replicated and unsharded.

Every sum of squares is taken and added in float64 (_sq), so the norm is the fp64 norm of the
fp32 gradients, whatever the layout cuts them into. Communication per step: one all-reduce of 2
numbers over tp, one of 1 number over dp_shard_cp and one of 1 number over pp (float64), then a
local scaling.

Weight decay. AdamW (Loshchilov & Hutter, 2019) decays decoupled from the gradient:
p <- p * (1 - lr * wd) before the Adam update. As in GPT-2 / Llama recipes, matrices are decayed and
1-D tensors (norm weights) are not. After ZeRO-3 every parameter is a 1-D flat shard, so the rule
cannot read p.ndim there: a flat shard carries `no_decay_segments`, the (start, stop) element
ranges of its shard that come from 1-D tensors. minipar's AdamW therefore applies the decay itself,
element range by element range, with torch's AdamW running at weight_decay=0, and keeps ONE
parameter group on every layout (simple to checkpoint and reshard). AdamW is elementwise, so the
parameters after N steps are the same on every layout.

bitsandbytes' 8-bit and paged optimizers, with the same decay (decay_): optim_bnb.py. The
learning-rate schedules are lr_schedule.py's.
"""
from __future__ import annotations

from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import comm


# ------------------------------------------------------------------------------ the optimizer
def complement(ranges: Sequence[Tuple[int, int]], n: int) -> List[Tuple[int, int]]:
    """The (start, stop) ranges of 0..n not covered by `ranges` (which may overlap, in any order)."""
    out, pos = [], 0
    for a, b in sorted((max(0, int(a)), min(n, int(b))) for a, b in ranges):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < n:
        out.append((pos, n))
    return out


def _no_decay_ranges(p: torch.Tensor) -> Optional[List[Tuple[int, int]]]:
    """Element ranges of p.view(-1) that are not decayed; None means all of p is decayed."""
    if getattr(p, "zero3_shard", False):
        if not hasattr(p, "no_decay_segments"):
            raise ValueError("a ZeRO-3 flat shard (zero3_shard=True) has no `no_decay_segments`: the shard "
                             "manager must list the ranges of 1-D tensors so that weight decay is the "
                             "same on every layout; or build the optimizer with weight_decay=0")
        return [(int(a), int(b)) for a, b in p.no_decay_segments] or None
    return [(0, p.numel())] if p.dim() < 2 else None


def decay_(group: dict) -> None:
    """Decoupled weight decay of one param group, p <- p * (1 - lr * wd) on the decayed ranges, by
    minipar's rule (matrices yes, 1-D tensors and ZeRO-3's no_decay_segments no); the rate is the
    group's `minipar_weight_decay`. Called before the inner optimizer's update (which runs at
    weight_decay 0), as torch's AdamW decays before its update: torch's AdamW here, bitsandbytes'
    AdamW, Lion and AdEMAMix in optim_bnb.py (their own decay is the same p * (1 - lr * wd))."""
    wd = group.get("minipar_weight_decay", 0.0)
    if wd == 0.0:
        return
    factor = 1.0 - float(group["lr"]) * wd
    for p in group["params"]:
        if p.grad is None:          # the optimizers skip such params entirely; so do we
            continue
        skip = _no_decay_ranges(p)
        if skip is None:
            p.mul_(factor)
            continue
        flat = p.view(-1)
        for a, b in complement(skip, flat.numel()):
            flat[a:b].mul_(factor)


class DecayThenStep:
    """Put before an optimizer class: each group's decoupled decay by minipar's rule (decay_), then
    that optimizer's own update (run at weight_decay 0). Used by AdamW below and by bitsandbytes'
    optimizers (optim_bnb.py)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay_(group)
        super().step()
        return loss


class AdamW(DecayThenStep, torch.optim.AdamW):
    """torch's AdamW at weight_decay=0, plus decoupled decay applied by minipar's rule (decay_).

    Each param group holds the rate as `minipar_weight_decay`, saved in state_dict with the group
    (a name of our own: torch >= 2.6 keeps a boolean `decoupled_weight_decay` in Adam's groups)."""


def trainable(model_or_params) -> list:
    """The parameters to optimize: a module's (or an iterable's) that require grad, each once."""
    params = model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module) else model_or_params
    params, seen = [p for p in params if p.requires_grad], set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


def decay_group(params: list, weight_decay: float) -> dict:
    """The one param group: its parameters and minipar's decay rate, checked now (a ZeRO-3 shard
    without no_decay_segments fails here, not at the first step)."""
    if weight_decay > 0:
        for p in params:
            _no_decay_ranges(p)
    return dict(params=params, minipar_weight_decay=float(weight_decay))


def build_optimizer(model_or_params, lr: float, weight_decay: float = 0.0,
                    betas: Tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, **kwargs) -> AdamW:
    """AdamW over the trainable parameters of a module (or an iterable of parameters), one group.
    Matrices are decayed, 1-D tensors are not (ZeRO-3 shards: by their no_decay_segments).
    bitsandbytes' 8-bit and paged optimizers: optim_bnb.py (build_named_optimizer takes any name)."""
    if lr <= 0 or weight_decay < 0:
        raise ValueError(f"learning_rate must be > 0 (got {lr}) and weight_decay >= 0 (got {weight_decay})")
    group = decay_group(trainable(model_or_params), weight_decay)
    return AdamW([group], lr=lr, betas=betas, eps=eps, weight_decay=0.0, **kwargs)


# the optimizers a config may name that torch runs (Axolotl's / the HF Trainer's `optimizer:`);
# bitsandbytes' 8-bit and paged ones: optim_bnb.py's BNB_OPTIMIZERS
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


def portable_state(optimizer) -> Mapping:
    """{param: {state name: tensor or number}}: the optimizer's state as checkpoints store it, every
    tensor shaped like its parameter (torch's AdamW: its own state; bitsandbytes': its block-quantised
    moments dequantised to fp32 under torch's names, optim_bnb.py)."""
    own = getattr(optimizer, "portable_state", None)
    return own() if own is not None else optimizer.state


def resume_group(current: dict, saved: dict) -> dict:
    """A param group on resume: the checkpoint's values (lr, betas, eps, the decay rate, ...) for
    the keys this optimizer's group has, of the same length where a sequence (AdEMAMix has three
    betas, AdamW two), and this optimizer's own for the rest; so a checkpoint of one optimizer
    (adamw_torch) loads into another (adamw_bnb_8bit) with the hyper-parameters each reads."""
    def fits(k):
        a, b = saved[k], current[k]
        return not isinstance(a, (tuple, list)) or (isinstance(b, (tuple, list)) and len(a) == len(b))
    out = {k: v for k, v in current.items() if k != "params"}
    out.update({k: saved[k] for k in saved if k in current and k != "params" and fits(k)})
    return out


# ------------------------------------------------------------------------ global-norm clipping
_CHUNK = 1 << 22        # elements cast to fp64 at a time: 32 MiB of temporary, whatever the shard


def _sq(x: torch.Tensor) -> torch.Tensor:
    """The sum of squares of x in fp64, chunk by chunk. Not torch's fp32 per-tensor norm: on CPU an
    fp32 vector_norm adds sequentially, and its error grows with the length (up to 2e-5 relative
    at 0.25 M elements, 1e-4 at 4 M), and a ZeRO-3 flat shard is a whole unit's share of the model,
    not one tensor. On a Llama of vocabulary 32000, width 256, over 2 ranks, fp32 norms of the
    shards came out 7.6e-5 below the fp64 norm (torch FSDP2's per-tensor fp32 norms 6.2e-5 below)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for chunk in x.detach().reshape(-1).split(_CHUNK):
        c = chunk.to(torch.float64)
        total = total + torch.dot(c, c)
    return total


def stage_grad_sq(params: Iterable[torch.Tensor], pgm) -> torch.Tensor:
    """The squared L2 norm of this pipeline stage's gradient (the whole model's without pp), each
    distinct element counted once; a 0-d float64 tensor, the same on every rank of the stage.
    Every rank of the stage must call it (it all-reduces over tp and dp_shard x cp)."""
    # (a tied embedding's copy on the last stage, `tied_copy`: counted on the first stage only,
    # pipeline_parallel/tied_ends.py)
    params = list({id(p): p for p in params if p.grad is not None and not getattr(p, "tied_copy", False)}
                  .values())
    if params:
        device = params[0].grad.device
    else:   # a rank holding no gradient still joins the all-reduces, on the backend's device
        nccl = dist.is_initialized() and "nccl" in str(dist.get_backend())
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float64, device=device)
    plain_split, plain_repl, shard_split, shard_repl = zero.clone(), zero.clone(), zero.clone(), zero.clone()
    for p in params:
        g = p.grad.detach()
        if getattr(p, "zero3_shard", False):
            flat = g.reshape(-1)
            segments = [(int(a), int(b)) for a, b in getattr(p, "tp_split_segments", ())]
            for a, b in segments:
                shard_split = shard_split + _sq(flat[a:b])
            for a, b in complement(segments, flat.numel()):   # TP-replicated elements and padding
                shard_repl = shard_repl + _sq(flat[a:b])
        elif getattr(p, "tp_split_dim", None) is not None:
            plain_split = plain_split + _sq(g)
        else:
            plain_repl = plain_repl + _sq(g)
    split = torch.stack([plain_split, shard_split])
    comm.all_reduce(split, pgm.tp)
    shard = shard_repl + split[1]
    comm.all_reduce(shard, pgm.dp_shard_cp)
    return plain_repl + split[0] + shard


def global_grad_norm(params: Iterable[torch.Tensor], pgm) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, each distinct element counted once; a 0-d
    float32 tensor, the same on every rank. Every rank must call it (it all-reduces)."""
    total = stage_grad_sq(params, pgm)
    pp = getattr(pgm, "pp", None)
    if pp is not None:                  # pipeline stages hold disjoint layers: their squares add up
        comm.all_reduce(total, pp)
    return total.sqrt().float()


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: Optional[float], pgm) -> torch.Tensor:
    """Scale all gradients by min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_
    does, with the norm taken over the whole distributed model; returns the norm before clipping.
    max_norm None or 0 only measures (for logging). A negative one is refused: here for any caller,
    and train.py's max_grad_norm with the config already, before step 1 (check.py)."""
    if max_norm is not None and max_norm < 0:
        raise ValueError(f"max_grad_norm must be >= 0 (0 or None: no clipping), got {max_norm}")
    params = list({id(p): p for p in params if p.grad is not None}.values())
    norm = global_grad_norm(params, pgm)
    if max_norm:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.device))
    return norm


# ----------------------------------------------------------------------------- the step's tail
class OptimizerStep:
    """The tail of every training step, plain or pipelined: clip by the global norm, AdamW, the
    schedule, zero_grad. Called once the step's gradients are reduced; returns grad_norm (before
    clipping; a 0-d tensor on the device, not read here: the train loop reads it with the loss
    where it logs, so a step does not wait for the GPU) and the lr the update used (read before
    the schedule moves it on)."""

    def __init__(self, model, optimizer: torch.optim.Optimizer, scheduler, max_grad_norm: Optional[float],
                 pgm):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.max_grad_norm, self.pgm = max_grad_norm, pgm

    def __call__(self) -> dict:
        grad_norm = clip_grad_norm_(self.model.parameters(), self.max_grad_norm, self.pgm)
        return dict(grad_norm=grad_norm, lr=self.update())

    def update(self) -> float:
        """AdamW, the schedule, zero_grad, on the gradients as they are (no norm, no clipping: what a
        pipeline stage that steps alone runs, pipeline_parallel/overlap_steps.py); returns the lr the
        update used."""
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr
