"""The composition: one decoder trained under every dimension at once. Read this file first.

Every technique lives in its own folder and knows nothing of the others; this file says which are
applied, in what order and why, and runs one optimizer step with all of them, as picotron's
train.py does. The trainer (minipar/trainer/) and the Python API (minipar/api.py) both build
their model and run their step here.

Building, in order (build()):

    0. the grid          pgm = minipar.init(ParallelismConfig(...)): the groups of     mesh.py
                         pp x dp_replicate x dp_shard x cp x tp (+ ep borrowed from dp_shard x cp)
    1. the decoder       LlamaForCausalLM(config, pgm, tensor_parallel=False) on the meta
                         device: plain nn.Linear layers, shapes, no memory. CP and EP are how its
                         layers are built: attention over the sequence split of pgm.cp
                         (context_parallel/), experts over pgm.ep (expert_parallel/)
       TP/SP             parallelize(model, pgm.tp, ...) swaps its layers from outside: q/k/v/gate/
                         up column-parallel, o/down row-parallel, the vocabulary split, the norms'
                         weights summed over tp under SP                tensor_parallel/parallelize.py
    2. LoRA              the base frozen, the adapters made now (before the cut, so each goes with
                         its layer; kept out of ZeRO-3: they are small and whole)        lora/
    3. the pipeline cut  this rank keeps its stage: its layers (chunks), the embedding on the
                         first, the norm and lm_head on the last         pipeline_parallel/stage.py
    4. ZeRO-3 or DDP     dp_shard_cp > 1: ZeRO-3 over it (each unit's parameters sharded, each rank
                         materialises only its shard, from the seed or the checkpoint's slices;
                         HSDP all-reduces over dp_replicate)                              zero3/
                         else each rank materialises its tensors, and DDP all-reduces gradients
                         over dp_cp (LoRA on ZeRO-3: the adapters, whole, by DDP)  data_parallel/
    5. checkpointing     activation checkpointing is a setting each layer reads in forward: late,
                         since it changes nothing that was built     models/activation_checkpoint.py
    6. torch.compile     compile: each decoder layer's forward compiled in place, last, so that
                         every hook above stays outside the compiled region (checkpointing moves
                         inside it; the collectives are graph boundaries)  minipar/regional_compile.py

One optimizer step (Step), B samples of T tokens, M micro-batches per rank:

    N = the non-ignored labels of the GLOBAL batch (the caller counts them: no communication);
    every micro-batch's loss is its token losses summed / N, so the ranks' losses SUM to the mean
    pp == 1    for m in 0..M-1: model(micro_m).backward()           all but the last under no_sync
    pp > 1     run_schedule(stage, order, micro, N): the schedule's forwards and backwards, the
               activations and their gradients sent between stages          pipeline_parallel/
    sync       inside the last backward: ZeRO-3 reduce-scatters (HSDP then all-reduces), DDP
               all-reduces; gradients are SUMMED over ranks, which with the /N above gives one
               process's gradient of the global mean loss (FSDP2 averages instead, over a per-rank
               mean: the same gradient when every rank holds as many tokens)
    tied       pp > 1, a tied embedding on two stages: the copies' gradients all-reduced over the
               first and last stage (pipeline_parallel/tied_ends.py)
    loss       all-reduce over dp_cp (and over pp: only the last stage holds a loss)
    norm       the global gradient norm: squares summed over tp, dp_shard_cp and pp, each element
               counted once (optim.py); clip by max_grad_norm
    update     AdamW on the local shards, the lr schedule, zero_grad

Communication of the step itself, beyond the techniques': an all-reduce of one number over dp_cp
(and pp) for the loss, and the norm's (optim.py). Nothing is read on the host: the loss and the
norm are device tensors the caller reads when it logs.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional, Sequence

import torch

import minipar
from minipar import comm
from minipar.data_parallel import replicate, replicate_naive
from minipar.lora import add_lora, check_targets, load_adapters, lora_parameters, lora_summary, lora_targets
from minipar.optim import OptimizerStep
from minipar.pipeline_parallel import (
    OverlapSteps,
    ScheduleHooks,
    build_stage,
    exchange_plan,
    forward_only,
    forward_window,
    run_schedule,
    schedule_order,
)
from minipar.pipeline_parallel.tied_ends import attach as attach_tied
from minipar.recipe import Recipe
from minipar.regional_compile import compile_layers
from minipar.tensor_parallel.parallelize import parallelize
from minipar.zero3 import fully_shard
from models.activation_checkpoint import ActivationCheckpointing
from models.llama import LlamaForCausalLM
from models.llama_init import SeededInit, materialize
from models.llama_layer import LlamaDecoderLayer
from models.moe_metrics import MoEStepMetrics


class ParallelModel:
    """This rank's piece of the decoder with every technique applied (build() makes it)."""

    def __init__(self, model, pgm, recipe: Recipe, device, n_params: int, lora_targets=None):
        self.model, self.pgm, self.recipe, self.device = model, pgm, recipe, device
        self.n_params, self.lora_targets = n_params, lora_targets
        self.sharded = pgm.dp_shard_cp.size > 1
        self.grad_sync = None                     # DDP's wrapper, when gradients are all-reduced
        self.no_sync_owner = None                 # whose no_sync() the micro-batches before the last use
        self.compiled = None                      # regional_compile.CompileStats when compile is on
        self.tied = None                          # a pipeline's tied ends (pipeline_parallel/tied_ends.py)

    def autocast(self):
        """bf16 compute: autocast, unless ZeRO-3 already casts the gathered weights itself."""
        if self.recipe.bf16 and not self.sharded:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def loss(self, batch: dict, n_items, aux_weight: float = 0.0) -> torch.Tensor:
        """One micro-batch's loss: its token losses summed / n_items, plus aux_weight x an MoE's
        load-balancing loss (0 in evaluation, where the loss is the cross-entropy alone)."""
        with self.autocast():
            return self.model(batch["input_ids"], position_ids=batch.get("position_ids"),
                              labels=batch["labels"], num_items_in_batch=n_items,
                              document_ids=batch.get("document_ids"), aux_weight=aux_weight)


