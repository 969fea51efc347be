"""The load-balancing loss of a mixture of experts (Switch Transformer, Fedus et al. 2021, eqs. 4-6),
as transformers' load_balancing_loss_func computes it for Mixtral and Qwen3-MoE.

Over the L MoE layers of the model and the T tokens of one micro-batch (E experts, top-k):

    f_e = (number of the L*T*k routed copies that chose expert e) / (L*T)      no gradient
    P_e = (sum over the L layers and T tokens of p_e, the router probability) / (L*T)
    aux = E * sum_e f_e * P_e

It is smallest (k, for any k) when both are uniform. Note that transformers pools the layers
before the product (one f and one P over all L layers), not sum over layers of per-layer losses;
so do we, so the loss and its gradients equal theirs. The objective of one micro-batch is
cross-entropy + router_aux_loss_coef * aux.

Which tokens. aux is not linear in the tokens, so its value depends on the set it is computed
over; here it is one micro-batch as one process sees it: micro_batch_size whole rows. Under cp a
rank holds part of every row, and under sequence parallelism part of its cp chunk, so the counts
and the probability sums are summed over cp (and over tp under SP): an all-reduce of (L, 2E + 1)
numbers per micro-batch (two under SP with cp). Each rank then adds

    E / (L*T)^2 * sum_e C_e * (its own part of P_e's sum)       C_e the micro-batch's counts

whose sum over the cp (and SP) ranks is aux, and whose gradients are this rank's share of aux's
(the reductions that follow sum them, as they sum the cross-entropy's). Under SP the value added is
the sum over tp of those shares, because each tp rank's loss holds the whole cross-entropy of its
cp rank (the loss is logged summed over dp_cp, not tp); the gradient stays the rank's share.
Plain tp ranks see the same tokens: each computes the whole aux, as each computes the whole loss.
Over dp nothing is summed: each dp rank's micro-batches are micro-batches of the global batch,
and the step's objective weights each of its G micro-batches' aux by 1/G (`weight` below).
Micro-batches keep the same rows on every layout (trainer/data/batches.py), so a run equals one
process's. Under pipeline parallelism the layers of a micro-batch live on several stages:
PipelineAux below carries what each stage needs between them.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from minipar import comm
from minipar.mesh import ProcessGroupManager


def load_balancing_loss(stats: List[tuple], num_experts: int, pgm: ProcessGroupManager,
                        sequence_parallel: bool) -> Dict[str, torch.Tensor]:
    """stats: each MoE layer's router_stats (counts (E,), prob_sum (E,) with grad, T local tokens),
    in layer order. Returns dict(aux=this rank's share of aux, with gradient; aux_value=the
    micro-batch's aux, detached, the same on every rank; counts=(L, E) copies per expert and layer
    over the micro-batch). Collective over tp under SP, then over cp, when they have several ranks."""
    L = len(stats)
    counts = torch.stack([c for c, _, _ in stats])                         # (L, E)
    probs = torch.stack([p for _, p, _ in stats])                          # (L, E), with grad
    tokens = torch.full((1,), float(stats[0][2]), device=counts.device)   # a fill, not a host copy
    packed = torch.cat([counts.reshape(-1), probs.detach().reshape(-1), tokens])
    E = num_experts
    if sequence_parallel and pgm.tp.size > 1:
        packed = comm.all_reduce(packed, pgm.tp)
    probs_tp = packed[L * E:2 * L * E].view(L, E).clone()                 # this cp rank's part of P
    if pgm.cp.size > 1:
        packed = comm.all_reduce(packed, pgm.cp)
    counts_all = packed[:L * E].view(L, E)
    probs_all = packed[L * E:2 * L * E].view(L, E)
    rows = L * packed[-1]
    per_expert = counts_all.sum(0)                                         # C_e
    aux = E * (per_expert * probs.sum(0)).sum() / rows ** 2
    # the tp ranks' loss is the whole cross-entropy on each (the cp ranks' a share): under SP each
    # adds its tp share's gradient but the value of the cp rank's share, so the loss reads the same
    aux = aux + (E * (per_expert * probs_tp.sum(0)).sum() / rows ** 2 - aux).detach()
    aux_value = E * (per_expert * probs_all.sum(0)).sum() / rows ** 2
    return dict(aux=aux, aux_value=aux_value, counts=counts_all)


def moe_layers(layers) -> list:
    """The MoE feed-forwards among decoder layers, in order."""
    return [layer.mlp for layer in layers if getattr(layer, "is_moe", False)]


def add_aux_loss(loss, layers, config, pgm: ProcessGroupManager, weight: Optional[float],
                 sequence_parallel: bool):
    """loss + router_aux_loss_coef * weight * aux of the MoE layers among `layers` (which have just
    run forward); weight None is 1 / dp (each dp rank's forward is one micro-batch of the batch);
    sequence_parallel: the model's (each tp rank routed its own tokens).
    Returns (loss, metrics): metrics holds aux_value, counts and dropped, or is None (dense)."""
    moes = moe_layers(layers)
    if not moes:
        return loss, None
    out = load_balancing_loss([m.router_stats for m in moes], config.num_local_experts, pgm,
                              sequence_parallel)
    weight = 1.0 / pgm.dp.size if weight is None else weight
    if config.router_aux_loss_coef > 0 and loss is not None:
        loss = loss + config.router_aux_loss_coef * weight * out["aux"]
    metrics = dict(aux_loss=out["aux_value"], counts=out["counts"],
                   dropped=sum(m.dropped for m in moes))
    return loss, metrics


class PipelineAux:
    """The load-balancing loss under pipeline parallelism, where the L MoE layers of one micro-batch
    run on several stages. aux pools the counts of all L layers, so stage s's gradient, which
    is K * C_e (K = coef * weight * E / (L*T)^2) for each of its probability sums, needs the counts
    of the later stages too. Two small vectors travel with the activations and their gradients
    (minipar/pipeline_parallel/executor.py asks the model for this object; it knows no MoE):

        forward   side (2E + 1,) this rank's counts and (detached) probability sums over the MoE
                                 layers of the stages so far, each stage adding its own, and its
                                 tokens T (set by any stage with an MoE layer: the last stage may
                                 have none, and still needs T)
        last      reduce side and T over tp (SP) and cp as above; add coef * weight * aux to the
                  loss, its gradient through the last stage's own sums, its value the cp rank's share
        backward  back (E + 1,)  the micro-batch's C_e and L*T, from the last stage to the first;
                  each earlier stage adds K * sum_e C_e * (its sums) to its backward

    so the gradients are the one-process ones. Only the size of two vectors per micro-batch and
    boundary is sent (2E + 1 and E + 1 floats). It also sums a step's figures (step_metrics: the
    moe_* fields of metrics.jsonl, as models/moe_metrics.py gives them without pp)."""

    def __init__(self, config, pgm: ProcessGroupManager, sequence_parallel: bool):
        self.config, self.pgm = config, pgm
        self.sp = sequence_parallel and pgm.tp.size > 1   # the tp ranks routed their own tokens
        self.E = config.num_local_experts
        self.L = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        self.size, self.back_size = 2 * self.E + 1, self.E + 1
        moe_ids = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        self.moe_index = {i: j for j, i in enumerate(moe_ids)}    # decoder layer -> row of `counts`
        self._reset()

    def _reset(self):
        # this rank's sums over a step: the aux losses (last stage), counts per MoE layer, drops
        self.aux_sum, self.counts, self.dropped, self.micro = 0.0, None, 0, 0

    def forward_side(self, layers, side_in):
        """-> (side_out, this chunk's probability sums with grad, or None without an MoE layer)."""
        moes = moe_layers(layers)
        if not moes:
            return side_in, None
        if self.counts is None:
            self.counts = torch.zeros(self.L, self.E, dtype=torch.float64, device=side_in.device)
        for layer in layers:
            if getattr(layer, "is_moe", False):
                self.counts[self.moe_index[layer.layer_idx]] += layer.mlp.router_stats[0].double()
                self.dropped += layer.mlp.dropped
        counts = torch.stack([m.router_stats[0] for m in moes]).sum(0)
        probs = torch.stack([m.router_stats[1] for m in moes]).sum(0)
        tokens = torch.tensor([float(moes[0].router_stats[2])], dtype=side_in.dtype, device=side_in.device)
        side_out = torch.cat([side_in[:-1] + torch.cat([counts, probs.detach()]).to(side_in.dtype), tokens])
        return side_out, probs

    def last(self, side, probs, weight: float):
        """The last stage: (the loss term, back). Collective over tp (SP) and cp."""
        pgm, E = self.pgm, self.E
        packed = side.clone()               # the counts, sums and T, to be reduced
        if self.sp:
            packed = comm.all_reduce(packed, pgm.tp)
        probs_tp = packed[E:2 * E].clone()
        if pgm.cp.size > 1:
            packed = comm.all_reduce(packed, pgm.cp)
        back = torch.cat([packed[:E], (self.L * packed[-1:])])
        self.aux_sum += (E * (back[:E] * packed[E:2 * E]).sum() / back[E] ** 2).item()
        self.micro += 1
        value = self._k(back, weight) * (back[:E] * probs_tp).sum()
        term = self.earlier(back, probs, weight) if probs is not None else value * 0
        return term + (value - term).detach(), back

    def earlier(self, back, probs, weight: float):
        """An earlier stage's term: its value is not the loss, its gradient is its share of aux's."""
        return self._k(back, weight) * (back[:self.E] * probs).sum()

    def _k(self, back, weight: float):
        return self.config.router_aux_loss_coef * weight * self.E / back[self.E] ** 2

    def step_metrics(self, device, num_micro: int) -> dict:
        """The step's moe_aux_loss, moe_imbalance, moe_dropped, as without pp. Collective over
        dp_cp and pp (and tp under SP); resets the sums."""
        pgm = self.pgm
        counts = self.counts if self.counts is not None else \
            torch.zeros(self.L, self.E, dtype=torch.float64, device=device)
        # aux: last stage only, equal on its cp and tp ranks; counts and drops: each rank's own
        packed = torch.cat([torch.tensor([self.aux_sum / pgm.cp.size], dtype=torch.float64, device=device),
                            counts.reshape(-1), torch.tensor([float(self.dropped)], dtype=torch.float64,
                                                             device=device)])
        for group in (pgm.dp_cp, pgm.pp):
            packed = comm.all_reduce(packed, group)
        if self.sp:                             # the tp ranks routed their own tokens
            packed[1:] = comm.all_reduce(packed[1:].clone(), pgm.tp)
        counts = packed[1:-1].view(self.L, self.E)
        imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)).tolist()
        self._reset()
        return dict(moe_aux_loss=packed[0].item() / (num_micro * pgm.dp.size),
                    moe_imbalance=[round(x, 6) for x in imbalance], moe_dropped=int(round(packed[-1].item())))
