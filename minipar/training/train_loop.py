"""The run around the step: resume, then step after step with its log, evaluation, metrics and
checkpoints, then the final save, the Hugging Face export and the summary.

Trainer (trainer.py) builds the model and knows one step; TrainLoop(trainer), which the trainer
holds as trainer.loop, drives it from outside, through the trainer's public face only (cfg, pgm,
run, device, model, n_params, start_step, is_main, log, train_step, evaluate, save, maybe_resume).
The loop owns the history (one record per step, the earlier ones of metrics.jsonl after a resume):

    maybe_resume()                         step-N of resume_from_checkpoint (latest: the newest
                                           whose checksums hold), its sampler position and step
    for step in start .. max_steps:
        train_step(step)                   loss, grad_norm, lr
        evaluate()                         every eval_steps and at the end (when there is val data)
        a non-finite loss                  FloatingPointError, naming the step and the fixes
        metrics.jsonl, tqdm, the log line  rank 0 only (every logging_steps)
        save(done)                         every save_steps (save_total_limit kept)
        stop.agreed(pgm)                   SIGTERM on any rank: every rank saves step `done` and
                                           leaves with lifecycle.Preempted, at the same step
    save(max_steps), export_hf, summary    the peak memory of every rank, the loss curve

Communication beyond the step's: one all-reduce of one int over the world per step (the stop
flag; nothing on one process), a checkpoint's barriers when saving, and one all-gather of one
float per rank in the summary.
"""
from __future__ import annotations

import json
import math
import os
import resource
import time
from typing import Optional

import torch
from tqdm import tqdm

from minipar import comm
from minipar.mesh import describe_grid
from minipar.training import lifecycle, metrics_file
from minipar.training.checkpoint import save_load as ckpt
from minipar.training.data.tokenizer import save_tokenizer


