"""The backward of a Linear split in two: B, the input gradient, now; W, the weight gradient, later
(Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024). What the zero-bubble schedules
(schedules.py: zb_h1, zbv) fill their bubbles with.

For a Linear y = x W^T + b, x (b, s, in), W (out, in), the backward is two independent matmuls:

    B:  dx = dy W                 (b, s, in)    the previous stage waits for it: critical path
    W:  dW = dy^T x, db = sum dy  (out, in)     nobody waits for it until the optimizer step

dx needs W and dy; dW needs x and dy. Neither needs the other's result, so dW can run any time
between B and the optimizer step, as long as x and dy are kept. SplitLinear is the autograd
Function that does this: its backward returns dx at once and, while a WeightGradStore defers,
QUEUES (x, dy) instead of computing dW. The executor runs a stage's B inside
`store.inputs_only(key)` (key = (chunk, micro-batch)) and its W as `store.weight_grads(key)`,
which pops that B's queue, computes every dW and db, and frees the kept x and dy.

    F(c, i)   y = x W^T               saves x                            (as any Linear)
    B(c, i)   dx = dy W               queue[(c, i)] += (W, b, x, dy)      graph freed, x dy kept
    W(c, i)   dW = dy^T x             torch.autograd.backward(W, dW)      x, dy freed

Memory: between B and W a stage holds, for each Linear of each micro-batch chunk whose W has not
run, its input x (kept from the forward: B no longer frees it) and its output gradient dy
(new: bytes of the Linear's output). For a decoder layer of hidden d, intermediate f and b s
tokens that is about (3 d + f) b s elements of x (q/k/v read one x, gate/up one, o reads d and
down f) plus (q + k + v + d + 2 f + d) b s of dy: the price of moving W into the bubble.

How W hands its gradient over: `torch.autograd.backward(weights, dWs)` starts a small backward at
the weight tensors themselves. For a plain Parameter that is its AccumulateGrad: .grad += dW,
with every hook a data-parallel reducer registered (minipar/data_parallel/ddp.py's), as if
autograd had computed dW in B. Under ZeRO-3 a weight is a view of its unit's flat buffer, so the
same call runs the view's backward into flat.grad and the unit's post-accumulate-grad hook
(minipar/zero3/shard_manager.py): the reductions see W's gradients exactly where they see B's.
So the DP and ZeRO-3 reductions wait for the step's LAST W simply by running every B and W but
that one under no_sync (minipar/compose.py). Where no Linear of the stage has a
trainable weight or bias (LoRA: the base frozen, the adapters' small matmuls not split) a W computes
nothing and starts no backward, so no reducer would ever see the step end: there the last gradient
action is the last B (`WeightGradStore.defers` says which; minipar/pipeline_parallel/executor.py).

What is split: every Linear of minipar/tensor_parallel/ (ColumnParallelLinear, RowParallelLinear,
the lm_head, and the column-parallel groups of async_linear.py). split_weight_gradients below is the
one place that does it, through the two seams those layers expose (layers.py's _TPLinear): their
matmul `local_linear` becomes `store.linear` (SplitLinear), and `defer_weight_grad`, which the fused
column backward of async_linear.py asks before computing dW, becomes `store.defer_weight_grad`. The
tensor-parallel package never imports this file nor names the store. Everything else, the
RMSNorm weights and the embedding, gets its gradient in B as usual (small, and an embedding's
gradient is a scatter-add that reads no saved input). TP communication is untouched: dx of a
column-parallel layer is still reduced over tp in B (the g/f pair), and dW of a tp-sharded weight
needs no communication anyway.

Outside `inputs_only` (evaluation, the other schedules, a store never entered) the Function
computes dW in its own backward, like F.linear.
"""
from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def weight_gradient(x: torch.Tensor, dy: torch.Tensor, weight: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """dW = dy^T x over every token (out, in) and db = sum dy (out,), in the parameters' dtypes.
    Under autocast dy is in the compute dtype and x may not be: x is cast to dy's dtype, as the
    autocast backward of F.linear would compute it."""
    flat_dy = dy.reshape(-1, dy.shape[-1])
    flat_x = x.reshape(-1, x.shape[-1]).to(dy.dtype)
    dw = None if weight is None else flat_dy.t().matmul(flat_x).to(weight.dtype)
    db = None if bias is None else flat_dy.sum(0).to(bias.dtype)
    return dw, db


class SplitLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns dx and, while `store` defers, queues (x, dy) for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        # the tensors themselves (a Parameter, or a ZeRO-3 view of a flat buffer): W's backward
        # starts at them, so it must be these objects, not what saved_tensors unpacks
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dy.matmul(weight.to(dy.dtype)).to(x.dtype) if need_x else None          # B
        weight_t = ctx.weight if need_w else None
        bias_t = ctx.bias if need_b else None
        if ctx.store.defer_weight_grad(weight_t, bias_t, x, dy):                      # W, later
            return dx, None, None, None
        dw, db = weight_gradient(x, dy, weight_t, bias_t)                             # W, now
        return dx, dw, db, None


class WeightGradStore:
    """The deferred weight gradients of one pipeline stage, keyed by the (chunk, micro-batch) whose
    B queued them. One per stage; split_weight_gradients points the stage's Linear layers at it."""

    def __init__(self):
        self.deferring = False
        self.key = None
        self.queues: Dict[tuple, List[tuple]] = {}      # key -> [(weight, bias, x, dy)]
        self.layers: List[nn.Module] = []               # the Linears pointing at this store

    def defers(self) -> bool:
        """Whether a B of this stage queues anything: some Linear's weight or bias is trained (read
        at call time: ZeRO-3 points the layers at views of its flat buffers after the store is set)."""
        return any(t is not None and t.requires_grad for m in self.layers
                   for t in (m.weight, getattr(m, "bias", None)))

    def linear(self, x, weight, bias=None):
        """F.linear whose backward can defer dW: the layers' `local_linear` once split."""
        return SplitLinear.apply(x, weight, bias, self)

    def defer_weight_grad(self, weight, bias, x, dy) -> bool:
        """Asked by a backward before it computes dW (SplitLinear's; the layers' `defer_weight_grad`,
        for async_linear.py's fused one): inside `inputs_only`, (x, dy) are queued for W and the answer
        is True (the caller computes no dW); outside, False (the caller computes it now)."""
        if not self.deferring:
            return False
        self.defer(weight, bias, x, dy)
        return True

    def defer(self, weight, bias, x, dy):
        """Called from a backward while `inputs_only` is active: keep what W will need (nothing
        for a frozen layer: a LoRA base weight gets no gradient)."""
        if weight is not None or bias is not None:
            self.queues[self.key].append((weight, bias, x, dy))

    @contextlib.contextmanager
    def inputs_only(self, key):
        """B: the backwards run inside compute input gradients only and queue their W under key."""
        if key in self.queues:
            raise RuntimeError(f"weight gradients of {key} are already queued: B ran twice")
        self.deferring, self.key, self.queues[key] = True, key, []
        try:
            yield
        finally:
            self.deferring, self.key = False, None

    def weight_grads(self, key) -> None:
        """W: every dW and db queued by B(key), computed and accumulated into the parameters through
        autograd (their hooks fire as in any backward), then x and dy are let go."""
        queue = self.queues.pop(key)
        targets, grads = [], []
        for weight, bias, x, dy in queue:
            dw, db = weight_gradient(x, dy, weight, bias)
            for t, g in ((weight, dw), (bias, db)):
                if t is not None:
                    targets.append(t)
                    grads.append(g)
        del queue
        if targets:
            torch.autograd.backward(targets, grads)

    def held_bytes(self) -> int:
        """Bytes of x and dy kept for W runs still to come, each storage once (q, k and v share
        their x)."""
        seen = {}
        for q in self.queues.values():
            for _, _, x, dy in q:
                for t in (x, dy):
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def pending(self) -> List[tuple]:
        return sorted(self.queues)


def split_weight_gradients(module: nn.Module) -> WeightGradStore:
    """Give every tensor-parallel Linear of `module` (Column/RowParallelLinear) one shared store: its
    matmul becomes the store's SplitLinear and its fused backward asks the store before computing dW
    (the layers' seams `local_linear` and `defer_weight_grad`, set on each instance)."""
    store = WeightGradStore()
    for name, m in module.named_modules():
        if not isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            continue
        prior = vars(m).get("local_linear")            # replaced already: by a store, or by someone else
        if prior is not None and not isinstance(getattr(prior, "__self__", None), WeightGradStore):
            raise ValueError(f"split_weight_gradients: {name}'s matmul is already replaced ({prior!r}: a "
                             f"tied lm_head?); a zero-bubble schedule cannot split it too: use a schedule "
                             f"without split backward (1f1b, interleaved_1f1b)")
        m.local_linear, m.defer_weight_grad = store.linear, store.defer_weight_grad
        store.layers.append(m)
    if not store.layers:
        raise ValueError(f"split_weight_gradients: {type(module).__name__} has no Linear layer that can "
                         f"split its backward (no Column/RowParallelLinear)")
    return store
