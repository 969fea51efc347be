"""The run around the step: resume, then step after step with its log, evaluation, metrics and
checkpoints, then the final save, the Hugging Face export and the summary.

Trainer (trainer.py) builds the model and knows one step; TrainLoop(trainer), which the trainer
holds as trainer.loop, drives it from outside, through the trainer's public face only (cfg, pgm,
run, device, model, n_params, start_step, is_main, log, train_step, evaluate, save, maybe_resume).
The loop owns the history (one record per step, the earlier ones of metrics.jsonl after a resume):

    maybe_resume()                         step-N of resume_from_checkpoint (latest: the newest
                                           whose checksums hold), its sampler position and step
    for step in start .. max_steps:
        train_step(step)                   loss, grad_norm, lr; tokens_per_s, tflops_per_s, mfu
                                           (throughput.py); inside the trace when profile_steps
                                           holds the step (profiling.py)
        evaluate()                         every eval_steps and at the end (when there is val data):
                                           val_loss, val_perplexity (its exp), and with eval_prompts a
                                           few greedy generations (eval_samples.py)
        a non-finite loss                  FloatingPointError, naming the step and the fixes
        metrics.jsonl, tqdm, the log line  rank 0 only (every logging_steps); TensorBoard and
                                           wandb too when asked for (run_loggers.py)
        save(done)                         every save_steps (save_total_limit kept); async_save:
                                           copied to the host, written in the background
                                           (checkpoint/async_save.py); SIGTERM and the end wait
                                           for that write, and a failed one is raised on every
                                           rank a step later, riding on the stop flag below
        stop.agree_later(pgm)              SIGTERM on any rank: the flags are summed while the
                                           next step runs; every rank then saves that step and
                                           leaves with lifecycle.Preempted, at the same step
    The losses and norms stay device tensors until a logging step, a save, a stop or the end
    reads all of them in one copy (_read): the step's only host sync on a dense layout
    (docs/design.md, host syncs), the logged floats the same. (pipeline_overlap_steps: the record
    of a step is settled after the next one, whose stages did not wait for each other;
    pipeline_parallel/overlap_steps.py)
    save(max_steps), export_hf, summary    run_summary.py: the peak memory of every rank, the loss
                                           curve, the throughput and MFU beside the planner's
                                           prediction for this layout

Communication beyond the step's: one all-reduce of one int over the world per step (the stop
flag; nothing on one process; started without waiting and read a step later), a checkpoint's
barriers when saving, and one all-gather of one float per rank in the summary.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch
from tqdm import tqdm

from minipar.mesh import describe_grid
from minipar.trainer import lifecycle, metrics_file, run_summary
from minipar.trainer.checkpoint import save_load as ckpt
from minipar.trainer.data.tokenizer import save_tokenizer
from minipar.trainer.eval_samples import eval_generations, why_not
from minipar.trainer.profiling import StepProfiler
from minipar.trainer.run_loggers import open_loggers
from minipar.trainer.throughput import Throughput
from models import moe_metrics


class TrainLoop:
    """The run around a trainer's step. The trainer is passed in, not inherited from: the loop
    reads the run's settings from it and calls its step, evaluation and saves."""

    def __init__(self, trainer):
        self.trainer, self.history = trainer, []
        # the trainer's fixed parts, named once (start_step is read from it: maybe_resume moves it)
        self.cfg, self.pgm, self.run, self.device = trainer.cfg, trainer.pgm, trainer.run, trainer.device
        self.is_main, self.log = trainer.is_main, trainer.log
        dtype = torch.bfloat16 if self.cfg.dtype == "bfloat16" else torch.float32
        self.throughput = Throughput(self.cfg, self.pgm.world_size, self.device, dtype)
        self.profiler = StepProfiler(self.cfg.profile_steps, self.cfg.output_dir, self.pgm.global_rank,
                                     self.device, self.log)
        self.loggers = []
        self.noted_generations = False            # eval_prompts on a layout without generation: said once

    def _open_metrics(self):
        if not self.is_main:
            return None
        handle, self.history = metrics_file.open_metrics(self.cfg.metrics_path, self.trainer.start_step,
                                                         self.log)
        return handle

    def train(self):
        """The run; the output_dir lock is released however it ends, after the save in flight."""
        try:
            return self._train()
        finally:
            self.trainer.close_saves()            # (async_save) before the groups are torn down
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
        self.log(self.throughput.describe())
        t.maybe_resume()
        metrics = self._open_metrics()
        self.loggers = open_loggers(cfg, t.start_step, self.is_main)
        tokens_per_step = self.throughput.rows * cfg.sequence_len     # rl: dpo: 2 rows per pair
        bar = tqdm(total=cfg.max_steps, initial=t.start_step, desc="train", dynamic_ncols=True,
                   disable=not (self.is_main and cfg.progress_bar))
        start, last_val = time.time(), None
        stop = lifecycle.StopFlag().install()     # SIGTERM: finish the step, save it, leave (lifecycle.py)
        # pipeline_overlap_steps: the stages do not meet at a step's end; the last step's record
        # waits for its sums, in flight, until the next step is done
        alone, held, asked = cfg.pipeline_overlap_steps, None, None
        self.unread = []                          # records whose loss and norm are still on the device
        for step in range(t.start_step, cfg.max_steps):
            with self.profiler.around(step + 1):
                t0 = time.time()
                out = t.train_step(step)
                dt = time.time() - t0
            done = step + 1
            record = dict(step=done, loss=None, lr=out["lr"], grad_norm=None,
                          tokens_per_s=tokens_per_step / dt, **self.throughput.of_step(dt),
                          elapsed_s=time.time() - start)
            record.update(out.get("moe") or {})   # an MoE's aux loss, imbalance, drops (moe_metrics.py)
            record.update(out.get("metrics") or {})   # rl: dpo's rewards/..., logps/... (TRL's names)
            has_val = self.run.datasets is None or self.run.datasets.val is not None
            if cfg.eval_steps and has_val and (done % cfg.eval_steps == 0 or done == cfg.max_steps):
                t.settle()                        # evaluate checked weights (post_validate.py)
                last_val = record["val_loss"] = t.evaluate()
                if not cfg.rl:                    # exp of the mean token loss (a DPO loss has none)
                    record["val_perplexity"] = math.exp(min(last_val, 700.0))
                if cfg.eval_prompts:              # a few greedy generations (eval_samples.py)
                    self._generations(record)
                record.update(t.eval_metrics)     # rl: dpo's eval_rewards/... (dpo_run.py)
            if alone:                             # its loss and norm arrive a step late (overlap_steps.py)
                if held is not None:
                    self._report(*held, bar, metrics)
                held = (record, out["pending"], dt)
            else:
                self._report(record, lambda: out, dt, bar, metrics)
            if cfg.save_steps and done % cfg.save_steps == 0 and done != cfg.max_steps:
                if held is not None:              # a checkpoint only of a step whose loss is known finite
                    self._report(*held, bar, metrics)
                    held = None
                self._read(bar, metrics)
                t.settle()
                t.save(done)
            # the stop flag is agreed a step late on every layout: the all-reduce started at the end
            # of step k is read at the end of step k + 1, long done, so no rank waits for it (and on
            # a GPU the host does not wait for the device either: lifecycle.StopFlag.agree_later)
            signum = asked() if asked is not None else 0
            asked = stop.agree_later(pgm, self.device, save_failed=t.save_failed())
            if signum == lifecycle.SAVE_FAILED:   # a background save failed on some rank (async_save):
                t.finish_saves()                  # every rank raises its CheckpointWriteError here
            if signum and signum != lifecycle.SAVE_FAILED and done != cfg.max_steps:
                if held is not None:
                    self._report(*held, bar, metrics)
                asked()                           # joined by every rank: each started it this step
                self._read(bar, metrics)
                t.settle()
                self._stop_early(done, signum, stop, bar, metrics)
        if held is not None:
            self._report(*held, bar, metrics)
        if asked is not None:
            asked()
        self._read(bar, metrics)
        t.settle()                                # the last update checked before it is saved
        stop.restore()
        bar.close()
        self._close(metrics)
        if cfg.save_final_checkpoint and cfg.max_steps > t.start_step:
            t.save(cfg.max_steps)
        t.finish_saves()                          # async_save: the end waits for the last write
        if cfg.export_hf and t.lora:              # PEFT's adapter directory, and the merged model
            for path in ckpt.export_lora(cfg, t.model, t.lora_targets, self.run.base_model):
                if self.is_main:   # the tokenizer beside the adapter too: AutoTokenizer loads both dirs
                    save_tokenizer(self.run.tokenizer, path)
                self.log(f"exported {'the LoRA adapter' if path == cfg.output_dir else 'the merged model'} "
                         f"to {path}")
        elif cfg.export_hf:
            hf_dir = os.path.join(cfg.output_dir, "hf")
            ckpt.export_hf(hf_dir, t.model)
            if self.is_main:       # the model's tokenizer beside its weights (bytes: a tokenizer.json)
                save_tokenizer(self.run.tokenizer, hf_dir)
            self.log(f"exported Hugging Face model to {hf_dir}")
        run_summary.report(self, time.time() - start, last_val)
        return self.history

    def _generations(self, record: dict):
        t, note = self.trainer, why_not(self.trainer.pgm)
        if note is None:
            record["eval_generations"] = eval_generations(t.model, self.run.tokenizer,
                                                          self.cfg.eval_prompts)
        elif not self.noted_generations:
            self.noted_generations = True
            self.log(note)

    def _report(self, record: dict, sums, dt: float, bar, metrics):
        """A step's record, once its loss and grad norm are on their way (`sums()`: the step's own
        output, or the sums a stage stepping alone waits for). They stay device tensors until the
        next logging step (or a save, a stop, the end), where _read reads all of them at once."""
        out = sums()
        self.unread.append((record, out["loss"], out["grad_norm"], dt))
        done = record["step"]
        if done % self.cfg.logging_steps == 0 or done == self.cfg.max_steps:
            self._read(bar, metrics)

    def _read(self, bar, metrics):
        """The unread records' losses and norms in ONE device-to-host read (the step's only host
        sync on a dense layout: docs/design.md), then for each in turn the finite-loss check, the
        metrics file, the loggers, the history, the bar and the log line. On a GPU the steps
        between two reads only queued their work, so each of them is given the window's mean
        time (its own host time, and the wait for the device at the read, shared out)."""
        if not self.unread:
            return
        unread, self.unread = self.unread, []
        t0 = time.time()
        # each record's loss, norm and an MoE's figures (tensors in the record), read in one copy
        rows = [[("loss", loss), ("grad_norm", norm)] + [(k, v) for k, v in record.items()
                                                         if isinstance(v, torch.Tensor)]
                for record, loss, norm, _ in unread]
        tensors = [v.detach().double().reshape(-1) for row in rows for _, v in row
                   if isinstance(v, torch.Tensor)]
        read = iter(torch.cat(tensors).tolist() if tensors else [])
        if self.device.type == "cuda":
            mean = (sum(dt for *_, dt in unread) + time.time() - t0) / len(unread)
            for record, *_ in unread:
                record.update(tokens_per_s=self.throughput.rows * self.cfg.sequence_len / mean,
                              **self.throughput.of_step(mean))
        for (record, *_), row in zip(unread, rows):
            for k, v in row:
                if isinstance(v, torch.Tensor):
                    got = [next(read) for _ in range(v.numel())]
                    record[k] = got[0] if v.dim() == 0 else got
                else:
                    record[k] = v
            self._log_record(moe_metrics.finish(record), bar, metrics)

    def _log_record(self, record: dict, bar, metrics):
        cfg, loss, done = self.cfg, record["loss"], record["step"]
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {done}: lower learning_rate "
                                     f"or enable max_grad_norm")
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        for logger in self.loggers:
            logger.log(record)
        self.history.append(record)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        bar.update(1)
        if done % cfg.logging_steps == 0 or done == cfg.max_steps:
            val = f"  val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
            if "stream_tokens" in record:         # a streamed dataset (data/stream.py): how far it got
                n = record["stream_tokens"]
                val += f"  streamed {n / 1e6:.4g}M tokens" if n >= 100_000 else f"  streamed {n} tokens"
            if "rewards/accuracies" in record:    # rl: dpo
                val += (f"  rewards/accuracies {record['rewards/accuracies']:.2f}  rewards/margins "
                        f"{record['rewards/margins']:.4f}")
            self.log(f"step {done:>5}/{cfg.max_steps}  loss {loss:.4f}{val}  lr {record['lr']:.2e}  "
                     f"grad_norm {record['grad_norm']:.3f}  {record['tokens_per_s']:.0f} tok/s")

    def _close(self, metrics):
        """The metrics file, the loggers, and a trace still open (a run that ended inside profile_steps)."""
        if metrics:
            metrics.close()
        for logger in self.loggers:
            logger.close()
        self.loggers = []
        self.profiler.close()

    def _stop_early(self, done: int, signum: int, stop, bar, metrics):
        """Every rank saw a stop signal by the end of step `done`: save that step (unless save_steps
        just did) and leave with lifecycle.Preempted, before the launcher's grace period ends."""
        bar.close()
        self._close(metrics)
        saved = self.cfg.save_steps and done % self.cfg.save_steps == 0
        path = os.path.join(self.cfg.output_dir, f"step-{done}") if saved else self.trainer.save(done)
        self.trainer.finish_saves()               # async_save: written before the run leaves
        stop.restore()                            # (a repeated SIGTERM during the save is absorbed)
        err = lifecycle.Preempted(done, path, signum)
        self.log(str(err))
        raise err
