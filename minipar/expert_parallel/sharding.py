"""Where the experts' weights live: split over ep, then ZeRO-3-sharded over edp.

An MoE layer stores each expert projection stacked, the expert as dim 0 (models/moe.py):

    gate_proj (E, F, d)   up_proj (E, F, d)   down_proj (E, d, F)          the full tensors

Member j of an ep group of n ranks keeps `full.chunk(n, dim=0)[j]`, its E/n experts, exactly as
tensor parallelism keeps `full.chunk(tp, dim)[tp_rank]` of a weight; such a parameter carries
`ep_split_dim = 0` beside `tp_split_dim` (None: experts are not split over tp here) and its full
shape (E, F, d) as `ep_full_shape` and `tp_full_shape` alike, so a checkpoint, the initialisation
and the HF reader see the whole tensor's shape, and every consumer cuts the same two ways:

    local = ep_shard(shard_tensor(full, tp_split_dim, tp), ep_split_dim, ep)       (no communication)
    full  = ep_gather(gather_tensor(local, tp_split_dim, tp), ep_split_dim, ep)    (all-gathers)

ZeRO-3 (minipar/zero3/). The n members of an ep group hold different experts, so they cannot share
one flat buffer; the D/n ranks of dp_shard_cp that hold the SAME experts (mesh.py's edp group) can.
So fully_shard (zero3/wrap.py) puts a unit's expert parameters, those that carry ep_split_dim, in
a second flat buffer of their own, sharded over edp, while the attention, norms and router stay in
the unit's buffer over dp_shard_cp. Per MoE layer and micro-batch, with X = the bytes of this
rank's E/n experts:

    all-gather       X over edp, twice (forward, backward), wire (D/n - 1)/(D/n) X each
    reduce-scatter   X over edp, once: the gradient of an expert is the sum over every token routed
                     to it; the token exchange's backward (dispatch.py) already brought the ep group's
                     tokens' gradients to its holder, so the edp ranks' sums complete it
    HSDP             + an all-reduce of the shard gradient over dp_replicate, as every unit

Clipping needs no change: ep x edp = dp_shard_cp (the ep group picks the experts, edp the shard of
them), so the squares of the expert shards summed over dp_shard_cp count each distinct element of
each expert once, as optim.py sums every flat shard's. Without ZeRO-3 (dp_shard x cp = 1) ep is 1:
the experts are replicated like every other weight, and DDP all-reduces them with the rest.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import comm


def is_expert(p) -> bool:
    """A parameter split over ep (it carries ep_split_dim)."""
    return getattr(p, "ep_split_dim", None) is not None


def ep_shard(full: torch.Tensor, ep_split_dim: Optional[int], ep) -> torch.Tensor:
    """This ep member's block of `full` along ep_split_dim (the whole tensor when not split)."""
    if ep_split_dim is None or ep is None or ep.size == 1:
        return full
    if full.shape[ep_split_dim] % ep.size:
        raise ValueError(f"ep_shard: {full.shape[ep_split_dim]} experts cannot be split over the "
                         f"{ep.name} group of {ep.size}")
    return full.chunk(ep.size, dim=ep_split_dim)[ep.rank]


def ep_block(num_experts: int, ep) -> Tuple[int, int]:
    """(first, count): the experts this ep member holds, what a weight source is asked for
    (`source.tp_local(name, full_shape, tp_split_dim, experts=(first, count))`, models/llama_init.py)."""
    n = 1 if ep is None else ep.size
    if num_experts % n:
        raise ValueError(f"{num_experts} experts cannot be split over an ep group of {n}")
    count = num_experts // n
    return (0 if ep is None else ep.rank) * count, count


def ep_gather(local: torch.Tensor, ep_split_dim: Optional[int], ep) -> torch.Tensor:
    """The full tensor from every ep member's block (all-gather over ep; collective)."""
    if ep_split_dim is None or ep is None or ep.size == 1:
        return local
    return comm.all_gather(local.contiguous(), ep, gather_dim=ep_split_dim)