def build(config, pgm, recipe: Recipe, base_model=None, device=None, log: Callable = lambda msg: None,
          frozen: bool = False) -> ParallelModel:
    """Steps 1-5 of the module docstring. `config`: the model's LlamaConfig; `base_model`: a
    Hugging Face checkpoint (models/hf_checkpoint.py) whose slices each rank reads, else weights
    drawn from recipe.seed (the same full weights on every layout, sliced). frozen: a copy that is
    only ever run forward (DPO's reference, minipar/dpo_reference.py): requires_grad off before
    ZeRO-3 (frozen units: no gradient, no reduce-scatter), no DDP, no LoRA; sharded under bf16,
    its shards are bf16 (what the gathers cast them to anyway: the same numbers, half the bytes)."""
    if frozen and recipe.lora is not None:
        raise ValueError("build(frozen=True): a frozen copy takes no LoRA adapters (recipe.lora=None)")
    device = device or minipar.default_device()
    # 1. the decoder on meta, plain, with CP and EP in its layers; then TP/SP applied to it
    model = LlamaForCausalLM(config, pgm, seed=recipe.seed, device="meta", tensor_parallel=False)
    parallelize(model, pgm.tp, pgm.config.sequence_parallel, pgm.config.tp_async_overlap)
    model.tie_weights()                       # a tied lm_head: the embedding's rows, after the swap
    if frozen:
        model.requires_grad_(False)
        if recipe.bf16 and pgm.dp_shard_cp.size > 1:
            for p in model.parameters():
                p.data = p.data.to(torch.bfloat16)
    n_params = sum(math.prod(p.tp_full_shape) for p in model.parameters())
    source = base_model.source(pgm.tp, device) if base_model is not None else \
        SeededInit(model, recipe.seed, pgm.tp, device)
    # 2. LoRA: adapters real now, on the whole model (global names, a seed per adapter name)
    targets = None
    if recipe.lora is not None:
        lo = recipe.lora
        targets = check_targets(lo.target_modules, lo.target_linear, lora_targets(model),
                                model.lora_target_modules)
        add_lora(model, targets, lo.r, lo.alpha, lo.dropout, seed=recipe.seed, device=device)
        if lo.model_dir:
            load_adapters(model, lo.model_dir, pgm.tp)
        log(lora_summary(model, targets, lo.r, lo.alpha, n_params, lo.model_dir))
    # 3. the pipeline cut: this rank's stage only (before ZeRO-3, DDP and the optimizer)
    if pgm.pp.size > 1:
        model = build_stage(model, pgm, recipe.chunks, recipe.pipeline_layers, recipe.pipeline_schedule)
    pm = ParallelModel(model, pgm, recipe, device, n_params, targets)
    # 4. ZeRO-3 over dp_shard_cp whenever it has more than one rank (cp-only layouts too, as
    # accelerate's FSDP mesh: the cp ranks hold the same parameters, so they share them out)
    if pm.sharded:
        fully_shard(model, pgm, prefetch=recipe.zero3_prefetch,
                    reshard_after_forward=recipe.reshard_after_forward,
                    param_dtype=torch.bfloat16 if recipe.bf16 else None,
                    reduce_dtype=torch.float32 if recipe.bf16 else None, init=source,
                    ignored_params=lora_parameters(model))
    else:
        materialize(model, source)
    # replicas only: DDP. With LoRA on ZeRO-3 too: the frozen shards have no gradient, and the
    # adapters are whole on every rank (lora/adapter.py says why)
    if pgm.dp_cp.size > 1 and not frozen and (not pm.sharded or recipe.lora is not None):
        pm.grad_sync = (replicate_naive if recipe.ddp == "naive" else replicate)(model, pgm.dp_cp)
    pm.no_sync_owner = pm.grad_sync if not pm.sharded or recipe.lora is not None else \
        (None if recipe.sync_each_batch else model.zero3)
    # a tied embedding whose two ends sit on different stages: a copy on each, summed each step
    pm.tied = attach_tied(model, pgm, recipe.pipeline_schedule, recipe.chunks)
    # 5. activation checkpointing: read by each layer's forward (the stage's, under pp)
    if recipe.gradient_checkpointing:
        mode = "full" if recipe.gradient_checkpointing is True else recipe.gradient_checkpointing
        model.gradient_checkpointing = ActivationCheckpointing(mode, recipe.selective_ac_option)
    # 6. torch.compile of each decoder layer's forward: the hooks of 4 stay outside; checkpointing
    # moves inside the compiled region where the layer traces whole (then the stage no longer
    # applies it), else stays around the layer call (regional_compile.py)
    if recipe.compile:
        layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
        boundaries = pgm.tp.size > 1 or pgm.cp.size > 1 or any(m.is_moe for m in layers)
        pm.compiled, inside = compile_layers(layers, recipe.compile_backend, recipe.compile_mode,
                                             model.gradient_checkpointing, boundaries)
        if inside:
            model.gradient_checkpointing = False
    return pm


