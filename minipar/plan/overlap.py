"""What communication hides behind compute: per layer, never more than the compute beside it.

A collective that runs on its own stream while the rank computes costs nothing until it outlasts
that compute; then the rank waits for the rest. The window is not the whole step: a ZeRO-3 gather
can only start once the previous layer's buffer is free, so it hides behind ONE layer's compute,
and a ring hop carries the K/V block the next block of attention needs, so it hides behind ONE
block of attention. Summed per layer, as the trainer's hooks issue them (time_model.py gives the
seconds of each piece):

    ZeRO-3 (prefetch >= 1), per micro-batch, with f / b one layer's forward / backward compute and
    g / r one layer unit's all-gather / reduce-scatter (+ HSDP's all-reduce over dp_replicate):
        forward    g (the first layer: nothing computes before it) + (L - 1) max(0, g - f)
        backward   L max(0, g' + r - b)   g' = g under reshard_after_forward (regathered for the
                                          backward), 0 without; r only in micro-batches that
                                          reduce (every one, or the last under no_sync and pp)
        the rest   the root and the embedding: gathered at the start of a forward and reduced at
                   the end of the backward, nothing beside them: exposed whole (the ledger's dp
                   seconds less the layers' part)
    Under pp every micro-batch regathers the stage's layers for its forward and its backward (the
    schedule interleaves micro-batches, so nothing stays gathered), which the same sum counts.
    DDP (nothing sharded): the buckets' all-reduces run during the last micro-batch's backward;
        exposed = max(0, all of them - that backward) + the last bucket (nothing after it).
    Megatron-LM's distributed optimizer (Options.distributed_optimizer, with --overlap-grad-reduce
        and --overlap-param-gather, which its README's benchmark states): the same fp32 buckets are
        reduce-scattered, not all-reduced (half the wire bytes), during the last micro-batch's
        backward, and the updated bf16 parameters all-gathered bucket by bucket behind the next
        step's first forward (megatron/core/distributed/param_and_grad_buffer.py); exposed =
        max(0, RS - that backward) + max(0, AG - that forward) + one bucket of each.
    ZeRO-3 gathering once per step (Options.gather_once_per_step): PyTorch's pipelining keeps an
        FSDP stage unsharded from its first forward to its last backward when reshard_after_forward
        is False (torchtitan/distributed/fsdp.py: "For PP, by default do not reshard after forward
        to avoid per-microbatch all-gathers"; the Llama 3 paper, section 3.3.2, does not reshard
        after forward), so the forward sum above counts one micro-batch, not M, and no regather.
    prefetch 0: every dp collective is waited for (nothing is issued ahead).
    ring attention (cp under ring, cp_ring under usp: R ranks), per layer and pass: R - 1 hops, each
        behind one block (1 / R) of the layer's attention: (R - 1) max(0, hop - block); the
        backward's hop carries K/V and the fp32 dK/dV accumulators, beside a block twice as long.
    a masked layer (a sliding window that binds, Gemma 2's capped logits: ModelShape.masked) under
        cp, whatever cp_impl: minipar's window_attention.py all-gathers the whole sequence's K/V
        before its attention and reduce-scatters dK/dV after its backward: exposed whole, per layer
        and pass; it runs no ring hops and no all-to-alls.
    all-gather CP (Options.cp_all_gather_kv; the Llama 3 paper, section 3.3.2: K and V are
        all-gathered, then each rank attends its query chunk, "the all-gather communication latency
        is exposed in the critical path"): per layer and pass, the K/V all-gather (forward and
        recompute) and the dK/dV reduce-scatter (backward), exposed whole.
    TP collectives and Ulysses' all-to-alls: exposed whole (the next matmul needs their result),
        but under Megatron-LM's --tp-comm-overlap (Options.tp_comm_overlap; its README states it),
        which splits each SP all-gather / reduce-scatter into chunks pipelined with the GEMM that
        consumes or produces them: hidden up to the step's GEMM time, max(0, tp - GEMMs) exposed.

Not modelled: collectives slowing each other or the compute they overlap (NCCL's SMs, shared
links), the host and kernel-launch gaps.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from .activation_bytes import kv_repeat, recomputed_layers, recomputes
from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options
from .model import Unit, _padded
from .time_model import collective_seconds

DP_GROUPS = ("dp_shard_cp", "dp_replicate", "dp_cp")


def exposed_ring_seconds(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster,
                         cross: Dict[str, bool], layers: int, parts: Dict[str, float],
                         indices: Optional[Sequence[int]] = None) -> float:
    """The ring hops' time that one block of attention each cannot hide (the docstring), and the
    masked layers' K/V all-gather and dK/dV reduce-scatter over cp, exposed whole (`indices`: the
    layers' places in the model, default the first `layers`)."""
    C, e, T = layout.cp, DTYPE_BYTES[opts.dtype], layout.tp
    S = batch.sequence_len
    masked = [i for i in (range(layers) if indices is None else indices) if model.masked(i, S)]
    gather_s = 0.0
    if masked and C > 1:       # window_attention.py: the whole sequence's K/V, before attention can start
        full = 2 * batch.micro(layout) * (model.num_key_value_heads // T) * S * model.head_dim * e
        again = sum(recomputes(opts, i) for i in masked)
        gather_s = batch.micro_steps(layout) * (
            (len(masked) + again) * collective_seconds("all_gather", C, full, cross["cp"], cluster)
            + len(masked) * collective_seconds("reduce_scatter", C, full, cross["cp"], cluster))
        layers -= len(masked)
    R = layout.cp // layout.ulysses_size()
    if R == 1 or layers == 0:
        return gather_s
    crosses = cross["cp" if layout.cp_impl == "ring" else "cp_ring"]
    s = batch.sequence_len // layout.cp
    kv = 2 * batch.micro(layout) * kv_repeat(model, layout) * (model.num_key_value_heads // T) * s \
        * model.head_dim
    hop_f = collective_seconds("send_recv", R, kv * e, crosses, cluster)
    hop_b = hop_f + collective_seconds("send_recv", R, kv * 4, crosses, cluster)
    block = parts["layer_attention_s"] / R
    forwards = layers + recomputed_layers(model, opts, layers)     # recomputed layers hop again
    if opts.cp_all_gather_kv:            # the Llama 3 paper's CP: gather K/V, then attend; exposed
        ag = collective_seconds("all_gather", R, R * kv * e, crosses, cluster)
        rs = collective_seconds("reduce_scatter", R, R * kv * e, crosses, cluster)
        return gather_s + batch.micro_steps(layout) * (forwards * ag + layers * rs)
    return gather_s + batch.micro_steps(layout) * (R - 1) * (forwards * max(0.0, hop_f - block)
                                                            + layers * max(0.0, hop_b - 2 * block))


def exposed_dp_seconds(groups: Dict[str, dict], layout: Layout, opts: Options, cluster,
                       parts: Dict[str, float], layer_units: List[Unit], micro_steps: int,
                       reducing: int, other_units: List[Unit] = ()) -> float:
    """The data-parallel time that the layers' compute cannot hide (the docstring). `groups` carry
    each group's ledger seconds; `reducing` is how many micro-batches reduce gradients;
    `other_units` (the root, the embedding) are priced once each under gather_once_per_step."""
    total = sum(groups[k]["seconds"] for k in DP_GROUPS if k in groups)
    L = len(layer_units)
    if opts.prefetch <= 0 or L == 0:
        return total
    f, b = parts["layer_forward_s"], parts["layer_backward_s"]
    if not layout.sharded:
        ddp = groups.get("dp_cp")
        if not ddp:
            return 0.0
        calls = sum(o["calls"] for o in ddp["ops"].values())
        if not opts.distributed_optimizer:
            return max(0.0, ddp["seconds"] - L * b) + ddp["seconds"] / calls
        grads = ddp["ops"].get("all_reduce", dict(bytes=0))["bytes"]        # the fp32 buckets
        args = (ddp["size"], grads, ddp["crosses_nodes"], cluster, calls)
        rs = collective_seconds("reduce_scatter", *args)
        ag = collective_seconds("all_gather", ddp["size"], grads * DTYPE_BYTES[opts.dtype] / 4, *args[2:])
        return max(0.0, rs - L * b) + rs / calls + max(0.0, ag - L * f) + ag / calls
    N, R = layout.dp_shard * layout.cp, layout.dp_replicate
    shard = groups.get("dp_shard_cp", dict(crosses_nodes=False))
    rep = groups.get("dp_replicate", dict(crosses_nodes=False))
    unit = _padded(max(u.numel for u in layer_units), N)
    g = collective_seconds("all_gather", N, unit * DTYPE_BYTES[opts.dtype], shard["crosses_nodes"], cluster)
    r = collective_seconds("reduce_scatter", N, unit * 4, shard["crosses_nodes"], cluster) \
        + collective_seconds("all_reduce", R, unit // N * 4, rep["crosses_nodes"], cluster)
    again = g if opts.reshard_after_forward else 0.0
    M = micro_steps
    rest = max(0.0, total - M * L * (g + again) - reducing * L * r)     # the root and the embedding
    if opts.gather_once_per_step:     # each unit gathered once a step and kept to its last backward
        M, again, reducing = 1, 0.0, 1
        rest = sum(collective_seconds("all_gather", N, _padded(u.numel, N) * DTYPE_BYTES[opts.dtype],
                                      shard["crosses_nodes"], cluster)
                   + collective_seconds("reduce_scatter", N, _padded(u.numel, N) * 4, shard["crosses_nodes"],
                                        cluster) for u in other_units if u.numel)
    layers = M * (g + (L - 1) * max(0.0, g - f)) + (M - reducing) * L * max(0.0, again - b) \
        + reducing * L * max(0.0, again + r - b)
    return layers + rest


def step_seconds(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster,
                 groups: Dict[str, dict], cross: Dict[str, bool], parts: Dict[str, float],
                 layer_units: List[Unit], layers: int, reducing: int,
                 other_units: List[Unit] = (), indices: Optional[Sequence[int]] = None) -> Dict[str, float]:
    """One rank's step: compute + tp + all-to-all + the exposed ring hops, masked layers' K/V
    gathers and dp traffic."""
    tp = groups.get("tp", {}).get("seconds", 0.0)
    tp_exposed = max(0.0, tp - parts["gemm_s"]) if opts.tp_comm_overlap else tp
    a2a = groups.get("cp_ulysses", {}).get("seconds", 0.0)
    ring = sum(groups.get(k, {}).get("seconds", 0.0) for k in ("cp", "cp_ring"))
    dp = sum(groups.get(k, {}).get("seconds", 0.0) for k in DP_GROUPS)
    ring_exposed = exposed_ring_seconds(model, layout, batch, opts, cluster, cross, layers, parts, indices)
    dp_exposed = exposed_dp_seconds(groups, layout, opts, cluster, parts, layer_units,
                                    batch.micro_steps(layout), reducing, other_units)
    return dict(tp_s=tp, tp_exposed_s=tp_exposed, all_to_all_s=a2a, cp_s=ring, dp_s=dp,
                cp_exposed_s=ring_exposed, dp_exposed_s=dp_exposed,
                work_s=parts["compute_s"] + tp_exposed + a2a + ring_exposed + dp_exposed)
