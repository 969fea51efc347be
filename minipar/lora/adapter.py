"""LoRA: a frozen weight W0 plus a trainable low-rank update, placed inside a tensor-parallel Linear.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021). A Linear y = x W0^T with
W0 (out, in) is fine-tuned as W = W0 + (alpha / r) B A, with A (r, in), B (out, r), r << in, out:

    y = x W0^T + s * (dropout(x) A^T) B^T          s = alpha / r (PEFT's `scaling`)

Only A and B are trained: 2 r (in + out) numbers instead of in * out, so the gradients and AdamW's
states of the base (12 of the 16 bytes per parameter in fp32) are gone. A starts Kaiming-uniform
(PEFT's init_lora_weights=True: bound 1/sqrt(in)) and B at zero, so step 0 is the base model.

Where the pieces sit under tensor parallelism (minipar/tensor_parallel/layers.py), and what each
rank computes; x_t, y_t are what tp rank t holds:

    ColumnParallelLinear  W0_t (out/tp, in)          A (r, in)      WHOLE on every tp rank
                          x (b, s, in) the same       B_t (out/tp, r) split like W0 (dim 0)
        y_t = x W0_t^T + s (x A^T) B_t^T             each rank its output columns; nothing sent
    RowParallelLinear     W0_t (out, in/tp)          A_t (r, in/tp) split like W0 (dim 1)
                          x_t (b, s, in/tp)          B (out, r)     WHOLE on every tp rank
        partial_t = x_t W0_t^T + s (x_t A_t^T) B^T   = the rank's share of y, since
        y = sum_t partial_t                          x A^T = sum_t x_t A_t^T and B is linear
        ONE all-reduce (or SP reduce-scatter) of the partials, the one the base already makes:
        LoRA adds no forward collective.

The whole pieces' gradients are sums over tp, and why (dy_t: the gradient of this rank's output):

    column A: dA = s (dy B)^T x, and dy B = sum_t dy_t B_t: each rank holds one term, so
              dA_t = s (dy_t B_t)^T x is a PARTIAL sum; the true dA = sum over tp of dA_t.
              (dx needs no care: rank t adds s (dy_t B_t) A to its partial dx, and the f before
              the layer already sums dx over tp.)
    row    B: dB = s dy^T (x A^T) with x A^T = sum_t x_t A_t^T: rank t holds dy (whole after g's
              backward) but only its own term, so dB_t = s dy^T (x_t A_t^T) is a PARTIAL sum.
    the split pieces (column B_t, row A_t) get exactly their slice of the gradient: no reduction.

So each whole piece passes through Megatron's f (copy_to_tp_region: identity forward, all-reduce of
the gradient backward), exactly as a sequence-parallel norm weight does: one all-reduce over tp of
r * in (column A) or out * r (row B) numbers per adapter and backward, in the weight's dtype. With
sequence parallelism nothing changes: the column layer's x is the all-gathered sequence, the row
layer's partials are reduce-scattered by the base's collective, and its dy all-gathered back.

Dropout draws its mask on each rank; with tp > 1 the column layer's ranks draw different masks
for the same x (each output slice sees its own mask), which is still dropout of the input, only
not the mask one process would draw. Layout-equal runs are checked with lora_dropout 0.

Under ZeRO-3 the adapters are REPLICATED over dp_shard_cp, not sharded: fully_shard leaves them out
of the flat buffers (its ignored_params), so every unit holds frozen weights only (gathered, never
reduced, no optimizer state), and the adapters' gradients are summed over dp_cp by the DDP
all-reduce (minipar/data_parallel/ddp.py), once per step. The bytes that decide it, counted for
Llama-3-8B (d 4096, f 14336, 8 KV heads of 128, 32 layers) at r = 16 on all seven projections:
r (in + out) summed = 1.31 M elements per layer, 41.9 M in all (0.5 % of the model), so

    replicated  16 bytes each (fp32 weight, gradient, two AdamW states): 671 MB on every rank;
                one all-reduce of 168 MB per step (wire 2 (N-1)/N of it)
    sharded     671 MB / N per rank, but an all-gather of the adapters before every forward and
                backward and a reduce-scatter after, per micro-batch: more collectives and bytes

next to the base's own traffic (all-gathers of 16 GB of bf16 weights, twice per micro-batch) either
is about 1 %, and 671 MB is small beside the base's fp32 shard (32 GB / N). Replication is the simpler
of the two at the same cost, so minipar replicates; at 70B (207 M adapter elements, 3.3 GB) sharding
them would start to pay. benchmarks/bench_lora.py measures a LoRA run against a full fine-tune.

add_lora() below puts an adapter on every Linear a model declares (`model.lora_target_modules`: the
names of its projections, as `zero3_unit_classes` names its units) and freezes the rest. Each adapter
is the Linear's submodule `lora`, so its parameters are named as PEFT's layout needs
(`q_proj.lora.lora_A`: checkpoints, exports, peft_format.py), go with their layer under pipeline
parallelism, and stay out of ZeRO-3's flat buffers (the trainer passes them as fully_shard's
ignored_params; docs/finetuning.md). And it is one of the Linear's `output_addends`
(minipar/tensor_parallel/layers.py's seams): the layer adds lora(x) to its local output, for a
row-parallel layer to the partial sum before the reduction. That is all the tensor-parallel layer
knows of it: a callable whose output joins its own.

Under torch.compile (compile: true) the adapters are inside the compiled region of their layer
(traced with the linear they add to); their f at tp > 1 is a graph boundary, as the layer's own.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Dict, Iterable, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_tensor
from ..tensor_parallel.mappings import copy_to_tp_region


def _param(shape, split_dim, full_shape, device) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, device=device))
    p.tp_split_dim, p.tp_full_shape = split_dim, tuple(full_shape)
    return p


class LoRA(nn.Module):
    """The adapter of one tensor-parallel Linear: `lora_A`, `lora_B` (PEFT's names), shaped and
    split by the Linear's kind (module docstring). forward(x) is the update s * (x A^T) B^T in
    the Linear's local coordinates: the Linear adds it to its (partial) output (output_addends)."""

    def __init__(self, linear: nn.Module, r: int, alpha: float, dropout: float = 0.0, device=None):
        super().__init__()
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"lora_r must be an integer >= 1, got {r!r}")
        tp, n_in, n_out = linear.tp, linear.in_features, linear.out_features
        self.tp, self.r, self.alpha, self.scaling = tp, r, float(alpha), float(alpha) / r
        self.row = isinstance(linear, RowParallelLinear)
        if not self.row and not isinstance(linear, ColumnParallelLinear):
            raise ValueError(f"LoRA: {type(linear).__name__} is not a Column/RowParallelLinear")
        if getattr(linear, "async_overlap", False):
            raise ValueError("LoRA with tp_async_overlap: the overlapped column-parallel backward "
                             "(async_linear.py) computes no adapter; set tp_async_overlap: false")
        # a meta-built base still gets real adapters unless device="meta" is asked for (shapes only)
        device = device if device is not None else \
            (None if linear.weight.is_meta else linear.weight.device)
        if self.row:                         # A split by input columns like W0, B whole
            self.lora_A = _param((r, n_in // tp.size), 1, (r, n_in), device)
            self.lora_B = _param((n_out, r), None, (n_out, r), device)
        else:                                # A whole, B split by output rows like W0
            self.lora_A = _param((r, n_in), None, (r, n_in), device)
            self.lora_B = _param((n_out // tp.size, r), 0, (n_out, r), device)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator):
        """A: Kaiming-uniform as PEFT (torch's kaiming_uniform_ with a=sqrt(5): bound 1/sqrt(in)),
        drawn FULL from `generator` and sliced, so every layout starts alike; B: zero."""
        if self.lora_A.is_meta:
            return
        n_in = self.lora_A.tp_full_shape[1]
        bound = 1.0 / math.sqrt(n_in)
        full = torch.empty(self.lora_A.tp_full_shape).uniform_(-bound, bound, generator=generator)
        self.lora_A.copy_(shard_tensor(full, self.lora_A.tp_split_dim, self.tp))
        self.lora_B.zero_()

    def forward(self, x):
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)   # bf16 compute, fp32 adapters
        if self.tp.size > 1:                 # the whole piece's gradient: summed over tp (f)
            if self.row:
                b = copy_to_tp_region(b, self.tp)
            else:
                a = copy_to_tp_region(a, self.tp)
        return F.linear(F.linear(self.dropout(x), a), b) * self.scaling

    def extra_repr(self):
        return f"r={self.r}, alpha={self.alpha:g}, {'row' if self.row else 'column'}, tp={self.tp.size}"


def lora_targets(model: nn.Module) -> Sequence[str]:
    """The projection names a model declares for LoRA (its `lora_target_modules`) that some layer of
    this model has as a Column/RowParallelLinear, in the declared order: a model whose every layer's
    feed-forward is a mixture of experts (models/moe.py: stacked expert weights and a bare router
    weight, no Linear) has its attention's only."""
    targets = getattr(model, "lora_target_modules", None)
    if not targets:
        raise ValueError(f"{type(model).__name__} declares no lora_target_modules: the model must name "
                         f"the Linear layers an adapter may sit on")
    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    return tuple(t for t in targets if t in present)


def check_targets(requested: Optional[Iterable[str]], target_linear: bool, available: Sequence[str],
                  declared: Optional[Sequence[str]] = None):
    """The target module names to adapt, or a ValueError naming the wrong ones and what to write.
    `available`: the Linear names the model has (lora_targets), `declared`: every name the model
    class may have (its lora_target_modules; default `available`). `target_linear` (Axolotl's
    lora_target_linear) means every Linear the model has, as PEFT's all-linear adapts the nn.Linear
    modules it finds: on a model whose layers are all mixtures of experts the attention's only, the
    experts (stacked weights, as transformers 5 stores them) and routers staying frozen."""
    requested = list(requested or [])
    declared = list(available if declared is None else declared)
    unknown = [t for t in requested if t not in declared]
    if unknown:
        raise ValueError(f"lora_target_modules {unknown} are not Linear layers of this model; choose "
                         f"from {list(available)} (or lora_target_linear: true for all of them)")
    absent = [t for t in requested if t not in available]
    if absent:
        raise ValueError(f"lora_target_modules {absent}: no layer of this model has them (every layer's "
                         f"feed-forward is a mixture of experts, whose experts are stacked weights, no "
                         f"Linear); write lora_target_modules: [{', '.join(available)}] (or "
                         f"lora_target_linear: true, which adapts those and leaves the experts frozen)")
    targets = list(available) if target_linear else requested
    if not targets:
        raise ValueError(f"adapter: lora needs lora_target_modules (some of {list(available)}) or "
                         f"lora_target_linear: true")
    return [t for t in available if t in targets]          # the model's order


def _generator(seed: int, name: str) -> torch.Generator:
    # seeded by the adapter's global name: the same A on every layout and pipeline stage,
    # whatever other layers a rank holds
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2 ** 62)


def add_lora(model: nn.Module, targets: Sequence[str], r: int, alpha: float, dropout: float = 0.0,
             seed: int = 0, device=None) -> Dict[str, LoRA]:
    """Freeze every parameter of `model`, then give each Linear named in `targets` (the last part
    of its module name) an adapter: its submodule `lora` (the names) and one of its output_addends
    (where it acts). Returns {module name: adapter}. A Linear that had one gets the new one instead.
    Call it on the whole model (before a pipeline cut or ZeRO-3), so names are global."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters: Dict[str, LoRA] = {}
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, (ColumnParallelLinear,
                                                                     RowParallelLinear)):
            adapter = LoRA(module, r, alpha, dropout, device)
            adapter.reset_parameters(_generator(seed, name))
            old = module._modules.get("lora")
            if old is not None:                          # replaced, not added twice
                module.output_addends.remove(old)
            module.lora = adapter                        # named <linear>.lora.lora_A / lora_B (PEFT's layout)
            module.output_addends.append(adapter)        # added to the (partial) output, before any reduction
            adapters[name] = adapter
    found = {n.rsplit(".", 1)[-1] for n in adapters}
    missing = [t for t in targets if t not in found]
    if missing:
        raise ValueError(f"add_lora: no Linear layer named {missing} in {type(model).__name__}")
    return adapters


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """Inside the block the model is its frozen base: every adapter leaves its Linear's
    output_addends (so it computes nothing and sends nothing, on every rank alike) and comes back
    after. DPO's reference with LoRA (minipar/dpo_step.py), as PEFT's disable_adapter(): no copy."""
    saved = [(m, list(m.output_addends)) for m in model.modules()
             if isinstance(m._modules.get("lora"), LoRA) and m.lora in m.output_addends]
    for m, _ in saved:
        m.output_addends.remove(m.lora)
    try:
        yield model
    finally:
        for m, addends in saved:                  # as they were, in their order
            m.output_addends[:] = addends


def lora_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The trainable adapter parameters, in model order."""
    return [p for n, p in model.named_parameters() if ".lora.lora_" in n]


def lora_summary(model: nn.Module, targets: Sequence[str], r: int, alpha: float, n_params: int,
             model_dir: Optional[str] = None) -> str:
    """The line a run logs once adapters are added: where, how many trainable parameters, and that
    the base (with an MoE's stacked experts and routers) stays frozen."""
    n_lora = sum(math.prod(p.tp_full_shape) for p in lora_parameters(model))
    c = model.config
    moe = sum(c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    return (f"LoRA r={r}, alpha={alpha:g} on {', '.join(targets)}: {n_lora / 1e6:.2f} M trainable "
            f"parameters ({100 * n_lora / n_params:.2f} % of {n_params / 1e6:.1f} M), the base frozen"
            + (f"; adapters from {model_dir}" if model_dir else "")
            + (f"; the experts and routers of the {moe} mixture-of-experts layers frozen too (stacked "
               f"weights, no Linear: as PEFT's all-linear leaves transformers' stacked experts)"
               if moe else ""))
