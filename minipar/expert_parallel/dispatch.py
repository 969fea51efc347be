"""Expert parallelism's token exchange: dispatch routed tokens to the ranks that hold their experts,
and combine the experts' outputs back (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et
al. 2021). Written by hand on `all_to_all_single`; it knows nothing of Llama or of routers.

An MoE layer has E experts. Over an ep group of n ranks, member j holds the L = E/n experts
j*L ... (j+1)*L - 1 (their stacked weights are `full.chunk(n, dim=0)[j]`). The model routes each of
its T tokens to k experts and hands over the T*k copies sorted by expert id:

    tokens_sorted  (N, d)   N = T*k rows, those of expert 0 first, then expert 1, ...
    counts         (E,)     rows per expert; counts.view(n, L)[j] is what goes to member j

dispatch(tokens_sorted, counts, ep) -> (local_tokens (M, d), local_counts (L,), handle)

    1. counts:  all_to_all of counts.view(n, L) (n*L int64, even): row i of what arrives, recv (n, L),
                says how many rows member i sends for each of my local experts
    2. tokens:  all_to_all_single with uneven splits: send counts.view(n, L).sum(1) rows to each
                member, receive recv.sum(1) from each; the M rows arrive by source, then by expert:
                    [from 0: e0 e1 .. e(L-1)] [from 1: e0 e1 ..] ...
    3. regroup: a stable sort by local expert makes each expert's rows one contiguous run:
                    [e0: from 0, from 1, ..] [e1: from 0, from 1, ..] ...     local_counts = recv.sum(0)

The model runs local expert e on its run of local_counts[e] rows (a loop, or one grouped matmul),
then

combine(local_out (M, d), handle) -> (N, d)     in tokens_sorted's order

undoes the regroup and sends every row back where it came from (the token exchange with the splits
swapped). The model then un-sorts, weights by the router and sums each token's k copies.

Autograd. The token exchange only moves rows: row r goes from rank a to rank b. Its adjoint moves
the gradient of row r from b back to a, which is the same exchange with the send and receive
splits swapped; so the hand-written `_Exchange.backward` is one all_to_all_uneven, and the backward
of dispatch is a combine and that of combine a dispatch. The regroup is an index gather, whose
backward (a scatter) autograd derives. The counts are integers and carry no gradient.

Cost per rank, per MoE layer and micro-batch (b bytes per element, ledger op "all_to_all_uneven"
over group "ep"; the counts as "all_to_all"):

    counts      (n-1)/n * E * 8 bytes, forward only
    dispatch    the rows sent to other members: sum over j != me of counts.view(n, L)[j].sum() * d * b,
                which is N (n-1)/n d b = T k d b (n-1)/n when routing is balanced
    combine     the rows received from other members, sent back
    backward    the same two again (combine's backward sends what dispatch sent, and vice versa)

so 4 T k d b (n-1)/n with balanced routing, against zero for n = 1, where every function here is
the identity and nothing is recorded. The splits must be known on the host to size the buffers,
so step 1 costs a device-to-host copy (a sync on GPU): ONE per layer and micro-batch, which also
brings the rows per local expert (handle.local_splits) that the model's expert loop cuts by, so
the layer needs no other; no token is ever dropped here (capacity, if any, is the model's). ep
None, or of size 1, is the identity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..comm import all_to_all, all_to_all_uneven


@dataclass
class DispatchHandle:
    """What combine needs to send rows back: the group, the two split lists, the regroup order."""
    ep: Optional[object]
    send_splits: List[int]        # rows this rank sent to each member (dispatch)
    recv_splits: List[int]        # rows it received from each
    order: Optional[torch.Tensor]     # local_tokens = received[order]
    num_rows: int                 # N, the rows combine returns
    local_splits: Optional[List[int]] = None     # rows per local expert, on the host (None: ep of 1)


class _Exchange(torch.autograd.Function):
    """Rows of x cut into runs of `send` go to the members in turn; `recv` rows come from each.
    Backward: the gradients go back the same way, with the splits swapped."""

    @staticmethod
    def forward(ctx, x, ep, send, recv):
        ctx.ep, ctx.send, ctx.recv = ep, send, recv
        return all_to_all_uneven(x, ep, send, recv)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_uneven(grad.contiguous(), ctx.ep, ctx.recv, ctx.send), None, None, None


def _single(ep) -> bool:
    return ep is None or ep.size == 1


def dispatch(tokens_sorted: torch.Tensor, counts: torch.Tensor, ep
             ) -> Tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """(N, d) rows sorted by expert and their (E,) counts -> this rank's local experts' rows,
    contiguous per local expert, their (E/ep,) counts, and the handle combine needs."""
    num_experts = counts.numel()
    if _single(ep):
        return tokens_sorted, counts, DispatchHandle(ep, [], [], None, tokens_sorted.shape[0])
    n = ep.size
    if num_experts % n:
        raise ValueError(f"dispatch: {num_experts} experts cannot be split over an ep group of {n}; "
                         f"choose expert_parallel_size dividing the number of experts")
    local = num_experts // n
    counts = counts.to(torch.int64)
    send_counts = counts.reshape(n, local)
    recv_counts = torch.empty_like(send_counts)
    all_to_all(recv_counts, send_counts, ep)                     # step 1: (n, L), row i from member i
    # the host must know the splits to size the exchange: ONE device-to-host read of them all (the
    # rows to send and receive per member, the rows per local expert for the expert loop)
    host = torch.cat([send_counts.sum(1), recv_counts.sum(1), recv_counts.sum(0)]).tolist()
    send, recv, local_splits = host[:n], host[n:2 * n], host[2 * n:]
    received = _Exchange.apply(tokens_sorted, ep, send, recv)    # step 2: by source, then expert
    # step 3: each received row's local expert, then a stable sort keeps the sources in order (the
    # output size given, so that repeat_interleave need not read the counts back again)
    expert_of_row = torch.arange(local, device=counts.device).repeat(n).repeat_interleave(
        recv_counts.flatten(), output_size=sum(recv))
    order = torch.sort(expert_of_row, stable=True).indices
    handle = DispatchHandle(ep, send, recv, order, tokens_sorted.shape[0], local_splits)
    return received[order], recv_counts.sum(0), handle


def combine(local_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """The local experts' (M, d) outputs, in dispatch's order -> (N, d) in tokens_sorted's order,
    each row back on the rank that sent it."""
    if _single(handle.ep):
        return local_out
    inverse = torch.empty_like(handle.order)
    inverse[handle.order] = torch.arange(handle.order.numel(), device=handle.order.device)
    by_source = local_out[inverse]                          # back to [from 0: e0 e1 ..][from 1: ..]
    out = _Exchange.apply(by_source, handle.ep, handle.recv_splits, handle.send_splits)
    assert out.shape[0] == handle.num_rows
    return out
