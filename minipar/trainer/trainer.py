"""The trainer behind train.py: the composed model (minipar/compose.py), the optimizer, the data of
each step, evaluation and checkpoints. It is built from parts it holds, not from base classes:

    self.parallel        compose.build(): this rank's piece of the decoder, every technique applied
    self.step            compose.Step: one optimizer step (micro-batches or a pipeline schedule,
                         forward, backward, sync, the global norm, clipping, AdamW)
    self.batches         batch_source.Batches: the global batch of a step, this rank's share of
                         it, the eval batches, the sampler's checkpointed position
    self.loop            train_loop.TrainLoop(self): the run around the step; train() is its train()
    self.dpo             rl: dpo only, dpo_run.DPORun: the DPO step around self.step, its
                         reference, the evaluation on held-out pairs

A step here is: this rank's micro-batches of the step's global batch (prepared during the last
step), compose.Step on them, then the next step's batches prepared while the device works. The
settings come from the config once (TrainConfig.recipe(): recipe.Recipe); the closing summary's
prediction from the planner (prediction.py).

Everything that can be checked without communicating is checked before, by run_setup.setup_run.
"""
from __future__ import annotations

import datetime
import os
import time

from tqdm import tqdm

import minipar
from minipar import compose, lr_schedule, optim_bnb
from minipar.trainer import host_memory
from minipar.trainer.batch_source import Batches, eval_loss
from minipar.trainer.checkpoint import save_load as ckpt
from minipar.trainer.checkpoint import verify
from minipar.trainer.checkpoint.async_save import AsyncCheckpointer
from minipar.trainer.dpo_run import DPORun
from minipar.trainer.prediction import planner_prediction
from minipar.trainer.run_setup import Run
from minipar.trainer.train_loop import TrainLoop  # the run around the step: train(), summary()