class Step:
    """One optimizer step of a ParallelModel: `step(n_items, micro_batches)` -> dict(loss,
    grad_norm, lr, moe), the loss and norm as device tensors. `backward` alone runs the
    forwards, backwards and gradient sync (a caller that steps the optimizer itself, or a
    pipeline stage that steps without waiting for the others, pipeline_parallel/overlap_steps.py)."""

    def __init__(self, pm: ParallelModel, optimizer, scheduler, max_grad_norm: Optional[float],
                 num_micro: int, overlap: bool = False):
        """overlap: pipeline stages step without waiting for each other (pipeline_overlap_steps:
        pipeline_parallel/overlap_steps.py; pp > 1 only), their loss and norm read a step late."""
        self.pm, self.pgm, self.num_micro = pm, pm.pgm, num_micro
        self.tail = OptimizerStep(pm.model, optimizer, scheduler, max_grad_norm, pm.pgm)
        self.pipelined = pm.pgm.pp.size > 1
        self.alone = None
        self.transport = comm                     # posts a pipeline's exchanges (a test may record them)
        if self.pipelined:
            r, pp = pm.recipe, pm.pgm.pp
            self.order = schedule_order(r.pipeline_schedule, pp.size, num_micro, pp.rank, r.chunks)
            # the sends and receives of every slot, paired so that NCCL cannot deadlock (p2p_plan.py)
            self.plan = exchange_plan(r.pipeline_schedule, pp.size, num_micro, r.chunks, pp.rank,
                                      side=pm.model.pipeline_aux is not None)
            # what crosses stages has the compute dtype: bf16 in a bf16 run (half the bytes)
            self.act_dtype = torch.bfloat16 if r.bf16 else torch.float32
            self.reducers = [x for x in (pm.grad_sync, getattr(pm.model, "zero3", None)) if x is not None]
            if overlap:
                self.alone = OverlapSteps(self.schedule, self.tail, pm.model.parameters, pm.pgm)

    def __call__(self, n_items, micro: Sequence[dict]) -> dict:
        if self.alone is not None:                # a stage stepping alone: its loss comes later
            out = self.alone(n_items, micro)
        else:
            loss, moe = self.backward(n_items, micro)
            out = dict(loss=loss, **self.tail(), moe=moe)
        if self.pm.compiled is not None and self.pgm.global_rank == 0:
            self.pm.compiled.report_once(print)   # the first step compiled every graph
        return out

    def settle(self) -> None:
        """Check the last optimistic update of a stage stepping alone (post_validate.py)."""
        if self.alone is not None:
            self.alone.settle()

    @property
    def validator(self):
        """The post-validator of a stage stepping alone with clipping, else None."""
        return self.alone.validator if self.alone is not None else None

    def backward(self, n_items, micro: Sequence[dict]):
        """Forwards and backwards of the step's micro-batches, gradients reduced: (the loss summed
        over dp_cp and pp, an MoE's step figures or {})."""
        if self.pipelined:
            loss = self.schedule(n_items, micro)
            comm.all_reduce(loss, self.pgm.pp)     # only the last stage's is not zero
            aux = self.pm.model.pipeline_aux       # an MoE's figures (models/moe_aux.py), or none
            return loss, (aux.step_metrics(loss.device, self.num_micro) if aux is not None else {})
        pm, M = self.pm, len(micro)
        loss_sum = torch.zeros((), dtype=torch.float64, device=pm.device)
        moe = MoEStepMetrics(self.pgm, pm.device)
        for m, batch in enumerate(micro):
            unsynced = pm.no_sync_owner is not None and m < M - 1
            with pm.no_sync_owner.no_sync() if unsynced else contextlib.nullcontext():
                loss = pm.loss(batch, n_items, aux_weight=1.0 / (self.pgm.dp.size * M))
                loss.backward()                   # the last one reduce-scatters / all-reduces
            loss_sum += loss.detach().double()
            moe.add(pm.model.moe_metrics)
        comm.all_reduce(loss_sum, self.pgm.dp_cp)
        return loss_sum, moe.reduce()

    def schedule(self, n_items, micro) -> torch.Tensor:
        """The micro-batches through this rank's stage in the schedule's order; every backward but
        the rank's last under the reducers' no_sync, so the last one reduces it all, once."""
        with contextlib.ExitStack() as unsynced:
            for reducer in self.reducers:
                unsynced.enter_context(reducer.no_sync())

            def before_backward(action, last: bool):
                if last:                          # the step's final B (or W under zero bubble)
                    unsynced.close()

            loss = run_schedule(self.pm.model, self.order, self.pgm, micro, n_items, act_dtype=self.act_dtype,
                                hooks=ScheduleHooks(before_backward), autocast=self.pm.autocast,
                                plan=self.plan, transport=self.transport)
        if self.pm.tied is not None:              # the two copies of a tied embedding: dE summed
            self.pm.tied.sum_grads()
        comm.all_reduce(loss, self.pgm.dp_cp)
        return loss

    def eval_loss(self, batch, n_items) -> torch.Tensor:
        """An evaluation batch forward only, or a list of them pipelined (forward_loss below)."""
        return forward_loss(self.pm, batch, n_items, self.transport)

    @property
    def eval_window(self) -> int:
        """How many evaluation batches to hand eval_loss at once: under pp forward_window(pp), else 1."""
        return forward_window(self.pgm.pp.size) if self.pipelined else 1

    @property
    def loss_groups(self):
        """The groups an evaluation's loss shares are summed over."""
        return (self.pgm.dp_cp, self.pgm.pp) if self.pipelined else (self.pgm.dp_cp,)


@torch.no_grad()
def forward_loss(pm: ParallelModel, batch, n_items, transport=comm) -> torch.Tensor:
    """A batch forward only, no aux loss: this rank's share of its loss (a float64 device tensor;
    zero off the last stage); summed over dp_cp (and pp) it is the batch's loss. A list of batches
    (n_items one for all, or one each) gives their (M,) shares: under pp pipelined, the forward half
    of AFAB (pipeline_parallel's forward_only: stage s on batch m while stage s + 1 is on m - 1)."""
    if pm.pgm.pp.size > 1:
        return forward_only(pm.model, pm.pgm, batch, n_items, autocast=pm.autocast, transport=transport,
                            act_dtype=torch.bfloat16 if pm.recipe.bf16 else torch.float32)
    if isinstance(batch, dict):
        return pm.loss(batch, n_items).double()
    items = n_items if isinstance(n_items, (list, tuple)) else [n_items] * len(batch)
    return torch.stack([pm.loss(b, n).double() for b, n in zip(batch, items)])
