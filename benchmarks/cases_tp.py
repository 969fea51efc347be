"""Tensor-parallel variants: minipar TP (and TP + SP) against torch DTensor with the same plan.

    minipar TP        ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding + vocab-parallel loss
    minipar TP + SP   the same, sequence_parallel=True
    DTensor TP        the plain model, q/k/v/gate/up ColwiseParallel, o/down RowwiseParallel, embedding
                      RowwiseParallel, lm_head ColwiseParallel(Shard(-1)) + loss_parallel():
                      torch.distributed.tensor.parallel.parallelize_module
    DTensor TP + SP   torchtitan's plan: SequenceParallel norms, PrepareModuleInput all-gathers

Every rank of the tp group sees the same batch; a step is forward + backward + AdamW. Collectives
per step: minipar's ledger (count and bytes); DTensor's counted by CommDebugMode (counts; it also
sees minipar's, a cross-check). Per block, without SP, minipar issues 2 all-reduces forward and 2
backward (once per shared input); DTensor's plain plan 2 forward and 5 backward (each Colwise
layer reduces its own input gradient). With SP both issue reduce-scatter + all-gather pairs.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from common import timed_world

TP = ["DTensor TP", "minipar TP", "DTensor TP + SP", "minipar TP + SP"]


def _dtensor():
    try:                                               # torch >= 2.5; 2.4 keeps DTensor in a private module
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.debug import CommDebugMode
    except ImportError:                                # pragma: no cover
        from torch.distributed._tensor import Replicate, Shard
        from torch.distributed._tensor.debug import CommDebugMode
    return Replicate, Shard, CommDebugMode


class Linear(nn.Linear):
    """nn.Linear (so DTensor's styles accept it) that ignores minipar's skip_input_comm keyword and
    carries the one-process tp group, so column_parallel_group's input step is the identity."""

    def forward(self, x, skip_input_comm=False):
        return super().forward(x)


def plain_model(cfg):
    """minipar's decoder built for one process, its parallel layers swapped for nn.Linear/nn.Embedding
    with the same weights: the model DTensor parallelizes."""
    from models.llama import LlamaForCausalLM
    model = LlamaForCausalLM(cfg, None, seed=0)

    def linear(old):
        new = Linear(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        new.tp, new.sequence_parallel, new.async_overlap = old.tp, False, False
        return new
    for layer in model.model.layers:
        for mod, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                           (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                setattr(mod, n, linear(getattr(mod, n)))
    emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    emb.weight = model.model.embed_tokens.weight
    model.model.embed_tokens, model.lm_head = emb, linear(model.lm_head)
    return model


def dtensor_model(cfg, mesh, sp):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    Replicate, Shard, _ = _dtensor()
    model = plain_model(cfg)
    if not sp:     # the plain plan: each Colwise layer takes a replicated input, each Rowwise gives one
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    else:          # torchtitan's: norms on sequence shards, one all-gather before attention and the MLP
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                           use_local_output=False)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + n] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + n] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            plan[p + "input_layernorm"] = SequenceParallel()
            plan[p + "post_attention_layernorm"] = SequenceParallel()
            # attention's inputs are (x, cos, sin, document_ids): only x is a sequence shard
            plan[p + "self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                       desired_input_layouts=(Replicate(), None, None, None))
            plan[p + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                 desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, plan)
    for layer in model.model.layers:     # the attention code reshapes by its local head counts
        layer.self_attn.local_heads //= mesh.size()
        layer.self_attn.local_kv_heads //= mesh.size()
    return model


def settle_embedding_output(model):
    """Before compiling the layers of a dtensor_model: the embedding's output made a plain tensor,
    outside the compiled region (one copy of the (b, s, h) activations per step).

    RowwiseParallel's output hook redistributes with async_op=True, so the embedding's to_local()
    is an AsyncCollectiveTensor (the all-reduce's lazy result) that requires grad, and it is the
    first compiled layer's input. torch 2.13's AOT autograd resolves such an input with
    trigger_wait(), which returns the inner tensor without the wrapper's autograd history (pytorch
    PR #179849 added that; PR #191113 proposes the fix): the gradient to the embedding is lost,
    and the backward fails in the embedding's redistribute ("'Tensor' object has no attribute
    '_local_tensor'"). The smallest form (tests/test_compile.py): on 2 gloo ranks,
    DTensor.from_local(a, mesh, [Partial()]).redistribute(mesh, [Replicate()], async_op=True)
    .to_local() fed to a function compiled with aot_eager: its output "does not require grad";
    with async_op=False, the eager backend, or the input cloned first, `a` gets its gradient.
    torchtitan's plan has the same input (its embedding's RowwiseParallel, output Shard(1) under
    SP); a clone outside the region waits for the collective and keeps the history (clone's
    backward, then to_local's)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def settle(module, args, out):
        return out.clone() if isinstance(out, AsyncCollectiveTensor) else out
    model.model.embed_tokens.register_forward_hook(settle)   # after parallelize_module's: runs last


def tp_world(variant, size, steps):
    import minipar
    from minipar import ParallelismConfig, comm_ledger
    from models.llama import LlamaForCausalLM
    n = dist.get_world_size()
    sp = variant.endswith("+ SP")
    state = {}

    def build():
        cfg = size.llama()
        g = torch.Generator().manual_seed(1000)
        ids = torch.randint(0, cfg.vocab_size, (size.rows, size.seq), generator=g)
        labels = torch.randint(0, cfg.vocab_size, (size.rows, size.seq), generator=g)
        if variant.startswith("minipar"):
            model = LlamaForCausalLM(cfg, minipar.init(ParallelismConfig(tp_size=n, sequence_parallel=sp)),
                                     seed=0)

            def loss_fn():
                model(ids, labels=labels).backward()
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import loss_parallel
            model = dtensor_model(cfg, init_device_mesh("cpu", (n,), mesh_dim_names=("tp",)), sp)

            def loss_fn():
                logits = model(ids)                  # (b, s, V) DTensor, sharded on the vocabulary
                with loss_parallel():                # backward too must run inside
                    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            loss_fn()
            opt.step()
            opt.zero_grad(set_to_none=True)
        state["step"] = step
        return step, extras

    def extras():
        CommDebugMode = _dtensor()[2]
        with warnings.catch_warnings(), CommDebugMode() as cdm, comm_ledger.ledger() as led:
            # CommDebugMode's module tracker adds full backward hooks, which warn when the input ids
            # need no gradient: expected here, not a problem of the model
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            state["step"]()
        counts = {}
        for op, v in cdm.get_comm_counts().items():    # c10d names differ by torch release: keep the kind
            name = str(op)
            kind = "all_gather" if "gather" in name else "reduce_scatter" if "scatter" in name else \
                "all_reduce" if "reduce" in name else name
            counts[kind] = counts.get(kind, 0) + v
        out = dict(collectives=counts)
        if variant.startswith("minipar"):
            out["comm"] = {}
            for r in led.records:
                out["comm"][r.op] = out["comm"].get(r.op, 0) + r.bytes
        return out

    return timed_world(build, steps)
