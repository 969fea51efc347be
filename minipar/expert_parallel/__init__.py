"""Expert parallelism: the experts of each MoE layer split over the ep group, tokens exchanged.

    dispatch.py   the token exchange by hand on all_to_all_single: dispatch (counts, then tokens with
                  uneven splits, then a regroup per local expert) and combine (the reverse), each an
                  autograd Function whose backward is the reverse exchange

    from minipar.expert_parallel import dispatch, combine
    local, local_counts, handle = dispatch(tokens_sorted, counts, pgm.ep)
    out_sorted = combine(experts(local, local_counts), handle)
"""
from .dispatch import DispatchHandle, combine, dispatch

__all__ = ["DispatchHandle", "combine", "dispatch"]
