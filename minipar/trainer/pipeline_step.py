"""The training step when pipeline_parallel_size > 1: the model is this rank's stage, and one
optimizer step is a pipeline schedule over the step's micro-batches.

    global batch, num_items_in_batch        Batches, as in trainer.py: every rank of every stage
    micro-batches m = 0..M-1                 local_batch(dp, cp) as usual: every stage reads the
                                             same ones (the sampler only knows the dp coordinates)
    run_schedule(stage, order)               afab | 1f1b | interleaved_1f1b | zb_h1 | zbv
                                             (minipar.pipeline_parallel)
        every backward but the rank's last one under no_sync (DDP's, and ZeRO-3's, which keeps
        the unsharded gradients): the last backward reduces everything, once per step: DDP's
        all-reduce, ZeRO-3's reduce-scatter of each unit (of the other chunk's units too, at the
        end of that backward, under interleaving), not once per micro-batch. Under zb_h1 / zbv
        "the last backward" is the step's last W: the B's and every other W accumulate under
        no_sync, and the W's gradients reach the reducers' hooks as B's do (split_backward.py)
    loss = all-reduce over dp_cp (the last stage's shares), then over pp (the others add zero)
    optim.OptimizerStep                      the plain step's tail: clip by the global norm
                                             (optim.py sums the squares over pp too), AdamW, schedule

Stages that step alone (pipeline_overlap_steps). The loss and the norm summed over pp make every
stage wait, at each step's end, for the slowest: each step starts from an empty pipeline and pays
its fill. Without clipping (max_grad_norm 0) a stage needs nothing of the others to update its
own layers, so it steps at once and runs the next step's schedule: its sends wait for the
neighbour's receives, and the next step's fill overlaps this one's drain (zbv's whole bubble at
t_F = t_B = t_W; pipeline_parallel/simulate.py). The loss and the squared gradient norm go into one
all-reduce over the world (each rank's value divided by the ranks of its stage, which all hold
it; the world's group, not pp's, so that on NCCL it queues behind no send), started without
waiting and read by the train loop a step later, as is the stop flag (lifecycle.StopFlag.agree_later).
The updates are the same as the synchronous run's; only the log comes a step late. With clipping
(max_grad_norm > 0) a stage updates optimistically and checks the update once the norm has arrived,
after the next step's schedule, redoing both when clipping was due (post_validate.py; `settle()`
checks the last step before a save, an evaluation or the end).

PipelineStep is handed what it uses (the stage, batch_source.Batches, the OptimizerStep, the
autocast context, the reducers) by the trainer, and reads nothing else of it: the batches, the
optimizer tail and the evaluation loop (batch_source.eval_loss) are the plain step's own.

Pipeline settings are checked by check_pipeline() in run_setup, before any process group exists.
"""
from __future__ import annotations

import contextlib

import torch

from minipar import comm
from minipar.optim import stage_grad_sq
from minipar.pipeline_parallel import (
    ScheduleHooks,
    build_stage,
    check_schedule,
    chunks_per_rank,
    exchange_plan,
    forward_only,
    run_schedule,
    schedule_order,
    split_layers,
)
from minipar.pipeline_parallel.post_validate import PostValidator
from minipar.trainer.batch_source import eval_loss


def virtual_stages(cfg) -> int:
    """Model chunks per rank: pipeline_virtual_stages, or 2 for interleaved_1f1b and zbv, 1 otherwise."""
    return chunks_per_rank(cfg.pipeline_schedule, cfg.pipeline_virtual_stages)


def check_pipeline(cfg, pp: int, num_micro: int) -> None:
    """Every pipeline setting that can fail, as ONE ValueError naming all that do (so a config is
    fixed in one edit, as unknown keys are); no communication."""
    v = virtual_stages(cfg)

    def tied():
        if cfg.model.tie_word_embeddings:
            raise ValueError("model.tie_word_embeddings with pipeline_parallel_size > 1 is not supported: "
                             "the embedding (first stage) and lm_head (last stage) would share one weight "
                             "across stages; untie them or use pipeline_parallel_size 1")
    problems = []
    for check in (lambda: check_schedule(cfg.pipeline_schedule, pp, num_micro, v), tied,
                  lambda: split_layers(cfg.model.num_hidden_layers, pp * v, cfg.pipeline_layers)):
        try:
            check()
        except ValueError as err:
            problems.append(str(err))
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{len(problems)} pipeline settings are wrong: " + "; ".join(problems))


def build_pipeline_model(model, cfg, pgm):
    """This rank's stage of the freshly built full model (before ZeRO-3/DDP and the optimizer)."""
    return build_stage(model, pgm, virtual_stages(cfg), cfg.pipeline_layers, cfg.pipeline_schedule)


