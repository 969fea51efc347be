"""Tied embeddings across pipeline stages: two copies of one weight, their gradients summed.

A tied model (tie_word_embeddings: Gemma 2 and 3, Llama 3.2 1B/3B, Qwen2.5 0.5B-3B, SmolLM) reads
one (V, d) table E twice: the embedding looks rows up at the first virtual stage, the lm_head
multiplies by it at the last. On one rank that is one Parameter used twice (models/tied_weights.py).
Under pipeline parallelism the two ends usually sit on different ranks, so, as Megatron-LM does
(its embedding group and _allreduce_word_embedding_grads), each end holds a COPY:

    first stage   model.embed_tokens.weight   E (V/tp, d)   h = E[ids]          dE_embed
    last stage    model.embed_tokens.weight   E (V/tp, d)   logits = h E^T      dE_head
                  (the last stage keeps the embedding module, never called, its weight the lm_head's:
                  the tied pair of a pp 1 model, so names, weight sources and checkpoints are the same)

    once per step, after the last backward and the data-parallel reduction (DDP's all-reduce,
    ZeRO-3's reduce-scatter), before the global norm and clipping (minipar/compose.py Step):
        dE <- dE_embed + dE_head   all-reduce over pgm.pp_ends (first and last pp rank, mesh.py),
                                   at the same (dp_replicate, dp_shard, cp, tp) coordinates

Both copies start equal (the same seeded draw or the checkpoint's embed_tokens.weight), get the
same gradient (a + b is b + a, bitwise) and the same AdamW update (the clipping coefficient is
the global one), so they stay bitwise equal, and equal to one process, whose autograd adds the
same two terms. The global norm counts E once: the last stage's copy carries `tied_copy` and
optim.stage_grad_sq skips it. Where both ends sit on ONE rank (zbv's V puts both on pp rank 0;
pp 1) they stay one Parameter and nothing is summed. A frozen base (LoRA) has no gradient: no sum.

ZeRO-3 sums shard by shard, which is right only if the two copies' shards cover the same
elements. The first stage's embedding is a unit of its own, [E | pad]; on the last stage the root
unit holds what no unit takes (the tied lm_head and embedding, the final norm), so the final norm
is made a unit of its own there (zero3_units): its root is then [E | pad] too, the same length
over the same dp_shard_cp size, shard r holding the same elements on both ends. attach() checks it.

Communication: one all-reduce of V/tp x d fp32 elements per step over the two end ranks (wire
2 (n-1)/n = 1 x those 4 V/tp d bytes per end rank, n = 2; middle stages take no part); under ZeRO-3
of its padded shard, (V/tp) x d / dp_shard_cp elements. Memory: the last stage holds E, its
gradient and its AdamW states (V/tp x d x 16 bytes fp32; / dp_shard_cp under ZeRO-3), which an
untied model's lm_head would hold too. Nothing else: the copies never travel. Under zb_h1 / zbv
the lm_head's matmul is split like every Linear (untie_matmul). Stages stepping alone
(pipeline_overlap_steps) sum inside their schedule (Step.schedule), before each steps.
"""
from __future__ import annotations

from typing import Optional

import torch

from minipar import comm

from .schedules import stage_owners

TIED = "model.embed_tokens.weight"


def ends_apart(schedule: str, pp_size: int, chunks: int = 1) -> bool:
    """Whether the first and the last virtual stage live on different pp ranks (not under zbv's V,
    not at pp 1)."""
    owners = stage_owners(schedule, pp_size, chunks)
    return owners[0] != owners[-1]


def holds_copy(config, is_first: bool, is_last: bool) -> bool:
    """Whether a stage keeps a copy of the tied embedding for its lm_head: a tied model's last
    stage when the first one is elsewhere."""
    return bool(config.tie_word_embeddings) and is_last and not is_first


def zero3_units(stage, classes) -> tuple:
    """A stage's ZeRO-3 unit classes: the model's `classes`, and on a stage holding the copy the
    final norm's class too, so that the root unit holds the tied weight alone (module docstring)."""
    classes = tuple(classes)
    if holds_copy(stage.config, stage.is_first, stage.is_last):
        classes += (type(stage.model.norm),)
    return classes


def untie_matmul(stage):
    """The stage, its lm_head's matmul back to the plain one where tying had set summable_linear
    (models/tied_weights.py), so that a zero-bubble schedule can split it (split_backward.py): W
    then computes dE_head as a tensor of its own, into which autograd adds the embedding's (zbv's
    rank 0 holds both ends) at the price of one (V/tp, d) buffer, or nothing is added (a copy)."""
    if stage.lm_head is not None and stage.config.tie_word_embeddings:
        vars(stage.lm_head).pop("local_linear", None)
    return stage


def _local_tensor(model) -> Optional[torch.Tensor]:
    """What the optimizer steps of E on this rank: its ZeRO-3 shard (a unit holding E alone), or
    the Parameter itself; None when this stage holds no copy. A unit holding more than E is a bug of
    zero3_units (no input can cause it), hence a RuntimeError, not a refusal of a config."""
    manager = getattr(model, "zero3", None)
    if manager is None:
        return dict(model.named_parameters()).get(TIED)
    for unit in manager.units:
        names = [s.name for s in unit.layout.slots]
        if TIED in names:
            if names != [TIED]:
                raise RuntimeError(f"tied embeddings under pp x ZeRO-3: the unit holding {TIED} also holds "
                                 f"{[n for n in names if n != TIED]}, so the two ends' shards would cover "
                                 f"different elements; the unit must hold the tied weight alone")
            return unit.shard
    return None


class TiedEnds:
    """This rank's end of the tied pair: `sum_grads()` all-reduces its copy's gradient with the
    other end's (collective over pgm.pp_ends)."""

    def __init__(self, tensor: torch.Tensor, group):
        self.tensor, self.group = tensor, group

    def sum_grads(self) -> None:
        if self.tensor.grad is None:             # a stage that never reached it still joins the sum
            self.tensor.grad = torch.zeros_like(self.tensor)
        comm.all_reduce(self.tensor.grad, self.group)


def attach(model, pgm, schedule: str, chunks: int = 1) -> Optional[TiedEnds]:
    """The TiedEnds of a built stage (after ZeRO-3 or DDP, before the optimizer is used), or None
    where nothing is summed: an untied or frozen model, both ends on one rank, a middle stage.
    Marks the last stage's copy `tied_copy` (the global norm counts E once, on the first stage)."""
    if pgm.pp.size == 1 or not model.config.tie_word_embeddings or \
            not ends_apart(schedule, pgm.pp.size, chunks):
        return None
    tensor = _local_tensor(model)
    if tensor is None or not tensor.requires_grad:
        return None
    if not model.is_first:
        tensor.tied_copy = True
    return TiedEnds(tensor, pgm.pp_ends)
