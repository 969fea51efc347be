"""The trainer behind train.py: the parallel model, the optimizer, the step, checkpoints. It is
built from parts it holds, not from base classes:

    self.batches         batch_source.Batches: the global batch of a step, this rank's share of
                         it, the eval batches, the sampler's checkpointed position
    self.optimizer_step  optim.OptimizerStep: clip, AdamW, schedule, zero_grad (every step's tail)
    self.pipeline        pipeline_step.PipelineStep when pp > 1 (handed the parts above), else None
    self.loop            train_loop.TrainLoop(self): the run around the step; train() is its train()

One optimizer step on a rank (B = global_batch_size, M micro-batches, D = dp size, C = cp size):

    global batch (B, T) = batches.global_batch(step)          same on every rank, a pure function of step
    N = non-ignored labels in it                              num_items_in_batch, no communication
    for m in range(M):                                        gradient accumulation
        local = batches.local(global, m, M)                   (B/(D*M), T/C): dp samples, cp zigzag chunks
        loss_m = model(local) = sum of token losses / N       so the losses of all ranks SUM to the mean
        loss_m.backward()                                     ZeRO-3 reduce-scatters, DDP all-reduces (last m)
    clip by the global norm (each element counted once), AdamW on the shards, lr schedule
    logged loss = all-reduce over dp_cp of sum_m loss_m       identical on every layout

A mixture of experts adds router_aux_loss_coef / (D*M) x each micro-batch's load-balancing loss to
loss_m (models/moe_aux.py: the mean over the global batch's D*M micro-batches), and its aux loss,
load imbalance and dropped copies to the step's record (moe_metrics.py).

Everything that can be checked without communicating is checked before, by run_setup.setup_run.
"""
from __future__ import annotations

import contextlib
import math
import os
import time

import torch
from tqdm import tqdm

import minipar
from minipar import comm
from minipar import optim as moptim
from minipar.data_parallel import replicate, replicate_naive
from minipar.lora import add_lora, check_targets, load_adapters, lora_parameters, lora_targets
from minipar.trainer import host_memory
from minipar.trainer.batch_source import Batches, eval_loss
from minipar.trainer.checkpoint import save_load as ckpt
from minipar.trainer.checkpoint import verify
from minipar.trainer.pipeline_step import PipelineStep, build_pipeline_model
from minipar.trainer.prediction import planner_prediction
from minipar.trainer.run_setup import Run
from minipar.trainer.train_loop import TrainLoop  # the run around the step: train(), summary()
from minipar.zero3 import fully_shard
from models.llama import LlamaForCausalLM
from models.llama_init import SeededInit, materialize
from models.moe_metrics import MoEStepMetrics


