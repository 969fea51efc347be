"""Preference training: DPO (Rafailov et al., 2023) and IPO (Azar et al., 2023).

    objective.py     the loss of per-sequence log-probabilities (PairLoss, passed where the head
                     takes num_items_in_batch), exact under tp, cp and pp; TRL's metrics

The step around it (the pairs' split) is minipar/dpo_step.py; the reference (the adapters off,
precomputed, or a frozen copy) is minipar/dpo_reference.py.
"""
from .objective import LOSS_TYPES, METRICS, SMOOTHED, PairLoss, check_loss, cp_sum, dpo_losses

__all__ = ["LOSS_TYPES", "METRICS", "SMOOTHED", "PairLoss", "check_loss", "cp_sum", "dpo_losses"]
