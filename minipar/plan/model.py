"""What one training step costs a rank, from the shapes alone: its memory and its FLOPs.

A pure function of (model shape, layout, batch, dtype; the four inputs are inputs.py's): no
process group, no tensor. Every count follows minipar's code path by path, so tests/test_plan.py
holds it EXACTLY against real forked runs (persistent state, the comm ledger, activations).

Notation: d hidden, f intermediate, L layers, H / K query / KV heads, D head_dim, V vocab,
T = tp, C = cp, S = dp_shard, R = dp_replicate, N = S * C (the ZeRO-3 shard group dp_shard_cp),
b micro-batch rows, s = seq / C local tokens per row, n = b * s local tokens, e = bytes of the
compute dtype (4 fp32, 2 bf16), M micro-batches per step.

Persistent state per rank (what lives between steps, after backward):
    parameters  fp32 masters                4 B x P_rank
    gradients   fp32                        4 B x P_rank
    AdamW       exp_avg, exp_avg_sq fp32    8 B x P_rank, + 4 B per tensor (torch's `step` counter)
                (optimizer: adamw_bnb_8bit and bitsandbytes' other 8-bit ones: 1 B per moment and
                element + 4 B per block of 256, fp32 moments for tensors under 4096 elements;
                minipar/optim_bnb.py's state_bytes, per tensor: a flat shard is one under ZeRO-3)
  P_rank = the TP-local parameters; under ZeRO-3 (S > 1) the sum over units of ceil(P_unit / N),
  each unit's flat buffer padded to a multiple of N, and one tensor per unit.
  With LoRA (adapter: lora) the base keeps its 4 B x P_rank of fp32 weights only, and the adapters,
  A_rank = L x their TP-local elements (whole over dp, inputs.py's lora_tensors), take the 16 B.
  Its collectives (`collectives`): no reduce-scatter of the frozen units, the adapters' all-reduce
  over dp_cp, one tp all-reduce per adapter's whole piece, and fewer backward f/g at layer 0; its
  FLOPs and a pipeline stage's memory and collectives (pipeline_stage.py) are a full fine-tune's.
Gathered (ZeRO-3 only): full unit buffers in the compute dtype: the root (final norm, lm_head) from
  the start of forward into its backward, plus a window of 1 + prefetch units (the embedding, then
  decoder layers) moving through the forward and backward orders. With fsdp.sync_each_batch false
  (no_sync) the unsharded fp32 gradients of every unit are held between micro-batches as well.

Activations: activation_bytes.py. Collectives per step: collective_counts.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from minipar.optim_bnb import state_bytes
from models.flops import layers_matmul_weights, matmul_weights, step_flops

from .activation_bytes import recompute_shares
from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options
from .moe import gathered_window, split_layer


# --------------------------------------------------------------------------------------- memory
@dataclass
class Unit:
    name: str
    numel: int                     # TP-local elements in the flat buffer (before padding)
    tensors: int
    kind: str = "layer"            # "root", "embedding", "layer" or an MoE layer's "experts"
    group: str = "dp_shard_cp"     # its ZeRO-3 shard group (an MoE layer's experts: edp, moe.py)


def units(model: ModelShape, layout: Layout) -> List[Unit]:
    """ZeRO-3 units as the trainer builds them: the root (final norm, lm_head; the embedding too
    when tied to lm_head) first, the embedding, then one per decoder layer."""
    emb, layer, head = model.tensors(layout.tp, layout.ep)
    if model.tie_word_embeddings:
        out = [Unit("<root>", sum(emb) + sum(head), len(emb) + len(head), "root")]
    else:
        out = [Unit("<root>", sum(head), len(head), "root"),
               Unit("model.embed_tokens", sum(emb), len(emb), "embedding")]
    rest, experts = split_layer(model, layer)
    for i in range(model.num_hidden_layers):
        out.append(Unit(f"model.layers.{i}", sum(rest), len(rest)))
        if experts:
            out.append(Unit(f"model.layers.{i}.experts", sum(experts), len(experts), "experts", "edp"))
    return out


def shard_size(u: Unit, layout: Layout) -> int:
    """The ranks a unit is sharded over: dp_shard_cp, or edp for an MoE layer's experts."""
    return layout.sizes()[u.group]


