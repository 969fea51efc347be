"""Expert parallelism: the experts of each MoE layer split over the ep group, tokens exchanged.

    dispatch.py   the token exchange by hand on all_to_all_single: dispatch (counts, then tokens with
                  uneven splits, then a regroup per local expert) and combine (the reverse), each an
                  autograd Function whose backward is the reverse exchange
    sharding.py   where the experts' weights live: E/ep per ep rank (ep_block, ep_shard, ep_gather), and their
                  ZeRO-3 flat buffer of their own, sharded over edp (zero3/wrap.py cuts it out)

    from minipar.expert_parallel import dispatch, combine
    local, local_counts, handle = dispatch(tokens_sorted, counts, pgm.ep)
    out_sorted = combine(experts(local, local_counts), handle)
"""
from .dispatch import DispatchHandle, combine, dispatch
from .sharding import ep_block, ep_gather, ep_shard, is_expert

__all__ = ["DispatchHandle", "combine", "dispatch", "ep_block", "ep_gather", "ep_shard", "is_expert"]
