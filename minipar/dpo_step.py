"""One DPO step on any layout: the pairs' rows split like any batch, the reference's log-probs,
then compose.Step with the DPO objective in place of the token count. No second copy of the step.

The plan, in order (Rafailov et al., 2023; TRL's DPOTrainer is the reference implementation):

    rows        a global batch of P pairs is 2P rows, [c_0, r_0, c_1, r_1, ...] (B = 2P, T): chosen
                and rejected of a pair side by side, so ONE forward runs both (TRL's
                concatenated_forward). batch_split.local_batch cuts it as any batch: dp ranks
                take contiguous row blocks, micro-batches contiguous blocks of those, cp ranks
                their sequence chunks, tp ranks the same rows. A pair stays on one rank when
                every micro-batch holds an even number of rows: check_pair_split says so before
                any collective (the trainer counts global_batch_size in PAIRS, as TRL's batch
                sizes do, so its rows always split evenly)
    reference   log p_ref(y | x) per row, no gradient (minipar/dpo_reference.py: what each costs):
                  lora         the same model with its adapters off (lora.adapters_off: PEFT's
                               disable_adapter; no second copy, no memory; one more forward per
                               micro-batch, about +1/3 of the step's compute)
                  precomputed  a full fine-tune: one pass over the data before training with the
                               starting weights (TRL's precompute_ref_log_probs), every row's
                               number kept on every rank ((rows,) floats: nothing beside the
                               data), no forward during training
                  frozen       a full fine-tune: a frozen copy of the starting weights on the same
                               layout (dpo_reference.frozen_copy: ZeRO-3 sharded like the policy,
                               no gradient, no optimizer state), one forward per micro-batch
                each pass is a forward with a recording PairLoss (dpo_reference.record_logps): the
                micro-batch loop, or under pp the pipeline's forward_only over the step's micro-
                batches, pipelined (the forward half of AFAB), whose last stage records
    objective   minipar/dpo/objective.py PairLoss: passed where num_items_in_batch goes, it takes
                the head's per-row sums of token log-probs (exact under tp, summed over cp) and
                gives each micro-batch's share of the mean pair loss; compose.Step runs the
                forwards, backwards (pp: the schedule), gradient sync, clipping and AdamW
    metrics     TRL's rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
                logps/chosen, logps/rejected: sums all-reduced over dp_cp and pp, one vector

Communication beyond compose.Step's: the objective's all-reduces over cp (2 of `rows` numbers per
micro-batch), the metrics' one all-reduce of 6 numbers, and with LoRA the reference forwards
(the layout's usual forward traffic, once more per micro-batch). A precomputed reference
all-gathers each pass batch's (rows,) log-probs over dp and sums them over pp, once before training.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from minipar import comm
from minipar.batch_split import local_batch
from minipar.compose import ParallelModel, Step, forward_loss
from minipar.dpo import PairLoss, check_loss
from minipar.dpo_reference import REFERENCES, check_reference, record_logps
from minipar.lora import adapters_off

__all__ = ["DPOStep", "REFERENCES", "check_pair_split", "check_reference", "pair_rows"]


def check_pair_split(rows: int, pgm, num_micro: int = 1) -> None:
    """A ValueError (before any collective) unless every micro-batch of every dp rank holds whole pairs."""
    parts = pgm.dp.size * num_micro
    if rows % 2 or rows % parts or (rows // parts) % 2:
        raise ValueError(
            f"DPO: {rows} rows ({rows // 2} pairs of chosen + rejected) do not split into whole pairs over "
            f"dp {pgm.dp.size} x {num_micro} micro-batch(es): each micro-batch needs an even number of "
            f"rows; use a pair count that is a multiple of {parts}")


def pair_rows(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(P, T) and (P, T) -> (2P, T) rows c_0, r_0, c_1, r_1, ..."""
    if chosen.shape != rejected.shape:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} differ in shape")
    return torch.stack([chosen, rejected], dim=1).flatten(0, 1)


