"""The DPO objective: a loss of per-sequence log-probabilities, exact on every layout.

Direct Preference Optimization (Rafailov et al., 2023) trains on pairs (prompt x, chosen y_c,
rejected y_r). With pi the policy and ref a frozen reference, and log p(y | x) the SUM of the
response tokens' log-probabilities (the prompt's labels are -100 and do not count):

    pi_c, pi_r, ref_c, ref_r          (P,) one number per pair and model
    z      = (pi_c - ref_c) - (pi_r - ref_r)                      the implicit reward margin / beta
    eps    = label_smoothing in [0, 0.5): the chance that a pair's label is flipped (TRL's, Axolotl's
             dpo_label_smoothing)
    sigmoid  loss_p = -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)
                                                                    Rafailov et al., eq. 7; eps > 0 is
             conservative DPO (cDPO, Mitchell 2023): the cross-entropy against the smoothed label;
             eps = 0 computes -log sigmoid(beta z) alone (bitwise the plain loss)
    robust   loss_p = (-(1 - eps) log sigmoid(beta z) + eps log sigmoid(-beta z)) / (1 - 2 eps)
             Chowdhury et al. 2024: an unbiased estimate of the clean-label loss under label noise
             eps (eps = 0: the sigmoid loss)
    hinge    loss_p = relu(1 - beta z)                              SLiC (Zhao et al. 2023)
    ipo      loss_p = (z - 1 / (2 beta))^2                          Azar et al. 2023, eq. 17, with
             log p the MEAN over the response's tokens, as TRL's DPOTrainer averages them for ipo
    loss   = mean over the P pairs of the GLOBAL batch

hinge and ipo take no eps (TRL ignores label_smoothing there, with a warning; minipar refuses eps >
0 with them, SMOOTHED lists the loss types that use it). With the reference equal to the policy,
z = 0: sigmoid and robust give ln 2 exactly for any eps ((1 - eps) ln 2 + eps ln 2, and
((1 - eps) ln 2 - eps ln 2) / (1 - 2 eps)), hinge 1, ipo 1 / (4 beta^2).

How one micro-batch is laid out: a pair is two adjacent rows, [c_0, r_0, c_1, r_1, ...] (rows,
T), one forward for both. The row split of batch_split.py gives each rank contiguous blocks of
rows; with an even count per micro-batch and per rank a pair never straddles two ranks
(dpo_step.check_pair_split refuses the rest).

Where the log-probabilities come from (models/llama.py head_loss): when num_items_in_batch is an
object with a `sequence_loss` method (this file's PairLoss), the head computes the per-token
cross-entropy with reduction "none" (vocab-parallel under tp: each tp rank gets the same (rows,
T/cp) losses, and the backward needs no communication), sums it over this rank's tokens, and
hands PairLoss the (rows,) partial sums of -loss = log p. Then, per layout:

    tp    the per-token losses are already whole on every tp rank (the vocabulary's all-reduce
          is inside the cross-entropy): nothing more
    cp    each cp rank holds 2 of 2 cp chunks of every row (zigzag): its sum is a PARTIAL sum.
          cp_sum all-reduces the (rows,) partials (forward) and all-reduces their gradient
          (backward): every cp rank then computes the same loss_p, takes 1/cp of it, and the
          gradient reaching each partial is the full dloss/dlogp (the sum of the cp ranks'
          shares). Cost: 2 all-reduces of `rows` numbers per micro-batch (4 under ipo: the
          token counts too, forward only)
    pp    only the last stage runs the head, so only it calls PairLoss; its loss enters the
          schedule's backward like the SFT loss
    dp    each rank's loss is sum of its pairs' loss_p / P_global; the step sums losses and
          gradients over dp_cp, which gives the mean over the global batch

A mixture of experts (ep, models/moe_aux.py). TRL's DPOTrainer adds aux_loss_coef x the policy's
router load-balancing loss to the DPO loss when the model outputs router logits (aux_loss_enabled,
the aux of its concatenated forward: chosen and rejected routed together). minipar does the same
thing: the head returns this objective's share, then the model adds router_aux_loss_coef x aux of
the micro-batch's rows (its pairs' chosen and rejected rows, routed in one forward), weighted
1 / (dp x M) as in SFT, so

    step loss = mean over the P pairs of loss_p + coef x mean over the G = dp x M micro-batches of aux

and its gradient reaches the router and, through the hidden states, every layer below. The
reference's forward adds none (evaluation's aux_weight 0: only its log-probs are kept), and
router_aux_loss_coef 0 turns it off (transformers' output_router_logits false). aux is not linear
in the tokens, so a run equals one process that takes the same G micro-batches one after the
other (tests/test_dpo.py's ep 2 layouts); the rewards and TRL's metrics never include it.

The reference log-probabilities of a micro-batch ride in its dict ("ref_logps", (rows,)), found
by the identity of the labels tensor the head is given (the same object on every path: the
micro-batch loop and the pipeline's executor pass batch["labels"] itself). In `record` mode the
objective keeps the log-probs instead of making a loss: the reference pass
(minipar/dpo_reference.py: LoRA's adapters off, the full fine-tune's one pass before training,
or its frozen copy).

Metrics, TRL's names, over the global batch: rewards/chosen = beta (pi_c - ref_c),
rewards/rejected = beta (pi_r - ref_r), rewards/accuracies = mean of [chosen > rejected],
rewards/margins, logps/chosen, logps/rejected (the pairs' means).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .. import comm

LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo")
SMOOTHED = ("sigmoid", "robust")        # the loss types that take label_smoothing (TRL's)
MEAN_LOGPS = ("ipo",)                   # the loss types whose log p is a mean per token, not a sum
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


class _CPSum(torch.autograd.Function):
    """Sum over a group both ways: forward all-reduce, backward all-reduce (each rank's output is
    the sum of all inputs, so each input's gradient is the sum of all outputs' gradients)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.group)
        return grad, None


