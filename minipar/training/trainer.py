"""The trainer behind train.py: the parallel model, the optimizer, the step, checkpoints (the loop
around them, with its logs and summary, is train_loop.py).

One optimizer step on a rank (B = global_batch_size, M micro-batches, D = dp size, C = cp size):

    global batch (B, T) = sampler.global_batch(step)          same on every rank, a pure function of step
    N = non-ignored labels in it                              num_items_in_batch, no communication
    for m in range(M):                                        gradient accumulation
        local = local_batch(global, pgm, m, M)                (B/(D*M), T/C): dp samples, cp zigzag chunks
        loss_m = model(local) = sum of token losses / N       so the losses of all ranks SUM to the mean
        loss_m.backward()                                     ZeRO-3 reduce-scatters / DDP all-reduces (last m)
    clip by the global norm (each element counted once), AdamW on the shards, lr schedule
    logged loss = all-reduce over dp_cp of sum_m loss_m       identical on every layout

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
from minipar.data_parallel import replicate, replicate_naive
from minipar.training import optim as moptim
from minipar.training.checkpoint import save_load as ckpt
from minipar.training.checkpoint import verify
from minipar.training.data import batches as mdata
from minipar.training.data.packing import RowSampler
from minipar.training.data.packing import eval_batches as packed_eval_batches
from minipar.training.pipeline_step import PipelineStep, build_pipeline_model
from minipar.training.run_setup import Run
from minipar.training.train_loop import TrainLoop  # the run around the step: train(), summary()
from minipar.zero3 import fully_shard
from models.llama import LlamaForCausalLM
from models.llama_init import SeededInit, materialize


class Trainer(TrainLoop):
    """The model, its parallel wrappers, the optimizer and one step; the run around them is
    train_loop.TrainLoop (train(), the summary)."""

    def __init__(self, run: Run):
        self.run, self.cfg, self.pgm = run, run.cfg, run.pgm
        cfg, pgm = self.cfg, self.pgm
        self.is_main = pgm.global_rank == 0
        self.device = minipar.default_device()
        self.bf16 = cfg.dtype == "bfloat16"
        # built on the meta device; each rank then materialises only what it keeps (its TP slice,
        # under ZeRO-3 only its shard of each unit), from the seed or from base_model's files
        model = LlamaForCausalLM(cfg.model, pgm, seed=cfg.seed, device="meta")
        self.n_params = sum(math.prod(p.tp_full_shape) for p in model.parameters())
        source, t_load = self._weight_source(model), time.time()
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if pgm.pp.size > 1:                       # pipeline parallelism: keep this rank's stage only
            model = build_pipeline_model(model, cfg, pgm)
        self.grad_sync = None
        self.sharded = pgm.config.dp_shard_size > 1
        if self.sharded:                          # ZeRO-3 over dp_shard_cp, HSDP over dp_replicate
            fully_shard(model, pgm, prefetch=cfg.fsdp.prefetch,
                        reshard_after_forward=cfg.fsdp.reshard_after_forward,
                        param_dtype=torch.bfloat16 if self.bf16 else None,
                        reduce_dtype=torch.float32 if self.bf16 else None, init=source)
        else:
            materialize(model, source)
        if pgm.dp_cp.size > 1 and not self.sharded:   # replicas (and cp ranks) all-reduce gradients
            self.grad_sync = replicate_naive(model, pgm.dp_cp) if cfg.ddp == "naive" else replicate(model, pgm.dp_cp)
        # whose no_sync() the micro-batches before the last run under (None: sync every one)
        self.no_sync_owner = self.grad_sync if not self.sharded else \
            (None if cfg.fsdp.sync_each_batch else model.zero3)
        self.model = model
        if run.base_model is not None:
            self.log(f"loaded {run.base_model.directory} in {time.time() - t_load:.1f} s")
        fused = dict(fused=True) if cfg.optimizer == "adamw_torch_fused" else {}   # torch's fused kernel
        self.optimizer = moptim.build_optimizer(model, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                                betas=(cfg.adam_beta1, cfg.adam_beta2), **fused)
        self.scheduler = moptim.build_scheduler(self.optimizer, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        if run.datasets is not None:              # `datasets` rows (packing.py), else the byte corpus
            self.sampler = RowSampler(run.datasets.train, cfg.global_batch_size, cfg.seed)
        else:
            self.sampler = mdata.BatchSampler(len(run.train_tokens), cfg.sequence_len, cfg.global_batch_size,
                                              cfg.seed)
        self.start_step, self.history = 0, []
        self.pipeline = None                      # the schedule runs the step (pipeline_step.py)
        if pgm.pp.size > 1:
            self.pipeline = PipelineStep(self)

    def _weight_source(self, model):
        if self.run.base_model is None:
            return SeededInit(model, self.cfg.seed, self.pgm.tp, self.device)
        ckpt = self.run.base_model
        self.log(f"loading {ckpt.directory}: {len(ckpt.tensors)} tensors, {ckpt.nbytes / 2**30:.2f} GiB; each "
                 f"rank reads only its slices")
        return ckpt.source(self.pgm.tp, self.device)

    # ------------------------------------------------------------------ helpers
    def log(self, msg: str):
        if self.is_main:
            tqdm.write(msg)

    def _autocast(self):
        if self.bf16 and not self.sharded:        # ZeRO-3 casts the gathered params itself
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, batch, n_items):
        with self._autocast():
            return self.model(batch["input_ids"], position_ids=batch["position_ids"],
                              labels=batch["labels"], num_items_in_batch=n_items,
                              document_ids=batch.get("document_ids"))

    def _global_batch(self, step: int) -> dict:
        if self.run.datasets is not None:
            return self.sampler.global_batch(step)
        ids, labels = self.sampler.global_batch(self.run.train_tokens, step)
        return dict(input_ids=ids, labels=labels)

    def _eval_batches(self):
        cfg = self.cfg
        if self.run.datasets is not None:
            yield from packed_eval_batches(self.run.datasets.val, cfg.global_batch_size, cfg.eval_batches)
            return
        for ids, labels in mdata.eval_batches(self.run.val_tokens, cfg.sequence_len, cfg.global_batch_size,
                                              cfg.eval_batches):
            yield dict(input_ids=ids, labels=labels)

    def _local(self, gb: dict, m: int, M: int) -> dict:
        return mdata.local_batch(gb["input_ids"], gb["labels"], self.pgm, m, M, device=self.device,
                                 position_ids=gb.get("position_ids"), document_ids=gb.get("document_ids"))

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> dict:
        if self.pipeline is not None:
            return self.pipeline.train_step(step)
        gb = self._global_batch(step)
        n_items = mdata.count_label_tokens(gb["labels"])
        M = self.run.num_micro_steps
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for m in range(M):
            batch = self._local(gb, m, M)
            last = m == M - 1
            no_sync = self.no_sync_owner.no_sync() if (self.no_sync_owner and not last) else contextlib.nullcontext()
            with no_sync:
                loss = self._forward(batch, n_items)
                loss.backward()
            loss_sum += loss.detach().double()
        comm.all_reduce(loss_sum, self.pgm.dp_cp)
        grad_norm = moptim.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm, self.pgm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return dict(loss=loss_sum.item(), grad_norm=float(grad_norm), lr=lr)

    @torch.no_grad()
    def evaluate(self) -> float:
        if self.pipeline is not None:
            return self.pipeline.evaluate()
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for gb in self._eval_batches():
            n_items = mdata.count_label_tokens(gb["labels"])
            batch = self._local(gb, 0, 1)
            total += self._forward(batch, n_items).double()
            count += 1
        comm.all_reduce(total, self.pgm.dp_cp)
        self.model.train()
        return total.item() / max(count, 1)

    # ------------------------------------------------------------------ checkpoints
    def save(self, step: int):
        path = os.path.join(self.cfg.output_dir, f"step-{step}")
        ckpt.save_checkpoint(path, self.model, self.optimizer, self.pgm, step=step, scheduler=self.scheduler,
                             extra=dict(step=step, sampler=self.sampler.state_dict(), config=self.cfg.to_dict()),
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
        self.sampler.load_state_dict(extra["sampler"])
        self.start_step = int(extra["step"])
        self.log(f"resumed from {path} at step {self.start_step}")
        # this run's max_steps / warmup / min_lr_ratio, not the checkpoint's (optim.adopt_schedule)
        cfg = self.cfg
        note = moptim.adopt_schedule(self.scheduler, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
        if note:
            self.log(note)
