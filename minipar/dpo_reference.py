"""DPO's reference model: the three ways minipar holds it, and the no-gradient forward that reads it.

DPO needs log p_ref(y | x) for every row of every micro-batch, (rows,) floats, from a model that
never trains (the reference ref of minipar/dpo/objective.py). Three ways to have it:

    lora         the policy itself with its LoRA adapters switched off (lora.adapters_off: PEFT's
                 disable_adapter; TRL's choice with a peft_config): no second copy at all
    precomputed  the starting weights' numbers, one forward pass over the data before step 1 (TRL's
                 precompute_ref_log_probs: true): (rows,) floats per batch, all-gathered over dp and
                 kept on the host, no model beside the policy during training
    frozen       a second model (TRL's default ref_model of a full fine-tune, create_reference_model):
                 frozen_copy() below builds it through compose.build(frozen=True) on the POLICY's grid
                 from the same starting weights, so it is cut like the policy (tp slices, pp stages,
                 ep experts) and, where the policy is ZeRO-3 sharded, sharded over dp_shard_cp too;
                 every parameter has requires_grad off: no gradient, no optimizer state, never stepped.
                 Each micro-batch of a step runs through it under no_grad before the policy's forward

Memory per rank of the frozen copy, P parameters, N = dp_shard x cp (the policy's 16 P/N in fp32
masters, gradients and AdamW moments):

    ZeRO-3 (N > 1)   P/N x 4 bytes (2 under bf16: the dtype its gathers cast to anyway, so the same
                     numbers), and while it runs its gathered window (the root + 1 + prefetch units,
                     as the policy's; the policy's own units are all freed between steps) and one
                     layer's no-grad activations, all freed at the end of its forward
    no ZeRO-3        this rank's tp / pp slice in fp32 (P/tp/pp x 4 bytes); bf16 compute by autocast,
                     as the policy's

Time per step: lora and frozen run one more forward per micro-batch (no backward: about a third of
the step's compute); frozen's ZeRO-3 gathers its units again per micro-batch (P x e bytes over
dp_shard_cp, hidden behind its layers' compute as the policy's are). Under pp the step's M
micro-batches go down the pipeline together (compose.forward_loss on the list: pipeline_parallel's
forward_only, the forward half of AFAB): stage s runs micro-batch m while stage s + 1 runs m - 1,
M + p - 1 stage forwards where one at a time took M p. precomputed costs one such pass per batch,
once per start, its batches pipelined a window at a time. minipar/plan/reference_cost.py prices each.

Which reference a model can hold (check_reference): lora needs the adapters; frozen needs no adapters
(with LoRA the adapters-off base IS the frozen copy, at no cost) and the copy built on the policy's
grid. Every layout holds each: the copy is the policy's build without its training parts.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch

from minipar.compose import ParallelModel, build, forward_loss
from minipar.dpo import PairLoss

REFERENCES = ("lora", "precomputed", "frozen")


def check_reference(reference: str, lora: bool, ref_model: Optional[ParallelModel] = None, pgm=None) -> None:
    """The reference choice this model can hold, or a ValueError naming the ones it can (before any
    collective: it reads only the arguments)."""
    if reference not in REFERENCES:
        raise ValueError(f"dpo reference {reference!r} is not one of {list(REFERENCES)}")
    if reference == "lora" and not lora:
        raise ValueError("dpo reference 'lora' (the adapters switched off) needs adapter: lora; a full "
                         "fine-tune uses reference 'precomputed' (precompute_ref_log_probs: true) or "
                         "'frozen' (a frozen sharded copy: precompute_ref_log_probs: false)")
    if reference == "frozen":
        if lora:
            raise ValueError("dpo reference 'frozen' with LoRA: the base with the adapters off is that "
                             "copy already, at no memory; use reference 'lora' (or 'precomputed')")
        if ref_model is None:
            raise ValueError("dpo reference 'frozen' needs ref_model=frozen_copy(policy, config, "
                             "base_model) (minipar/dpo_reference.py)")
        if pgm is not None and ref_model.pgm is not pgm:
            raise ValueError("dpo reference 'frozen': the copy was built on another grid than the policy's; "
                             "build it with frozen_copy(policy, ...) on the policy's pgm")
    elif ref_model is not None:
        raise ValueError(f"dpo reference {reference!r} takes no ref_model (only 'frozen' runs a copy)")


def frozen_copy(policy: ParallelModel, config, base_model=None, log: Callable = lambda msg: None
                ) -> ParallelModel:
    """A frozen copy of the policy's STARTING weights on its grid: compose.build(frozen=True) with the
    policy's recipe less LoRA and activation checkpointing (nothing to recompute without a
    backward). config: the model's LlamaConfig; base_model: the policy's checkpoint (None: the
    recipe's seed, as the policy was drawn). Collective (ZeRO-3 shards it): every rank calls it."""
    recipe = dataclasses.replace(policy.recipe, lora=None, gradient_checkpointing=False)
    ref = build(config, policy.pgm, recipe, base_model=base_model, device=policy.device, log=log,
                frozen=True)
    ref.model.eval()
    nbytes = sum(p.numel() * p.element_size() for p in ref.model.parameters())
    log("DPO reference: a frozen copy of the starting weights, "
        + ("ZeRO-3 sharded like the policy" if ref.sharded else "this rank's slice")
        + f", {nbytes / 2**20:.1f} MiB on this rank (no gradients, no optimizer state)")
    return ref


@torch.no_grad()
def record_logps(pm: ParallelModel, micro: List[dict], pgm, loss_type: str,
                 forward: Optional[Callable] = None) -> None:
    """Each micro-batch's (rows,) log-probs under `pm` into mb["ref_logps"], no gradient: one recording
    PairLoss over all of them where the head takes num_items_in_batch (objective.py: it finds each
    micro-batch by its labels), one forward pass over the list (forward(micro, objective):
    compose.forward_loss by default, a Step passes its eval_loss; under pp the micro-batches
    pipelined). Under pp the numbers are real on the last stage and zeros elsewhere, where no head
    reads them."""
    forward = forward or (lambda mbs, objective: forward_loss(pm, mbs, objective))
    was_training = pm.model.training
    pm.model.eval()
    try:
        rec = PairLoss(list(micro), 1, pgm, 1.0, loss_type, record=True)
        forward(list(micro), rec)
        for i, mb in enumerate(micro):
            got = rec.reference(i)
            mb["ref_logps"] = got if got is not None else torch.zeros(mb["labels"].shape[0], device=pm.device)
    finally:
        pm.model.train(was_training)
