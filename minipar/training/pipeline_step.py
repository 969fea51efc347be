"""The training step when pipeline_parallel_size > 1: the trainer's model is this rank's stage, and
one optimizer step is a pipeline schedule over the step's micro-batches.

    global batch, num_items_in_batch        as in trainer.py: every rank of every stage builds it
    micro-batches m = 0..M-1                 local_batch(dp, cp) as usual: every stage reads the
                                             same ones (the sampler only knows the dp coordinates)
    run_schedule(stage, order)               afab | 1f1b | interleaved_1f1b (minipar.pipeline_parallel)
        every backward but the rank's last one under no_sync (DDP's, and ZeRO-3's, which keeps
        the unsharded gradients): the last backward reduces everything, once per step: DDP's
        all-reduce, ZeRO-3's reduce-scatter of each unit (of the other chunk's units too, at the
        end of that backward, under interleaving), not once per micro-batch
    loss = all-reduce over dp_cp (the last stage's shares), then over pp (the others add zero)
    clip by the global norm (optim.py sums the squares over pp too), AdamW, lr schedule

Pipeline settings are checked by check_pipeline() in run_setup, before any process group exists.
"""
from __future__ import annotations

import contextlib

import torch

from minipar import comm
from minipar.pipeline_parallel import (
    build_stage,
    check_schedule,
    forward_only,
    run_schedule,
    schedule_order,
    split_layers,
)
from minipar.training import optim as moptim
from minipar.training.data import batches as mdata


def virtual_stages(cfg) -> int:
    """Model chunks per rank: pipeline_virtual_stages, or 2 for interleaved_1f1b and 1 otherwise."""
    if cfg.pipeline_virtual_stages is not None:
        return cfg.pipeline_virtual_stages
    return 2 if cfg.pipeline_schedule == "interleaved_1f1b" else 1


def check_pipeline(cfg, pp: int, num_micro: int) -> None:
    """Every pipeline setting that can fail, as a ValueError naming the values; no communication."""
    v = virtual_stages(cfg)
    check_schedule(cfg.pipeline_schedule, pp, num_micro, v)
    if cfg.model.tie_word_embeddings:
        raise ValueError("model.tie_word_embeddings with pipeline_parallel_size > 1 is not supported: the "
                         "embedding (first stage) and lm_head (last stage) would share one weight across "
                         "stages; untie them or use pipeline_parallel_size 1")
    split_layers(cfg.model.num_hidden_layers, pp * v, cfg.pipeline_layers)


def build_pipeline_model(model, cfg, pgm):
    """This rank's stage of the freshly built full model (before ZeRO-3/DDP and the optimizer)."""
    return build_stage(model, pgm, virtual_stages(cfg), cfg.pipeline_layers)


class PipelineStep:
    """The trainer's train_step and evaluate for a pipeline-parallel run."""

    def __init__(self, trainer):
        self.t, cfg, pgm = trainer, trainer.cfg, trainer.pgm
        self.order = schedule_order(cfg.pipeline_schedule, pgm.pp.size, trainer.run.num_micro_steps,
                                    pgm.pp.rank, virtual_stages(cfg))
        # what crosses stages has the dtype the residual stream has: bf16 only where ZeRO-3 casts
        # the weights themselves (autocast keeps the stream in fp32)
        self.act_dtype = torch.bfloat16 if (trainer.bf16 and trainer.sharded) else torch.float32

    def train_step(self, step: int) -> dict:
        t, pgm = self.t, self.t.pgm
        gb = t._global_batch(step)                # the trainer's: byte corpus or packed datasets rows
        n_items = mdata.count_label_tokens(gb["labels"])
        M = t.run.num_micro_steps
        batches = [t._local(gb, m, M) for m in range(M)]
        reducers = [r for r in (t.grad_sync, getattr(t.model, "zero3", None)) if r is not None]
        with contextlib.ExitStack() as unsynced:
            for reducer in reducers:              # DDP / ZeRO-3: accumulate without communicating
                unsynced.enter_context(reducer.no_sync())

            def before_backward(action, last: bool):
                if last:                          # the step's final backward reduces it all, once
                    unsynced.close()

            loss = run_schedule(t.model, self.order, pgm, batches, n_items, act_dtype=self.act_dtype,
                                before_backward=before_backward, autocast=t._autocast)
        comm.all_reduce(loss, pgm.dp_cp)
        comm.all_reduce(loss, pgm.pp)
        grad_norm = moptim.clip_grad_norm_(t.model.parameters(), t.cfg.max_grad_norm, pgm)
        lr = t.optimizer.param_groups[0]["lr"]
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        return dict(loss=loss.item(), grad_norm=float(grad_norm), lr=lr)

    @torch.no_grad()
    def evaluate(self) -> float:
        t, pgm = self.t, self.t.pgm
        t.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=t.device)
        count = 0
        for gb in t._eval_batches():
            total += forward_only(t.model, pgm, t._local(gb, 0, 1), mdata.count_label_tokens(gb["labels"]),
                                  act_dtype=self.act_dtype, autocast=t._autocast)
            count += 1
        comm.all_reduce(total, pgm.dp_cp)
        comm.all_reduce(total, pgm.pp)
        t.model.train()
        return total.item() / max(count, 1)