def cp_sum(x: torch.Tensor, group) -> torch.Tensor:
    """x summed over `group` (the cp ranks' partial sums), its gradient summed back; identity on 1 rank."""
    return x if group.size == 1 else _CPSum.apply(x, group)


def check_loss(loss_type: str, label_smoothing: float = 0.0) -> None:
    """A ValueError unless loss_type is known and label_smoothing is in [0, 0.5) and used by it."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"dpo_loss_type must be one of {list(LOSS_TYPES)}, got {loss_type!r}")
    eps = label_smoothing
    if not 0.0 <= eps < 0.5:          # (also refuses nan)
        raise ValueError(f"dpo_label_smoothing must be in [0, 0.5) (the chance a pair's label is flipped; "
                         f"0.5 makes the robust loss divide by zero), got {eps!r}")
    if eps > 0 and loss_type not in SMOOTHED:
        raise ValueError(f"dpo_label_smoothing {eps!r} with dpo_loss_type {loss_type}: the {loss_type} loss "
                         f"takes no label smoothing (TRL ignores it); use dpo_loss_type "
                         f"{' or '.join(SMOOTHED)}, or remove dpo_label_smoothing")


def dpo_losses(pi_c, pi_r, ref_c, ref_r, beta: float, loss_type: str = "sigmoid",
               label_smoothing: float = 0.0) -> torch.Tensor:
    """The per-pair loss (P,) of the module docstring (ipo: the log-probs given already averaged)."""
    check_loss(loss_type, label_smoothing)
    z = (pi_c - ref_c) - (pi_r - ref_r)
    eps = float(label_smoothing)
    if loss_type == "sigmoid":
        if eps == 0.0:                # the plain DPO loss, bitwise
            return -F.logsigmoid(beta * z)
        return -(1.0 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)
    if loss_type == "robust":
        return (-(1.0 - eps) * F.logsigmoid(beta * z) + eps * F.logsigmoid(-beta * z)) / (1.0 - 2.0 * eps)
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * z)
    return (z - 1.0 / (2.0 * beta)) ** 2


class PairLoss:
    """The DPO objective of one step, passed where num_items_in_batch goes (compose.Step, the
    pipeline's run_schedule and forward_only pass it through to the head unchanged).

    micro     this rank's micro-batches (dicts with "labels" (rows, T/cp) and, unless record,
              "ref_logps" (rows,)); n_pairs: the pairs of the GLOBAL batch; pgm: the grid;
              label_smoothing: eps of the module docstring (sigmoid and robust only)."""

    def __init__(self, micro: List[dict], n_pairs: int, pgm, beta: float, loss_type: str = "sigmoid",
                 record: bool = False, label_smoothing: float = 0.0):
        check_loss(loss_type, label_smoothing)
        self.micro, self.n_pairs, self.pgm = micro, n_pairs, pgm
        self.beta, self.loss_type, self.record = float(beta), loss_type, record
        self.label_smoothing = float(label_smoothing)
        self.recorded: Dict[int, torch.Tensor] = {}   # micro index -> (rows,) log-probs (record mode)
        self.sums: Dict[int, torch.Tensor] = {}       # micro index -> the metrics' sums over its pairs

    def _index(self, labels) -> int:
        for i, mb in enumerate(self.micro):
            if mb["labels"] is labels:
                return i
        raise RuntimeError("PairLoss: the head was given labels of no micro-batch of this step")

    def sequence_logps(self, partial: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(rows,) log p(y | x) of whole rows from this rank's partial sums (mean per token for ipo)."""
        logps = cp_sum(partial, self.pgm.cp)
        if self.loss_type in MEAN_LOGPS:
            count = (labels != -100).sum(-1).to(logps.dtype)
            if self.pgm.cp.size > 1:
                comm.all_reduce(count, self.pgm.cp)
            logps = logps / count.clamp(min=1)
        return logps

    def sequence_loss(self, partial: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Called by the head with this rank's (rows,) partial sums of token log-probs: the micro-
        batch's share of the step's loss (or, recording, a zero and the log-probs kept)."""
        i = self._index(labels)
        logps = self.sequence_logps(partial.float(), labels)
        if self.record:
            self.recorded[i] = logps.detach()
            return partial.sum() * 0.0
        ref = self.micro[i]["ref_logps"].to(logps.device, logps.dtype)
        pi_c, pi_r, ref_c, ref_r = logps[0::2], logps[1::2], ref[0::2], ref[1::2]
        losses = dpo_losses(pi_c, pi_r, ref_c, ref_r, self.beta, self.loss_type, self.label_smoothing)
        with torch.no_grad():
            rc, rr = self.beta * (pi_c - ref_c), self.beta * (pi_r - ref_r)
            self.sums[i] = torch.stack([rc.sum(), rr.sum(), (rc > rr).float().sum(), (rc - rr).sum(),
                                        pi_c.sum(), pi_r.sum()]).double()
        # every cp rank computes the same losses: each adds 1/cp of them (cp_sum's docstring)
        return losses.sum() / (self.n_pairs * self.pgm.cp.size)

    def metrics(self, device) -> Dict[str, torch.Tensor]:
        """TRL's metrics of the global batch, as 0-d device tensors (read when the caller logs).
        Collective: every rank calls it (all-reduces of 6 numbers over dp_cp and pp)."""
        total = torch.zeros(len(METRICS), dtype=torch.float64, device=device)
        for s in self.sums.values():
            total += s.to(device)
        comm.all_reduce(total, self.pgm.dp_cp)
        if self.pgm.pp.size > 1:                  # only the last stage ran the head
            comm.all_reduce(total, self.pgm.pp)
        total /= self.pgm.cp.size * self.n_pairs  # cp ranks hold the same pairs' sums
        return {name: total[k] for k, name in enumerate(METRICS)}

    def reference(self, i: int) -> Optional[torch.Tensor]:
        """The (rows,) log-probs recorded for micro-batch i (record mode), on the last stage only."""
        return self.recorded.get(i)