class Trainer:
    """The composed model, the optimizer and one step; the run around them is its
    train_loop.TrainLoop (train(), the summary)."""

    def __init__(self, run: Run):
        self.run, self.cfg, self.pgm = run, run.cfg, run.pgm
        # the planner's prediction for this run, which the summary prints beside the measured one
        self.predict = planner_prediction(run.cfg, run.pgm.config)
        cfg, pgm = self.cfg, self.pgm
        self.is_main = pgm.global_rank == 0
        self.device = minipar.default_device()
        if self.device.type == "cpu" and host_memory.asked():    # freed tensors back to the OS, at a
            host_memory.return_freed_memory()                     # cost in speed (host_memory.py)
        if run.base_model is not None:
            ck = run.base_model
            self.log(f"loading {ck.directory}: {len(ck.tensors)} tensors, {ck.nbytes / 2**30:.2f} GiB; each "
                     f"rank reads only its slices")
        problem = optim_bnb.device_problem(cfg.optimizer, self.device)   # bitsandbytes here? (every rank)
        if problem:
            raise ValueError(problem)
        t_load = time.time()
        self.parallel = compose.build(cfg.model, pgm, cfg.recipe(), base_model=run.base_model,
                                      device=self.device, log=self.log)
        if run.base_model is not None:
            self.log(f"loaded {run.base_model.directory} in {time.time() - t_load:.1f} s")
        self.model, self.n_params = self.parallel.model, self.parallel.n_params
        self.lora, self.lora_targets = cfg.adapter == "lora", self.parallel.lora_targets
        self.grad_sync = self.parallel.grad_sync
        # torch's AdamW (fused or not) or bitsandbytes' (8-bit, paged: the paging noted off CUDA)
        self.optimizer, notes = optim_bnb.build_named_optimizer(
            self.model, cfg.optimizer, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
            betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon, device=self.device)
        run.notes.extend(notes)
        self.scheduler = lr_schedule.build_scheduler(self.optimizer, cfg.warmup_steps, cfg.max_steps,
                                                cfg.min_lr_ratio, kind=cfg.lr_scheduler)
        self.step = compose.Step(self.parallel, self.optimizer, self.scheduler, cfg.max_grad_norm,
                                 run.num_micro_steps, overlap=cfg.pipeline_overlap_steps)
        self.batches = Batches(run, self.device)
        self.eval_metrics = {}                    # an evaluation's figures beside val_loss (rl: dpo)
        # rl: dpo: DPOStep around self.step, its reference (precomputed here, before any resume)
        self.dpo = DPORun(self) if cfg.rl else None
        self.start_step = 0
        # async_save: saves written in a background thread over a group of their own, created here
        # on every rank at the same point (checkpoint/async_save.py)
        self.saver = (AsyncCheckpointer(pgm, self.log, datetime.timedelta(seconds=cfg.ddp_timeout))
                      if cfg.async_save else None)
        self.loop = TrainLoop(self)

    def train(self):
        """The whole run (train_loop.py); returns the history, one record per step."""
        return self.loop.train()

    @property
    def history(self):                            # the loop's records, also after it raised
        return self.loop.history

    @property
    def sampler(self):                            # the batch source's, for callers that read it
        return self.batches.sampler

    def log(self, msg: str):
        if self.is_main:
            tqdm.write(msg)

    def autocast(self):
        return self.parallel.autocast()

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> dict:
        """compose.Step on this step's micro-batches; the loss and norm stay on the device (the
        loop reads them where it logs, train_loop.py)."""
        M = self.run.num_micro_steps
        if self.dpo is not None:                  # the pairs' rows, split by DPOStep (dpo_run.py)
            return self.dpo.step(self.batches.global_batch(step))
        n_items, micro = self.batches.step(step, M)   # prepared during the last step (batch_source.py)
        out = self.step(n_items, micro)
        self.batches.prefetch(step + 1, M)        # the next step's rows, while the GPU works on this one
        streamed = self.batches.progress(step + 1)    # a stream: the tokens handed out through this step
        return dict(out, metrics={**(out.get("metrics") or {}), **streamed}) if streamed else out

    def settle(self) -> None:
        """Check an update a pipeline stage made before the whole model's norm was known
        (pipeline_overlap_steps with clipping: pipeline_parallel/post_validate.py); nothing otherwise."""
        self.step.settle()

    def evaluate(self) -> float:
        if self.dpo is not None:                  # held-out pairs: the DPO loss, TRL's eval metrics
            loss, self.eval_metrics = self.dpo.evaluate()
            return loss
        return eval_loss(self.model, self.batches, self.step.eval_loss, self.step.loss_groups,
                         self.step.eval_window)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int):
        """Save step-N (collective). async_save: wait for the save in flight, copy this one to the
        host and return while a background thread writes it (finish_saves() joins it)."""
        path = os.path.join(self.cfg.output_dir, f"step-{step}")
        args = dict(step=step, scheduler=self.scheduler,
                    extra=dict(step=step, sampler=self.batches.state_dict(), config=self.cfg.to_dict()),
                    state_dict_type=self.cfg.fsdp.state_dict_type, keep_last=self.cfg.save_total_limit)
        if self.saver is not None:
            took = self.saver.save(path, self.model, self.optimizer, **args)
            self.log(f"checkpoint {path}: copied to the host in {took['copy_s']:.2f} s, writing in the "
                     f"background")
            return path
        ckpt.save_checkpoint(path, self.model, self.optimizer, self.pgm, **args)
        self.log(f"saved checkpoint {path}")
        return path

    def save_failed(self) -> bool:
        """Whether this rank's background save has failed (async_save; no waiting, no communication)."""
        return self.saver is not None and self.saver.failed()

    def finish_saves(self) -> None:
        """Join the background save in flight, raising its error (CheckpointWriteError: a full disk)
        here; nothing without async_save. Every rank calls it at the same step."""
        if self.saver is not None:
            self.saver.wait()

    def close_saves(self) -> None:
        """However the run ends: join the save in flight (its error dropped: the run is already
        failing if it has one not raised yet) and let go of the checkpoint group."""
        if self.saver is not None:
            self.saver.close(raise_error=False)

    def maybe_resume(self):
        resume = self.cfg.resume_from_checkpoint
        if not resume:
            return
        path = resume
        if resume == "latest":        # the newest checkpoint whose checksums hold; damaged ones are named
            path, skipped = verify.find_latest_verified(self.cfg.output_dir)
            for bad, why in skipped:
                self.log(f"warning: resume_from_checkpoint=latest skips {bad}: {why}")
        if path is None:
            self.log(f"resume_from_checkpoint=latest: no checkpoint in {self.cfg.output_dir}, starting fresh")
            return
        extra = ckpt.load_checkpoint(path, self.model, self.optimizer, self.pgm, scheduler=self.scheduler)
        if resume == "latest" and self.is_main:   # after load's barrier: every rank has chosen `path`
            for bad, moved in verify.quarantine_skipped(skipped):   # so no rotation keeps one over it
                self.log(f"warning: moved the damaged checkpoint {bad} aside to {moved}")
        self.batches.load_state_dict(extra["sampler"])
        self.start_step = int(extra["step"])
        self.log(f"resumed from {path} at step {self.start_step}")
        # this run's max_steps / warmup / min_lr_ratio, not the checkpoint's (lr_schedule.adopt_schedule)
        cfg = self.cfg
        note = lr_schedule.adopt_schedule(self.scheduler, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio,
                                     kind=cfg.lr_scheduler)
        if note:
            self.log(note)
