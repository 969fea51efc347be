"""The mixture-of-experts feed-forward (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral,
Jiang et al. 2024): each token goes to k of E SwiGLU experts, chosen by a learned router.

One MoE layer on one rank (T local tokens of hidden size d, E experts of width F, top-k):

    x (T, d) -> router logits = x W_g^T           (T, E)     W_g: `gate.weight` (E, d), HF's name
      p = softmax(logits) over all E              (T, E)     in fp32, as transformers
      w, e = top-k(p)                             (T, k)     weights and expert ids of each token
      w = w / sum_k w                                        Mixtral always; Qwen3-MoE iff norm_topk_prob
      sort the T*k copies by expert id (stable)   (N, d)     N = T*k rows: expert 0's, then 1's, ...
      counts per expert                           (E,)       (capped at C with a capacity factor)
      DISPATCH                                               minipar/expert_parallel/dispatch.py: to
                                                             the ranks that hold each expert (the
                                                             identity while one rank holds all E)
      expert j on its run of rows                 SwiGLU:    down_j(silu(gate_j x) * up_j x)
      COMBINE                                                the inverse of DISPATCH
      y[t] = sum over t's k copies of w * out     (T, d)     un-permuted by index_add

The experts are stored stacked, one tensor per projection with the expert as dim 0:

    experts.gate_proj (E, F, d)   experts.up_proj (E, F, d)   experts.down_proj (E, d, F)

so expert parallelism shards them as tensor parallelism shards a weight: a rank of an ep group of n
keeps `full.chunk(n, dim=0)[rank]`, and each carries `ep_split_dim = 0` and `ep_full_shape` (as
tp_split_dim / tp_full_shape). They are not split over tp: under tp every rank runs all its experts
on the tokens it sees (all of them, or its sequence shard under sequence parallelism, where the
gradients of the router and the experts are then summed over tp, as a norm weight's).

Capacity (GShard, Lepikhin et al. 2020). None (the default) is dropless. A factor c caps every
expert at C = ceil(c * T * k / E) copies of the T tokens this forward sees; the copies past C (in
token order) are dropped: they add nothing to y, the token keeps its residual, and `dropped`
counts them. T is the rank's own tokens, so under cp or sequence parallelism (where a rank sees
part of each sequence) the caps, and what is dropped, differ from one process's; under dp and
plain tp every rank sees whole micro-batches and drops exactly what one process drops.

The load-balancing loss is in models/moe_aux.py; this layer records what it needs in
`router_stats`: the copies each expert was chosen for (before any cap), the sum over its tokens of
the router probabilities (with gradient), and T.

Under torch.compile (compile: true, minipar/regional_compile.py) MoEFeedForward.forward is a graph
BOUNDARY (minipar/graph_boundary.py): routing's shapes depend on the data (bincount, the capacity
cut, the expert runs read on the host, the all-to-all's splits), so the whole feed-forward, router,
dispatch, experts and combine, runs eagerly; the attention half of the layer is compiled.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar.expert_parallel import combine, dispatch
from minipar.graph_boundary import graph_boundary

from .llama_config import LlamaConfig


def _stacked(shape, ep_size: int = 1) -> nn.Parameter:
    """An expert weight (E, ...): replicated over tp, split over ep along the expert dimension; this
    rank's block is (E/ep, ...), and both full shapes are the whole (E, ...)."""
    p = nn.Parameter(torch.empty((shape[0] // ep_size,) + tuple(shape[1:])))
    p.tp_split_dim, p.tp_full_shape = None, tuple(shape)
    p.ep_split_dim, p.ep_full_shape = 0, tuple(shape)
    return p


class MoEExperts(nn.Module):
    """E SwiGLU experts, stacked (see the module docstring). forward runs expert j on its run of
    rows: the rows arrive grouped by expert, counts[j] of them for expert j, in order. A loop over
    the experts, each two (F, d) matmuls and one (d, F); an expert with no rows costs nothing."""

    def __init__(self, num_experts: int, hidden: int, width: int, ep_size: int = 1):
        super().__init__()
        self.gate_proj = _stacked((num_experts, width, hidden), ep_size)
        self.up_proj = _stacked((num_experts, width, hidden), ep_size)
        self.down_proj = _stacked((num_experts, hidden, width), ep_size)

    def forward(self, x, counts, weight_through=lambda w: w):
        """weight_through: the MoE layer's seam (MoEFeedForward), applied to each stacked weight."""
        gate, up, down = (weight_through(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        outs = []
        # the runs' lengths on the host: a list dispatch already read, else one read of E ints (a
        # sync on a GPU: the MoE layer's one, docs/design.md)
        splits = counts if isinstance(counts, list) else counts.tolist()
        for j, rows in enumerate(torch.split(x, splits)):
            if rows.shape[0]:
                outs.append(F.linear(F.silu(F.linear(rows, gate[j])) * F.linear(rows, up[j]), down[j]))
        if not outs:    # no row here (expert parallelism can leave a rank none): still use the
            # weights, on zero rows, so their gradient (zero) exists and the ZeRO-3 reduce-scatter of
            # the experts, which the edp peers join, runs here too instead of hanging them
            rows = x[:0]
            outs.append(F.linear(F.silu(F.linear(rows, gate[0])) * F.linear(rows, up[0]), down[0]))
        return torch.cat(outs)


class MoERouter(nn.Module):
    """The router, a Linear(d, E) without bias: `gate.weight` (E, d), HF's name and shape."""

    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.weight.tp_split_dim, self.weight.tp_full_shape = None, (num_experts, hidden)


class MoEFeedForward(nn.Module):
    """The feed-forward of an MoE decoder layer: x (b, s, d) -> (b, s, d). After each forward,
    `router_stats` = (counts (E,) float, prob_sum (E,) with grad, T) and `dropped` (copies past
    capacity, 0 when dropless) describe it."""

    # how the router's and the experts' weights enter their products: the identity here. Whole on
    # every tp rank, they see only a rank's tokens under sequence parallelism, so there
    # minipar/tensor_parallel/parallelize.py sets it to f, which sums their gradients over tp (as a
    # norm's weight_through, models/llama_layer.py)
    weight_through = staticmethod(lambda weight: weight)

    def __init__(self, config: LlamaConfig, ep=None):
        """ep: the ep group (mesh.py) whose ranks split the experts; None or one rank: all E here."""
        super().__init__()
        E, d = config.num_local_experts, config.hidden_size
        self.num_experts, self.top_k = E, config.num_experts_per_tok
        self.norm_topk_prob, self.capacity_factor = config.norm_topk_prob, config.moe_capacity_factor
        self.ep = ep if ep is not None and ep.size > 1 else None
        self.gate = MoERouter(E, d)
        self.experts = MoEExperts(E, d, config.moe_intermediate_size, ep.size if self.ep else 1)
        self.router_stats, self.dropped = None, 0

    def route(self, x):
        """x (T, d) -> probabilities p (T, E) and the top-k weights and expert ids (T, k)."""
        w_g = self.weight_through(self.gate.weight)
        probs = torch.softmax(F.linear(x, w_g).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, experts

    @graph_boundary
    def forward(self, x):
        b, s, d = x.shape
        x = x.reshape(b * s, d)
        T, E = x.shape[0], self.num_experts
        probs, weights, experts = self.route(x)
        flat = experts.reshape(-1)                          # copy i = t * k + slot
        order = torch.argsort(flat, stable=True)            # by expert, then by token
        counts = torch.bincount(flat, minlength=E)
        self.router_stats = (counts.float(), probs.sum(dim=0), T)
        if self.capacity_factor is not None:                # the first C copies of each expert stay
            cap = math.ceil(self.capacity_factor * T * self.top_k / E)
            start = torch.cumsum(counts, 0) - counts
            keep = torch.arange(order.numel(), device=x.device) - start[flat[order]] < cap
            order, counts = order[keep], counts.clamp(max=cap)
            self.dropped = int(keep.numel() - order.numel())
        token = order // self.top_k                         # the token of each sorted copy
        local, local_counts, handle = dispatch(x[token], counts, self.ep)
        splits = local_counts if handle.local_splits is None else handle.local_splits
        out = combine(self.experts(local, splits, self.weight_through), handle)
        w = weights.reshape(-1)[order].to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, token, (out * w[:, None]).to(x.dtype))   # autocast: bf16 out
        return y.view(b, s, d)
