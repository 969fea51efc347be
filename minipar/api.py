"""minipar as a library: your own training loop on any layout, as accelerate's users write theirs
around `Accelerator.prepare(model)`.

    import minipar
    from minipar.api import prepare
    pgm = minipar.init(minipar.ParallelismConfig(dp_shard_size=2, tp_size=2))   # accelerate's names
    model, optimizer, step = prepare("path/to/hf_model", pgm, learning_rate=1e-4)
    for input_ids, labels in my_batches():           # (B, T): the SAME global batch on every rank
        out = step(input_ids, labels)                # forward, backward, sync, clip, AdamW
        print(float(out["loss"]))                    # the global batch's mean loss, on every rank

`prepare` builds the decoder from a Hugging Face directory (or a config: random weights drawn from
the seed, the same on every layout), applies every technique the grid asks for in compose.py's
order, and returns

    model       compose.ParallelModel: .model is this rank's nn.Module (its TP slices, its ZeRO-3
                shards, its pipeline stage), .loss(batch, n_items) one micro-batch's loss
    optimizer   minipar's AdamW on the local shards (optim.py); the schedule is step.scheduler
    step        TrainStep: step(input_ids, labels) runs one optimizer step on the global batch

The step takes the WHOLE global batch on every rank and keeps this rank's share (its data-parallel
samples, its micro-batches, its context-parallel chunks: batch_split.py), so a loop written for one
process runs unchanged on any layout and gives the same losses and weights. Every rank must call it
(it communicates), with the same batch.

The gradient convention, stated once. Each micro-batch's loss is its token losses SUMMED and
divided by N, the count of labels that are not -100 in the whole global batch; data-parallel ranks
then SUM their gradients (ZeRO-3's reduce-scatter, DDP's all-reduce). The result is one process's
gradient of the global batch's mean token loss. torch's FSDP2 (and DDP) AVERAGE gradients over the
ranks instead, so there each rank takes the MEAN loss of its own tokens: the same gradient whenever
every rank holds as many counted tokens (tests/test_api.py holds minipar's against FSDP2's). Do not
divide the loss yourself: `step` does it; `step.backward` alone leaves the reduced gradients in the
parameters' .grad for a loop that inspects them or steps its own optimizer.

Communication: the techniques' own (compose.py), nothing more.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

import torch

import minipar
from minipar import comm
from minipar.batch_split import check_batch_split, count_label_tokens, local_batch
from minipar.compose import ParallelModel, Step, build
from minipar.config import ParallelismConfig
from minipar.lr_schedule import build_scheduler
from minipar.optim import build_optimizer
from minipar.recipe import Recipe
from models.hf_checkpoint import HFCheckpoint
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig


class TrainStep:
    """One optimizer step on a global batch (see the module docstring); `backward` without the
    update. Returns dict(loss, grad_norm, lr): the loss and norm are 0-d device tensors (reading
    them with float() waits for the device: do it when you log, not every step)."""

    def __init__(self, model: ParallelModel, optimizer, scheduler, max_grad_norm: float, micro_batches: int):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.micro_batches = micro_batches
        self.step = Step(model, optimizer, scheduler, max_grad_norm, micro_batches)

    def _share(self, input_ids, labels, position_ids=None, document_ids=None):
        if input_ids.dim() != 2 or labels.shape != input_ids.shape:
            raise ValueError(f"step(input_ids, labels) takes two (batch, sequence) tensors of the same "
                             f"shape, got {tuple(input_ids.shape)} and {tuple(labels.shape)}")
        pgm, M = self.model.pgm, self.micro_batches
        check_batch_split(input_ids.shape[0], input_ids.shape[1], pgm, M)
        micro = [local_batch(input_ids, labels, pgm, m, M, device=self.model.device,
                             position_ids=position_ids, document_ids=document_ids) for m in range(M)]
        return count_label_tokens(labels), micro

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids=None,
                 document_ids=None) -> dict:
        n_items, micro = self._share(input_ids, labels, position_ids, document_ids)
        out = self.step(n_items, micro)
        return dict(loss=out["loss"], grad_norm=out["grad_norm"], lr=out["lr"])

    def backward(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids=None,
                 document_ids=None) -> torch.Tensor:
        """Forwards, backwards and the gradient sync of the global batch; returns its mean loss
        (a device tensor). The gradients wait in .grad (ZeRO-3: the shards' .grad)."""
        n_items, micro = self._share(input_ids, labels, position_ids, document_ids)
        return self.step.backward(n_items, micro)[0]

    @torch.no_grad()
    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """The mean loss of a global batch, forward only (one micro-batch); a float on every rank."""
        n_items, (batch,) = count_label_tokens(labels), [local_batch(input_ids, labels, self.model.pgm,
                                                                     device=self.model.device)]
        self.model.model.eval()
        loss = self.step.eval_loss(batch, n_items)
        for group in self.step.loss_groups:
            comm.all_reduce(loss, group)
        self.model.model.train()
        return float(loss)


def model_config(model: Union[str, LlamaConfig, dict, object]) -> Tuple[LlamaConfig, Optional[HFCheckpoint]]:
    """(the decoder's config, the checkpoint to load or None) from a Hugging Face directory, a
    LlamaConfig, a dict of config.json's keys, or a transformers config object."""
    if isinstance(model, str):
        ckpt = HFCheckpoint(model)
        return ckpt.config, ckpt
    if isinstance(model, LlamaConfig):
        return model, None
    if isinstance(model, dict):
        return LlamaConfig.from_dict(model), None
    if hasattr(model, "to_dict"):                  # a transformers PretrainedConfig
        return LlamaConfig.from_dict(model.to_dict()), None
    raise ValueError(f"prepare(model=...) takes a Hugging Face directory, a LlamaConfig, a dict or a "
                     f"transformers config, got {type(model).__name__}")


def prepare(model, pgm=None, *, learning_rate: float = 1e-4, weight_decay: float = 0.0,
            betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, max_grad_norm: float = 1.0,
            warmup_steps: int = 0, max_steps: Optional[int] = None, min_lr_ratio: float = 0.0,
            micro_batches: int = 1, recipe: Optional[Recipe] = None, **recipe_fields):
    """(model, optimizer, step) for your own loop; see the module docstring.

    pgm: minipar.init(...)'s grid, or a ParallelismConfig (init is called), or None (the sizes from
    accelerate's PARALLELISM_CONFIG_* variables, else one process). The optimizer's defaults are
    the Hugging Face Trainer's (AdamW, betas 0.9/0.999, eps 1e-8, no weight decay); the schedule is
    linear warmup then constant, or cosine down to min_lr_ratio x lr when max_steps is given.
    Technique settings (dtype, seed, gradient_checkpointing, pipeline_schedule, lora, ...) are
    recipe.Recipe's fields, given as keywords or as one `recipe`."""
    if recipe is not None and recipe_fields:
        raise ValueError(f"prepare: give the technique settings either as recipe= or as keywords, not both "
                         f"(got recipe and {sorted(recipe_fields)})")
    known = {f.name for f in dataclasses.fields(Recipe)}
    unknown = sorted(set(recipe_fields) - known)
    if unknown:
        raise ValueError(f"prepare: unknown setting(s) {unknown}; the technique settings are "
                         f"{sorted(known)}")
    recipe = (recipe or Recipe(**recipe_fields)).check()     # every mistake before any group exists
    if pgm is None or isinstance(pgm, ParallelismConfig):
        pgm = minipar.init(pgm)
    config, ckpt = model_config(model)
    if ckpt is not None:                           # every tensor's name and shape, from the headers
        ckpt.check(LlamaForCausalLM(config, None, device="meta"))
    parallel = build(config, pgm, recipe, base_model=ckpt)
    optimizer = build_optimizer(parallel.model, lr=learning_rate, weight_decay=weight_decay, betas=betas,
                                eps=eps)
    # no max_steps: warmup, then the rate held (a cosine whose floor is the rate itself)
    scheduler = build_scheduler(optimizer, warmup_steps, max_steps or 1, min_lr_ratio if max_steps else 1.0)
    return parallel, optimizer, TrainStep(parallel, optimizer, scheduler, max_grad_norm, micro_batches)