class DPOStep:
    """One DPO optimizer step of a compose.Step: `step(input_ids, labels, ref_logps=None)` on the
    GLOBAL batch of pair rows (the same on every rank) -> dict(loss, grad_norm, lr, moe, metrics).
    ref_model: the frozen copy of reference 'frozen' (dpo_reference.frozen_copy), else None;
    label_smoothing: TRL's eps of the sigmoid (cDPO) and robust losses (objective.py)."""

    def __init__(self, step: Step, beta: float = 0.1, loss_type: str = "sigmoid", reference: str = "lora",
                 ref_model: Optional[ParallelModel] = None, label_smoothing: float = 0.0):
        check_loss(loss_type, label_smoothing)              # on every rank, before any collective
        check_reference(reference, step.pm.recipe.lora is not None, ref_model, step.pgm)
        self.step, self.pm, self.pgm = step, step.pm, step.pgm
        self.beta, self.loss_type, self.reference = float(beta), loss_type, reference
        self.label_smoothing = float(label_smoothing)
        self.ref_model = ref_model

    def objective(self, micro: List[dict], n_pairs: int) -> PairLoss:
        """The step's PairLoss of `micro` (n_pairs: the global batch's), with this step's loss."""
        return PairLoss(micro, n_pairs, self.pgm, self.beta, self.loss_type,
                        label_smoothing=self.label_smoothing)

    def local(self, input_ids, labels, ref_logps=None, position_ids=None, num_micro: Optional[int] = None
              ) -> List[dict]:
        """This rank's micro-batches of the global pair rows, each with its rows' "ref_logps"
        (num_micro: the step's unless given; an evaluation takes 1)."""
        B, M = input_ids.shape[0], num_micro or self.step.num_micro
        check_pair_split(B, self.pgm, M)
        micro = [local_batch(input_ids, labels, self.pgm, m, M, device=self.pm.device,
                             position_ids=position_ids) for m in range(M)]
        if ref_logps is not None:
            per = B // (self.pgm.dp.size * M)
            for m, mb in enumerate(micro):
                first = self.pgm.dp.rank * (B // self.pgm.dp.size) + m * per
                mb["ref_logps"] = ref_logps[first:first + per].to(self.pm.device)
        return micro

    def record(self, micro: List[dict], model: Optional[ParallelModel] = None) -> None:
        """`model`'s log-probs (the policy's as it is, by default) of each micro-batch's rows into
        mb["ref_logps"] (no gradient; under pp real on the last stage, zeros elsewhere)."""
        if model is None:
            record_logps(self.pm, micro, self.pgm, self.loss_type, forward=self.step.eval_loss)
        else:
            record_logps(model, micro, self.pgm, self.loss_type,
                         forward=lambda mbs, rec: forward_loss(model, mbs, rec, self.step.transport))

    def reference_logps(self, micro: List[dict]) -> None:
        """The reference's log-probs of each micro-batch by a forward: the adapters off, or the copy."""
        if self.reference == "lora":
            with adapters_off(self.pm.model):
                self.record(micro)
        elif self.reference == "frozen":
            self.record(micro, self.ref_model)
        else:
            raise ValueError("DPO with a precomputed reference: pass ref_logps (precompute_reference)")

    def __call__(self, input_ids, labels, ref_logps: Optional[torch.Tensor] = None,
                 position_ids=None) -> dict:
        micro = self.local(input_ids, labels, ref_logps, position_ids)
        if self.reference != "precomputed" or ref_logps is None:
            self.reference_logps(micro)
        objective = self.objective(micro, input_ids.shape[0] // 2)
        out = self.step(objective, micro)
        out["metrics"] = objective.metrics(self.pm.device)
        return out

    @torch.no_grad()
    def precompute_reference(self, input_ids, labels, position_ids=None, num_batches: int = 1
                             ) -> torch.Tensor:
        """(rows,) reference log-probs of global batches of pair rows with the current weights, the
        same on every rank: num_batches global batches one after the other in the rows, each split as
        one micro-batch per rank, all of them in one forward pass (pipelined under pp);
        all-gathered over dp, summed over pp."""
        rows = input_ids.shape[0] // num_batches
        if rows * num_batches != input_ids.shape[0]:
            raise ValueError(f"precompute_reference: {input_ids.shape[0]} rows do not split into "
                             f"num_batches={num_batches} global batches of equal size")
        check_pair_split(rows, self.pgm, 1)
        part = (lambda t, k: None if t is None else t[k * rows:(k + 1) * rows])
        micro = [local_batch(part(input_ids, k), part(labels, k), self.pgm, 0, 1, device=self.pm.device,
                             position_ids=part(position_ids, k)) for k in range(num_batches)]
        self.record(micro)
        mine = torch.stack([mb["ref_logps"].float() for mb in micro])    # (batches, rows / dp)
        if self.pgm.pp.size > 1:                  # the last stage's numbers to every stage
            comm.all_reduce(mine, self.pgm.pp)
        # (dp x batches, rows / dp) in rank order -> each batch's rows in order
        got = comm.all_gather(mine, self.pgm.dp).view(self.pgm.dp.size, num_batches, -1)
        return got.transpose(0, 1).reshape(-1).cpu()
