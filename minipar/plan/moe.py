"""The planner's mixture of experts: what models/moe.py and minipar/expert_parallel/ cost a rank.

Notation as model.py's, and: E experts of width F, top-k, ep ranks per ep group (E/ep experts each),
edp = S C / ep (the ranks holding the same experts: their ZeRO-3 shard group), n local tokens of a
micro-batch (n / T under sequence parallelism: the MoE sees the norms' tokens), N = n k copies.

Memory. Each MoE layer's experts are 3 stacked tensors, (E/ep, F, d) each on this rank (not split
over tp), in a ZeRO-3 unit of their own sharded over edp (zero3/wrap.py cuts it out: the
parameters that carry ep_split_dim, expert_parallel/sharding.py):

    expert elements per rank and layer   ceil(3 (E/ep) F d / edp)       (padded, as every flat shard)

and the router (E, d) stays in the layer's unit over dp_shard_cp. A layer's two units gather in the
same module hook, so the gathered peak is one module's units plus the `prefetch` units after them.

Communication, per MoE layer and micro-batch (ledger op, group: comm.py's conventions):

    ("all_to_all", "ep")          the counts: E int64, once per forward (again when recomputed)
    ("all_to_all_uneven", "ep")   dispatch and combine forward, and their backward (the reverse
                                  exchanges): 4 calls (+ 2 when recomputed); the ledger counts each
                                  call's whole input, N or M rows of d x e bytes
    ("all_gather", "edp")         the experts' unit, twice (once without reshard_after_forward)
    tp                            no f / g around the feed-forward (model.py: L + 1 pairs, not 2 L + 1);
                                  under SP the router's and each expert tensor's gradient summed
    ("reduce_scatter", "edp")     its fp32 gradient; HSDP adds its shard's all-reduce over dp_replicate
    aux loss                      (2 L_moe E + 1) fp32 over tp (under SP) and over cp, per micro-batch
    metrics                       (L_moe E + 2) fp64 over dp_cp once a step (moe_metrics.py)

The token exchange's bytes depend on the routing: the rows this rank sends (N = n k, exact) and
receives (M, which is N only on average). The plan is the BALANCED case, M = N: every exchange
4 n k d e bytes of buffer, wire (ep - 1) / ep of that. Summed over an ep group it is exact (every
copy sent is received once); per rank it moves with the router's imbalance (tests/test_plan_moe.py
holds the calls exactly, the sum over ranks exactly and each rank within 25 %).

Activations of an MoE feed-forward (replacing the dense MLP's 4 e n f / T), balanced:

    router      fp32 probabilities 4 n E, top-k ids 8 n k, (norm_topk_prob) weights and sum 4 n k + 4 n
    sort        order and token ids 16 N; ep > 1: the regroup's order and its inverse 16 N
    experts     their input rows e N d, gate, silu(gate), up, product 4 e N F
    combine     the outputs e N d, the router weights e N (their product's), and the weighted rows
                in the stream's dtype again: index_add_ keeps its source for backward (torch's
                derivative expands the gathered gradient to the source's shape)
    autocast    (bf16 without ZeRO-3: activation_bytes.py) gate and up each save their own bf16
                cast of the fp32 rows (2 e N d), index_add_'s source is fp32 (4 N d), and the
                matmuls save bf16 casts of the router's weight and of every local expert's three
                (`weight_casts`: e (E d + 3 (E/ep) F d)); an expert no row reaches runs no matmul
                and casts none, 3 e F d less (`expert_cast_bytes`): the plan, balanced, reaches all
    aux loss    once per micro-batch (models/moe_aux.py): the counts C_e, 4 E, and the divisor
                (L T)^2, a 0-d fp32 tensor: 4 E + 4 bytes (`aux_activations`)

The experts' rows and the regroup's indices are M on a rank, N only on average: per rank they move
with the router's imbalance, (M - N) `received_row_bytes` a layer, and summed over an ep group they
are exact, as the token exchange's bytes. tests/test_plan_moe.py holds each rank to the byte, the
plan corrected by these two terms for the routing the rank observed, and the mean over the ranks to
the balanced plan itself.

Time: the exchanges are on the critical path (the experts wait for their tokens, the layer for the
outputs), so the ep group's time is added to the step whole. The experts' ZeRO-3 traffic over edp is
added whole too, an upper bound: overlap.py's per-layer hiding is not applied to it yet.
time_model.py prices every layer's feed-forward as the dense MLP (f / T wide); `matmul_seconds` adds
the difference to what an MoE layer runs, balanced: the router (n, d) x (d, E), and per local expert
N ep / E rows through gate and up (d -> F) and down (F -> d), not split over tp, forward and twice
backward (and again when recomputed). MFU's FLOPs are models/flops.py's active weights.
FLOPs are models/flops.py's (the active weights: k experts and the router per token).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from .inputs import DTYPE_BYTES, param_bytes


def moe_layers(model) -> int:
    """L_moe, the decoder layers whose feed-forward is the mixture of experts."""
    return len(model.moe_layers)


def split_layer(model, layer: List[int]) -> Tuple[List[int], List[int]]:
    """One layer's tensors (ModelShape.tensors) -> (its unit's, the experts' unit's): an MoE layer
    ends in its 3 stacked experts, which zero3/wrap.py (fully_shard) puts in a unit of their own."""
    if not model.is_moe:
        return layer, []
    return layer[:-3], layer[-3:]


def gathered_window(modules: List[List[int]], prefetch: int) -> int:
    """The most elements gathered at once: one module's units (a layer and its experts, gathered by
    the same forward hook) plus the `prefetch` units after its last one, over every module."""
    flat = [x for m in modules for x in m]
    best, start = 0, 0
    for m in modules:
        start += len(m)
        best = max(best, sum(m) + sum(flat[start:start + prefetch]))
    return best


def collectives(add, model, layout, batch, opts, recomputed: int) -> None:
    """add(op, group, calls, bytes) the MoE collectives of one micro-batch (the module docstring)
    but the ZeRO-3 ones, which model.py counts with every unit."""
    if not model.is_moe:
        return
    e, L, E = DTYPE_BYTES[opts.dtype], moe_layers(model), model.num_local_experts
    passes = L + min(recomputed, L)                       # forwards through an MoE layer
    add("all_to_all", "ep", passes, 8 * E)
    add("all_to_all_uneven", "ep", 2 * passes + 2 * L, copies(model, layout, batch) * model.hidden_size * e)
    aux = 4 * (2 * L * E + 1)
    if layout.sp:                    # the router and experts saw n / T tokens: their gradients summed
        add("all_reduce", "tp", 1, aux)
        pe = param_bytes(layout, opts)                    # (in the gathered dtype under ZeRO-3)
        trained = 0 if opts.lora_r else 1                 # LoRA: frozen, no gradient to sum
        add("all_reduce", "tp", L * trained, E * model.hidden_size * pe)
        add("all_reduce", "tp", 3 * L * trained,
            E // layout.ep * model.moe_intermediate_size * model.hidden_size * pe)
    add("all_reduce", "cp", 1, aux)


def step_collectives(add, model, layout) -> None:
    """Once a step: the metrics' sums (moe_aux_loss, moe_imbalance, moe_dropped) over dp_cp."""
    if not model.is_moe:
        return
    add("all_reduce", "dp_cp", 1, 8 * (moe_layers(model) * model.num_local_experts + 2))
    if layout.sp:
        add("all_reduce", "tp", 1, 8)