class Trainer:
    """The model, its parallel wrappers, the optimizer and one step; the run around them is its
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
        self.bf16 = cfg.dtype == "bfloat16"
        # built on the meta device; each rank then materialises only what it keeps (its TP slice,
        # under ZeRO-3 only its shard of each unit), from the seed or from base_model's files
        model = LlamaForCausalLM(cfg.model, pgm, seed=cfg.seed, device="meta")
        self.n_params = sum(math.prod(p.tp_full_shape) for p in model.parameters())
        source, t_load = self._weight_source(model), time.time()
        # LoRA: the base frozen, the adapters real now, on the whole model (global names, a seed per
        # adapter name), so they go with their layer through the pipeline cut and stay out of ZeRO-3
        self.lora = cfg.adapter == "lora"
        if self.lora:
            self.lora_targets = check_targets(cfg.lora_target_modules, cfg.lora_target_linear,
                                              lora_targets(model))
            add_lora(model, self.lora_targets, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, seed=cfg.seed,
                     device=self.device)
            if cfg.lora_model_dir:               # checked against the model by check.py already
                load_adapters(model, cfg.lora_model_dir, pgm.tp)
            n_lora = sum(math.prod(p.tp_full_shape) for p in lora_parameters(model))
            self.log(f"LoRA r={cfg.lora_r}, alpha={cfg.lora_alpha:g} on {', '.join(self.lora_targets)}: "
                     f"{n_lora / 1e6:.2f} M trainable parameters ({100 * n_lora / self.n_params:.2f} % of "
                     f"{self.n_params / 1e6:.1f} M), the base frozen"
                     + (f"; adapters from {cfg.lora_model_dir}" if cfg.lora_model_dir else ""))
        if cfg.gradient_checkpointing:            # true: full; selective: per op, or every n-th layer
            model.gradient_checkpointing_enable("full" if cfg.gradient_checkpointing is True else
                                                cfg.gradient_checkpointing, cfg.selective_ac_option)
        if pgm.pp.size > 1:                       # pipeline parallelism: keep this rank's stage only
            model = build_pipeline_model(model, cfg, pgm)
        self.grad_sync = None
        # ZeRO-3 over dp_shard_cp whenever it has more than one rank, cp-only layouts included (as
        # accelerate's FSDP mesh): the cp ranks hold the same parameters, so they share them out
        # instead of each keeping 16 bytes x params. HSDP over dp_replicate on top.
        self.sharded = pgm.dp_shard_cp.size > 1
        if self.sharded:
            fully_shard(model, pgm, prefetch=cfg.fsdp.prefetch,
                        reshard_after_forward=cfg.fsdp.reshard_after_forward,
                        param_dtype=torch.bfloat16 if self.bf16 else None,
                        reduce_dtype=torch.float32 if self.bf16 else None, init=source,
                        ignored_params=lora_parameters(model))
        else:
            materialize(model, source)
        # replicas only: DDP all-reduces the gradients. With LoRA on ZeRO-3 too: the frozen shards
        # have none, and the adapters are whole on every rank (minipar/lora/adapter.py says why)
        if pgm.dp_cp.size > 1 and (not self.sharded or self.lora):
            wrap = replicate_naive if cfg.ddp == "naive" else replicate
            self.grad_sync = wrap(model, pgm.dp_cp)
        # whose no_sync() the micro-batches before the last run under (None: sync every one)
        self.no_sync_owner = self.grad_sync if not self.sharded or self.lora else \
            (None if cfg.fsdp.sync_each_batch else model.zero3)
        self.model = model
        if run.base_model is not None:
            self.log(f"loaded {run.base_model.directory} in {time.time() - t_load:.1f} s")
        fused = dict(fused=True) if cfg.optimizer == "adamw_torch_fused" else {}   # torch's fused kernel
        self.optimizer = moptim.build_optimizer(model, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                                betas=(cfg.adam_beta1, cfg.adam_beta2), **fused)
        self.scheduler = moptim.build_scheduler(self.optimizer, cfg.warmup_steps, cfg.max_steps,
                                                cfg.min_lr_ratio)
        self.optimizer_step = moptim.OptimizerStep(model, self.optimizer, self.scheduler, cfg.max_grad_norm,
                                                   pgm)
        self.batches = Batches(run, self.device)
        self.start_step = 0
        self.pipeline = None                      # the schedule runs the step (pipeline_step.py)
        if pgm.pp.size > 1:
            # what crosses stages has the compute dtype: bf16 in a bf16 run, half the bytes of fp32
            # on the link. Under autocast the stream is fp32 inside a stage, so the receiving stage
            # takes it back to fp32 (stage.py): it is rounded to bf16 once per crossing, no more
            act_dtype = torch.bfloat16 if self.bf16 else torch.float32
            reducers = (self.grad_sync, getattr(model, "zero3", None))
            self.pipeline = PipelineStep(model, self.batches, self.optimizer_step, self.autocast, pgm, cfg,
                                         run.num_micro_steps, reducers=reducers, act_dtype=act_dtype)
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

    def _weight_source(self, model):
        if self.run.base_model is None:
            return SeededInit(model, self.cfg.seed, self.pgm.tp, self.device)
        ckpt = self.run.base_model
        self.log(f"loading {ckpt.directory}: {len(ckpt.tensors)} tensors, {ckpt.nbytes / 2**30:.2f} GiB; "
                 f"each "
                 f"rank reads only its slices")
        return ckpt.source(self.pgm.tp, self.device)

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str):
        if self.is_main:
            tqdm.write(msg)

    def autocast(self):
        if self.bf16 and not self.sharded:        # ZeRO-3 casts the gathered params itself
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, batch, n_items, aux_weight=0.0):
        """The loss of one micro-batch; aux_weight: its load-balancing loss's weight (an MoE; 0 in
        evaluation, whose loss is the cross-entropy alone)."""
        with self.autocast():
            return self.model(batch["input_ids"], position_ids=batch["position_ids"],
                              labels=batch["labels"], num_items_in_batch=n_items,
                              document_ids=batch.get("document_ids"), aux_weight=aux_weight)

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> dict:
        if self.pipeline is not None:
            return self.pipeline.train_step(step)
        M = self.run.num_micro_steps
        n_items, micro = self.batches.step(step, M)   # prepared during the last step (batch_source.py)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        moe = MoEStepMetrics(self.pgm, self.device)
        for m, batch in enumerate(micro):
            last = m == M - 1
            unsynced = self.no_sync_owner and not last
            no_sync = self.no_sync_owner.no_sync() if unsynced else contextlib.nullcontext()
            with no_sync:
                loss = self._forward(batch, n_items, aux_weight=1.0 / (self.pgm.dp.size * M))
                loss.backward()
            loss_sum += loss.detach().double()
            moe.add(self.model.moe_metrics)
        comm.all_reduce(loss_sum, self.pgm.dp_cp)
        out = dict(**self.optimizer_step(), moe=moe.reduce())
        self.batches.prefetch(step + 1, M)        # the next step's rows, while the GPU works on this one
        # the loss stays on the device: the loop reads it where it logs (train_loop.py), not here
        return dict(loss=loss_sum, **out)

    def settle(self) -> None:
        """Check an update a pipeline stage made before the whole model's norm was known
        (pipeline_overlap_steps with clipping: post_validate.py); nothing otherwise."""
        if self.pipeline is not None:
            self.pipeline.settle()

    def evaluate(self) -> float:
        if self.pipeline is not None:
            return self.pipeline.evaluate()
        return eval_loss(self.model, self.batches, self._forward, (self.pgm.dp_cp,))

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int):
        path = os.path.join(self.cfg.output_dir, f"step-{step}")
        ckpt.save_checkpoint(path, self.model, self.optimizer, self.pgm, step=step, scheduler=self.scheduler,
                             extra=dict(step=step, sampler=self.batches.state_dict(),
                                        config=self.cfg.to_dict()),
                             state_dict_type=self.cfg.fsdp.state_dict_type,
                             keep_last=self.cfg.save_total_limit)
        self.log(f"saved checkpoint {path}")
        return path

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
        # this run's max_steps / warmup / min_lr_ratio, not the checkpoint's (optim.adopt_schedule)
        cfg = self.cfg
        note = moptim.adopt_schedule(self.scheduler, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        if note:
            self.log(note)