def gathers(u: Unit, opts: Options) -> int:
    """All-gathers of a unit per micro-batch: the root stays gathered from forward into backward
    and an embedding's backward never reads its weight (once each); a layer is gathered for its
    forward and again for its backward (once without reshard_after_forward)."""
    return 1 if u.kind not in ("layer", "experts") or not opts.reshard_after_forward else 2


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def memory(model: ModelShape, layout: Layout, opts: Options) -> Dict[str, int]:
    """Bytes per rank: persistent params / grads / optimizer, and the gathered ZeRO-3 buffers."""
    e = DTYPE_BYTES[opts.dtype]
    us = units(model, layout)
    accumulated = 0
    if layout.sharded:
        padded = [_padded(u.numel, shard_size(u, layout)) for u in us]
        sizes = [p // shard_size(u, layout) for u, p in zip(us, padded)]     # a flat shard per unit
        elems = sum(sizes)
        root, rest = padded[0], padded[1:]
        if not opts.reshard_after_forward:
            gathered = root + sum(rest)
        else:   # the root all along; a module's units (a layer and its experts) + prefetch more
            modules: List[List[int]] = []
            for u, p in zip(us[1:], rest):
                if u.kind == "experts":
                    modules[-1].append(p)
                else:
                    modules.append([p])
            gathered = root + gathered_window(modules, opts.prefetch)
        gathered *= e
        if not opts.sync_each_batch:   # no_sync: unsharded fp32 gradients held between micro-batches
            accumulated = 4 * (root + sum(rest))
    else:
        emb, layer, head = model.tensors(layout.tp, layout.ep)
        sizes = emb + layer * model.num_hidden_layers + head
        elems, gathered = sum(sizes), 0
    if opts.lora_r:     # LoRA: the base (sharded or not) has no gradient or state; the adapters do
        ad = model.lora_tensors(layout.tp, opts.lora_r, opts.lora_targets) * model.num_hidden_layers
        a, opt = sum(ad), state_bytes(opts.optimizer, ad)
        return dict(params=4 * (elems + a), grads=4 * a, optimizer=opt, persistent=4 * elems + 8 * a + opt,
                    gathered=gathered, accumulated_grads=0, param_elements=elems + a)
    opt = state_bytes(opts.optimizer, sizes)
    return dict(params=4 * elems, grads=4 * elems, optimizer=opt, persistent=8 * elems + opt,
                gathered=gathered, accumulated_grads=accumulated, param_elements=elems)


# ---------------------------------------------------------------------------------------- FLOPs
def flops(model: ModelShape, layout: Layout, batch: Batch, opts: Options) -> Dict[str, float]:
    """FLOPs of one step, models/flops.py's count (the one the trainer's `mfu` divides too):
    `model` (6 x matmul weights x tokens + the causal half of attention: what MFU divides),
    `model_full_attention` (attention counted whole, torchtitan's convention), `rank` (executed
    by one rank, + the forward again under activation checkpointing)."""
    m = model
    step = step_flops(m, batch.global_batch_size, batch.sequence_len)
    model_flops = step.causal
    layers_share = (step.matmul * layers_matmul_weights(m) / matmul_weights(m)
                    + step.attention_causal) / model_flops
    again = recompute_shares(model, opts)[0]          # the matmul / attention share that runs again
    rank = model_flops * (1 + again * layers_share / 3) / layout.world
    attn_rank = step.attention_causal * (1 + again / 3) / layout.world
    return dict(model=model_flops, model_full_attention=step.full, rank=rank, attention_rank=attn_rank,
                attention_model=step.attention_causal,
                params=m.num_params())