def copies(model, layout, batch) -> int:
    """N = n k, the routed copies of one micro-batch's tokens on this rank (balanced: also M)."""
    n = batch.micro(layout) * batch.sequence_len // layout.cp
    return (n // layout.tp if layout.sp else n) * model.num_experts_per_tok


def mlp_activations(model, layout, batch, e: int, pe: int) -> int:
    """Saved-for-backward bytes of one MoE feed-forward, balanced (the module docstring), in the
    compute dtype's e bytes and the residual stream's pe (4 under autocast, else e)."""
    n = batch.micro(layout) * batch.sequence_len // layout.cp
    n = n // layout.tp if layout.sp else n
    k, E, d = model.num_experts_per_tok, model.num_local_experts, model.hidden_size
    N = n * k
    router = 4 * n * E + 8 * n * k + (4 * n * k + 4 * n if model.norm_topk_prob else 0)
    sort = 16 * N                                 # order and token ids of this rank's own N copies
    # the M rows the local experts receive, balanced M = N; then the combined outputs, the router
    # weights and the weighted rows, N each
    return router + sort + N * received_row_bytes(model, layout, e, pe) + e * N * d + e * N + pe * N * d


def received_row_bytes(model, layout, e: int, pe: int) -> int:
    """Saved bytes per row a rank's local experts receive (M rows, N only on average): the row (e d,
    or under autocast gate's and up's own bf16 casts of it, 2 e d), gate, silu(gate), up and their
    product (4 e F), and with ep > 1 the regroup's order and its inverse (int64 each). A test that
    sees the routing plans a rank exactly with it: balanced + (M - N) x this, per MoE layer."""
    rows = e * model.hidden_size * (2 if pe != e else 1)
    return rows + 4 * e * model.moe_intermediate_size + (16 if layout.ep > 1 else 0)


def expert_cast_bytes(model, e: int) -> int:
    """Under autocast, the bf16 casts one local expert's three matmuls save of its (F, d) weights. An
    expert that receives no row runs no matmul and casts none (models/moe.py skips it), so a rank
    keeps this much less per unreached expert than the balanced plan (tests/test_plan_moe.py)."""
    return e * 3 * model.moe_intermediate_size * model.hidden_size


def weight_casts(model, layout, e: int) -> int:
    """Under autocast, the bf16 casts an MoE feed-forward's matmuls save of its weights: the router's
    (E, d) and each local expert's three (F, d) (an expert view is no leaf: autocast caches none),
    every local expert reached (as balanced routing does)."""
    E = model.num_local_experts
    return e * model.hidden_size * E + E // layout.ep * expert_cast_bytes(model, e)


def aux_activations(model) -> int:
    """Saved-for-backward bytes of the load-balancing loss, once per micro-batch: the counts C_e
    (E fp32) and the divisor (L T)^2 (a 0-d fp32 tensor), models/moe_aux.py."""
    return 4 * model.num_local_experts + 4 if model.is_moe else 0


def summary(model, layout) -> Dict[str, int]:
    """Total and active parameters, and the experts' share of a rank (what the report prints)."""
    E, k, F, d = model.num_local_experts, model.num_experts_per_tok, model.moe_intermediate_size, \
        model.hidden_size
    expert = 3 * F * d
    total = model.num_params()
    L = moe_layers(model)
    edp = layout.dp_shard * layout.cp // layout.ep
    local = 3 * (E // layout.ep) * F * d
    return dict(total_params=total, active_params=total - L * (E - k) * expert, experts=E, top_k=k,
                ep=layout.ep, edp=edp, moe_layers=L, experts_per_rank=E // layout.ep,
                expert_elements_per_rank=L * -(-local // edp))


def crosses_nodes(layout, gpus_per_node: int) -> Dict[str, bool]:
    """Whether the ep and edp groups (mesh.py: consecutive and every ep-th rank of dp_shard_cp, whose
    index is s C + c) lie on more than one node of the grid (R, S C, T), tp fastest."""
    SC, ep = layout.dp_shard * layout.cp, layout.ep
    node = (np.arange(layout.world) // gpus_per_node).reshape(layout.dp_replicate, SC // ep, ep, layout.tp)
    out = {}
    for group, axis in (("ep", 2), ("edp", 1)):
        members = np.moveaxis(node, axis, -1).reshape(-1, node.shape[axis])
        out[group] = bool((members.min(axis=1) != members.max(axis=1)).any())
    return out


def exposed_seconds(groups: Dict[str, dict]) -> float:
    """What the step waits for of the MoE's own groups: the token exchanges over ep and (an upper
    bound, the module docstring) the experts' ZeRO-3 traffic over edp."""
    return sum(groups.get(g, {}).get("seconds", 0.0) for g in ("ep", "edp"))


def matmul_seconds(model, layout, batch, opts, gemm, again: float) -> float:
    """The MoE layers' GEMM seconds of a step less the dense MLP's that time_model.py priced in their
    place (the module docstring); gemm(m, k, n) prices one GEMM, `again` is the share recomputed."""
    rows = batch.micro(layout) * batch.sequence_len / layout.cp
    tokens = rows / layout.tp if layout.sp else rows
    E, local, d, F = model.num_local_experts, model.num_local_experts // layout.ep, model.hidden_size, \
        model.moe_intermediate_size
    r = copies(model, layout, batch) / local                  # balanced: each local expert's rows
    moe = gemm(tokens, d, E) + local * (2 * gemm(r, d, F) + gemm(r, F, d))
    f, T = model.intermediate_size, layout.tp
    dense = gemm(rows, d, 2 * f / T) + gemm(rows, f / T, d)
    return batch.micro_steps(layout) * moe_layers(model) * (3 + again) * (moe - dense)