class TrainLoop:
    """The run around a trainer's step. The trainer is passed in, not inherited from: the loop
    reads the run's settings from it and calls its step, evaluation and saves."""

    def __init__(self, trainer):
        self.trainer, self.history = trainer, []
        # the trainer's fixed parts, named once (start_step is read from it: maybe_resume moves it)
        self.cfg, self.pgm, self.run, self.device = trainer.cfg, trainer.pgm, trainer.run, trainer.device
        self.is_main, self.log = trainer.is_main, trainer.log

    def _open_metrics(self):
        if not self.is_main:
            return None
        handle, self.history = metrics_file.open_metrics(self.cfg.metrics_path, self.trainer.start_step,
                                                         self.log)
        return handle

    def train(self):
        """The run; the output_dir lock is released however it ends."""
        try:
            return self._train()
        finally:
            if self.run.lock is not None:
                self.run.lock.release()

    def _train(self):
        cfg, pgm, t = self.cfg, self.pgm, self.trainer
        for note in self.run.notes:
            self.log(note)
        self.log(describe_grid(pgm.config))
        self.log(f"model: {t.n_params / 1e6:.2f} M parameters, {cfg.model.num_hidden_layers} layers, hidden "
                 f"{cfg.model.hidden_size}; {cfg.global_batch_size} x {cfg.sequence_len} tokens per step in "
                 f"{self.run.num_micro_steps} micro-batch(es) per rank; {cfg.dtype}")
        t.maybe_resume()
        metrics = self._open_metrics()
        tokens_per_step = cfg.global_batch_size * cfg.sequence_len
        bar = tqdm(total=cfg.max_steps, initial=t.start_step, desc="train", dynamic_ncols=True,
                   disable=not (self.is_main and cfg.progress_bar))
        start, last_val = time.time(), None
        stop = lifecycle.StopFlag().install()     # SIGTERM: finish the step, save it, leave (lifecycle.py)
        for step in range(t.start_step, cfg.max_steps):
            t0 = time.time()
            out = t.train_step(step)
            dt = time.time() - t0
            record = dict(step=step + 1, loss=out["loss"], lr=out["lr"], grad_norm=out["grad_norm"],
                          tokens_per_s=tokens_per_step / dt, elapsed_s=time.time() - start)
            record.update(out.get("moe") or {})   # an MoE's aux loss, imbalance, drops (moe_metrics.py)
            done = step + 1
            has_val = self.run.datasets is None or self.run.datasets.val is not None
            if cfg.eval_steps and has_val and (done % cfg.eval_steps == 0 or done == cfg.max_steps):
                last_val = record["val_loss"] = t.evaluate()
            if not math.isfinite(out["loss"]):
                raise FloatingPointError(f"loss is {out['loss']} at step {done}: lower learning_rate "
                                         f"or enable max_grad_norm")
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            self.history.append(record)
            bar.set_postfix(loss=f"{out['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update(1)
            if done % cfg.logging_steps == 0 or done == cfg.max_steps:
                val = f"  val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
                self.log(f"step {done:>5}/{cfg.max_steps}  loss {out['loss']:.4f}{val}  lr {out['lr']:.2e}  "
                         f"grad_norm {out['grad_norm']:.3f}  {record['tokens_per_s']:.0f} tok/s")
            if cfg.save_steps and done % cfg.save_steps == 0 and done != cfg.max_steps:
                t.save(done)
            signum = stop.agreed(pgm, self.device)   # the same answer on every rank
            if signum and done != cfg.max_steps:
                self._stop_early(done, signum, stop, bar, metrics)
        stop.restore()
        bar.close()
        if metrics:
            metrics.close()
        if cfg.save_final_checkpoint and cfg.max_steps > t.start_step:
            t.save(cfg.max_steps)
        if cfg.export_hf:
            hf_dir = os.path.join(cfg.output_dir, "hf")
            ckpt.export_hf(hf_dir, t.model)
            if self.is_main:       # the model's tokenizer beside its weights (bytes: a tokenizer.json)
                save_tokenizer(self.run.tokenizer, hf_dir)
            self.log(f"exported Hugging Face model to {hf_dir}")
        self.summary(time.time() - start, last_val)
        return self.history

    def _stop_early(self, done: int, signum: int, stop, bar, metrics):
        """Every rank saw a stop signal by the end of step `done`: save that step (unless save_steps
        just did) and leave with lifecycle.Preempted, before the launcher's grace period ends."""
        bar.close()
        if metrics:
            metrics.close()
        saved = self.cfg.save_steps and done % self.cfg.save_steps == 0
        path = os.path.join(self.cfg.output_dir, f"step-{done}") if saved else self.trainer.save(done)
        stop.restore()                            # (a repeated SIGTERM during the save is absorbed)
        err = lifecycle.Preempted(done, path, signum)
        self.log(str(err))
        raise err

    def summary(self, elapsed: float, last_val: Optional[float]):
        if self.device.type == "cuda":            # (a gloo run on a GPU machine trains on the CPU)
            peak = torch.cuda.max_memory_allocated(self.device) / 2 ** 20
            what = "peak CUDA memory allocated"
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB -> MiB on Linux
            what = "peak resident memory"
        peaks = comm.all_gather(torch.tensor([peak], dtype=torch.float64, device=self.device), self.pgm.world)
        if not self.is_main:
            return
        png = metrics_file.plot_loss_curve(self.history, self.cfg.output_dir, self.pgm.grid_shape, self.log)
        # what THIS run did: after a resume the history also holds the steps before the checkpoint
        start_step = self.trainer.start_step
        ran = [r for r in self.history if r["step"] > start_step]
        first = ran[0]["loss"] if ran else float("nan")
        final = ran[-1]["loss"] if ran else float("nan")
        span = f" ({start_step + 1}-{start_step + len(ran)})" if start_step and ran else ""
        lines = [f"done: {len(ran)} steps{span} in {elapsed:.1f} s, loss {first:.4f} -> {final:.4f}"
                 + (f", val_loss {last_val:.4f}" if last_val is not None else ""),
                 f"metrics: {self.cfg.metrics_path}" + (f", loss curve: {png}" if png else ""),
                 f"{what} per rank (MiB): " + " ".join(f"r{i}={p:.0f}" for i, p in enumerate(peaks.tolist()))]
        self.log("\n".join(lines))
