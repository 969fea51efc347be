"""Tensor parallelism applied to a plain decoder from outside (picotron's apply_tensor_parallel,
torchtitan's parallelize_module): the decoder is written with nn.Linear, nn.Embedding and plain
norms, and this file swaps, module by module, what tp changes. The plan (Megatron's split; f and g
are the conjugate functions of mappings.py, b s d the residual stream's size):

    module                      becomes                     weight kept       forward / backward
    embed_tokens  Embedding     VocabParallelEmbedding      rows V/tp         g (SP: reduce-scatter) / -
    q/k/v_proj    Linear        ColumnParallelLinear        rows out/tp       f once for the three
                                                            (heads/tp)        (SP: all-gather) / its mirror
    o_proj        Linear        RowParallelLinear           columns in/tp     g (SP: reduce-scatter) / -
    gate/up_proj  Linear        ColumnParallelLinear        rows F/tp         f once for the two / mirror
    down_proj     Linear        RowParallelLinear           columns F/tp      g (SP: reduce-scatter) / -
    lm_head       Linear        ColumnParallelLinear        vocab rows V/tp   f (SP: all-gather) / mirror;
                                                                              the loss needs only V/tp
    norms         RMSNorm       the same, weight replicated; under SP its weight passes through f,
                                so its gradient (from s/tp tokens per rank) is summed over tp
    q_norm/k_norm RMSNorm       weight through f whenever tp > 1: each rank normed some heads only
    an MoE layer                whole on every rank; under SP its router's and experts' weights
                                pass through f, as the norms' do (each rank routes its own tokens)

So a dense layer costs two collectives of b s d in forward (after o_proj and down_proj; under SP
plus the two all-gathers in, which an all-reduce contains anyway: the same bytes) and two in
backward; the norms' f costs an all-reduce of d numbers each in backward (head_dim for q/k_norm).
The projections that read one x enter the tp region together: the attention and the MLP call
their `input_projections(x, layers)` once (a plain loop in the decoder), which this file points
at layers.column_parallel_group, ONE input collective for q, k, v (and for gate, up), or under
async_overlap one fused Function whose backward overlaps it (async_linear.py).

Every swap keeps the module's name and its parameters' order, so HF's names and the seeded
initialisation (full tensors drawn in parameter order, then sliced) are those of the plain model.
On the meta device the new layers are shapes only; on real tensors each rank's slice of the full
weight is cut with shard_tensor. A weight used twice (a tied lm_head and embedding) stays one
Parameter: the later swap takes the earlier one's slice (both keep vocabulary rows, dim 0).
Every parameter gets `tp_split_dim` (None: replicated) and `tp_full_shape`, which checkpoints,
ZeRO-3's slicing and the gradient norm read.

    model = LlamaForCausalLM(config, pgm, device="meta", tensor_parallel=False)  # plain
    parallelize(model, pgm.tp, sequence_parallel=True, async_overlap=False)       # this file
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_group,
    shard_tensor,
)
from .mappings import sequence_parallel_weight

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")   # Linear -> column-parallel
ROW = ("o_proj", "down_proj")                                                 # Linear -> row-parallel
VOCAB = ("embed_tokens",)                                                     # Embedding -> vocab rows
HEAD_NORMS = ("q_norm", "k_norm")     # norms over each head: a rank holds some heads only


def parallelize(model: nn.Module, tp, sequence_parallel: bool = False,
                async_overlap: bool = False) -> nn.Module:
    """Apply the plan of the module docstring to `model` in place (and return it). tp: the tp group
    (mesh.py MeshDim); one rank gives the same classes with nothing split and nothing sent."""
    done = [n for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear,
                                                                  VocabParallelEmbedding))]
    if done:
        raise ValueError(f"parallelize: {done[0]} is tensor-parallel already "
                         f"(parallelize a plain model, once)")
    sp = sequence_parallel and tp.size > 1
    swapped = {}                                  # id(plain weight) -> its tp Parameter (ties)
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        for attr, child in list(module.named_children()):
            new = _swap(attr, child, tp, sp, async_overlap)
            if new is None:
                continue
            tied = swapped.get(id(child.weight))
            if tied is not None:                  # the same weight twice: one Parameter, the same rows
                if tied.shape != new.weight.shape or tied.tp_split_dim != new.weight.tp_split_dim:
                    raise ValueError(f"{attr}: its tied weight is split otherwise ({tuple(tied.shape)}, dim "
                                     f"{tied.tp_split_dim}) than {tuple(new.weight.shape)}")
                new.weight = tied
            swapped[id(child.weight)] = new.weight
            setattr(module, attr, new)            # the same key of _modules: the order is kept
        if hasattr(module, "input_projections"):  # attention, MLP: one input collective per region
            module.input_projections = column_parallel_group
        # a replicated weight used on part of the tokens (a norm's, an MoE layer's router and experts
        # under SP; q/k_norm's, on part of the heads, whenever tp > 1): its gradient summed over tp
        if hasattr(module, "weight_through") and (leaf in HEAD_NORMS and tp.size > 1 or sp):
            module.weight_through = functools.partial(sequence_parallel_weight, tp=tp, sequence_parallel=True)
        for attr in ("local_heads", "local_kv_heads"):      # the heads this rank keeps
            if hasattr(module, attr):
                setattr(module, attr, _local(f"{name}.{attr}", getattr(module, attr), tp))
    for p in model.parameters():                  # the rest is replicated over tp
        if not hasattr(p, "tp_split_dim"):
            p.tp_split_dim, p.tp_full_shape = None, tuple(p.shape)
    return model


def _local(what: str, n: int, tp) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} is not divisible by tp_size={tp.size}: "
                         f"choose a tp_size that divides it")
    return n // tp.size


def _swap(attr: str, child: nn.Module, tp, sp: bool, async_overlap: bool):
    """The tp layer that replaces `child` (named `attr` in its parent), or None: not in the plan."""
    if attr in VOCAB and isinstance(child, nn.Embedding):
        V, d = child.weight.shape
        with torch.device("meta"):
            new = VocabParallelEmbedding(V, d, tp, sequence_parallel=sp)
    elif attr in COLUMN + ROW and isinstance(child, nn.Linear):
        cls = ColumnParallelLinear if attr in COLUMN else RowParallelLinear
        extra = dict(async_overlap=async_overlap) if cls is ColumnParallelLinear else {}
        with torch.device("meta"):
            new = cls(child.in_features, child.out_features, tp, bias=child.bias is not None,
                      sequence_parallel=sp, **extra)
    else:
        return None
    for pname, p in list(new.named_parameters(recurse=False)):
        src = getattr(child, pname)
        if src.is_meta:                            # shapes only: a weight source fills it later
            q = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=src.requires_grad)
        else:                                      # this rank's slice of the real full tensor
            q = nn.Parameter(shard_tensor(src.detach(), p.tp_split_dim, tp).clone().to(src.dtype),
                             requires_grad=src.requires_grad)
        q.tp_split_dim, q.tp_full_shape = p.tp_split_dim, p.tp_full_shape
        setattr(new, pname, q)
    return new