class PipelineStep:
    """train_step and evaluate for a pipeline-parallel run, from what it is handed: the stage
    (`model`), the batch source, the optimizer step, the autocast context, the reducers whose
    no_sync() the backwards before the last run under, and the dtype of what crosses stages."""

    def __init__(self, model, batches, optimizer_step, autocast, pgm, cfg, num_micro: int,
                 reducers=(), act_dtype: torch.dtype = torch.float32):
        self.model, self.batches, self.optimizer_step = model, batches, optimizer_step
        self.autocast, self.pgm, self.num_micro = autocast, pgm, num_micro
        self.reducers = [r for r in reducers if r is not None]
        self.order = schedule_order(cfg.pipeline_schedule, pgm.pp.size, num_micro, pgm.pp.rank,
                                    virtual_stages(cfg))
        # the p2p exchanges of every slot of the order, paired so that NCCL cannot deadlock (p2p.py)
        self.plan = exchange_plan(cfg.pipeline_schedule, pgm.pp.size, num_micro, virtual_stages(cfg),
                                  pgm.pp.rank, side=model.pipeline_aux is not None)
        self.transport = comm                     # posts and waits the exchanges (a test may record them)
        self.act_dtype = act_dtype
        self.alone = cfg.pipeline_overlap_steps   # step without waiting for the other stages
        opt = optimizer_step
        self.validator = PostValidator(opt.optimizer, opt.scheduler, opt.max_grad_norm, opt.update) \
            if self.alone and opt.max_grad_norm else None
        self.in_flight = None                     # (work, sums) of the last optimistic update, unchecked

    def train_step(self, step: int) -> dict:
        loss = self._schedule(step)
        if self.alone:
            if self.in_flight is not None and self._check():
                loss = self._schedule(step)       # its gradients came from weights now redone
            return self._step_alone(loss)
        comm.all_reduce(loss, self.pgm.pp)
        aux = self.model.pipeline_aux             # an MoE's figures (models/moe_aux.py), or none
        moe = aux.step_metrics(loss.device, self.num_micro) if aux is not None else {}
        return dict(loss=loss, **self.optimizer_step(), moe=moe)   # read where logged (train_loop.py)

    def _schedule(self, step: int) -> torch.Tensor:
        """Step `step`'s micro-batches through this rank's stage: its gradients reduced, its loss
        summed over dp_cp (the last stage's; the others hold zero)."""
        pgm, M = self.pgm, self.num_micro
        n_items, micro = self.batches.step(step, M)   # byte corpus or packed rows, prefetched
        with contextlib.ExitStack() as unsynced:
            for reducer in self.reducers:         # DDP / ZeRO-3: accumulate without communicating
                unsynced.enter_context(reducer.no_sync())

            def before_backward(action, last: bool):
                if last:                          # the step's final B (or W) reduces it all, once
                    unsynced.close()

            loss = run_schedule(self.model, self.order, pgm, micro, n_items, act_dtype=self.act_dtype,
                                hooks=ScheduleHooks(before_backward), autocast=self.autocast,
                                plan=self.plan, transport=self.transport)
        comm.all_reduce(loss, pgm.dp_cp)
        self.batches.prefetch(step + 1, M)        # the next step's rows, while the GPU works on this one
        return loss

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

    def _step_alone(self, loss: torch.Tensor) -> dict:
        """pipeline_overlap_steps (the module docstring): update now, sum the loss and the squared
        norm over the world in the background; `pending()` waits for them and gives both."""
        pgm = self.pgm
        sq = stage_grad_sq(self.model.parameters(), pgm)
        if self.validator is not None:            # what the optimistic update changes, to undo it
            self.validator.keep()
        lr = self.optimizer_step.update()
        shares = torch.stack([loss.to(sq.device, sq.dtype), sq]) / (pgm.world.size // pgm.pp.size)
        work = comm.all_reduce(shares, pgm.world, async_op=True)
        if self.validator is not None:
            self.in_flight = (work, shares)

        def pending() -> dict:                    # device tensors, read where logged (train_loop.py)
            work.wait()
            return dict(loss=shares[0], grad_norm=shares[1].sqrt().float())   # as optim.py
        return dict(lr=lr, moe={}, pending=pending)

    def evaluate(self) -> float:
        # only the last stage's forward_only returns a loss (the others zero): summed over pp too
        def loss_of(batch, n_items):
            return forward_only(self.model, self.pgm, batch, n_items, act_dtype=self.act_dtype,
                                autocast=self.autocast, transport=self.transport)
        return eval_loss(self.model, self.batches, loss_of, (self.pgm.dp_cp, self.pgm.pp))
