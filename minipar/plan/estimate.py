"""From the counts of model.py to a plan: which groups cross nodes, step time, MFU.

Placement. Ranks sit on the grid of mesh.py, tp fastest (global_rank = ((r S + s) C + c) T + t),
and node k holds ranks [k g, (k+1) g) for g GPUs per node. A group crosses nodes when its members
lie on more than one node; its collectives then run at the inter-node bandwidth. USP's two parts of
cp (mesh.py) are two more axes: cp rank c = i u + j, cp_ulysses the u ranks j (consecutive, so
u T global ranks apart at most: inside a node when u T <= g and the grid aligns), cp_ring the C / u
ranks i. The grid is (R, S, C / u, u, T) and AXES names each group's axes of it.

The time model (stated, and the same for every layout so that the ranking is fair):

    compute     time_model.py, by operation: GEMMs on a roofline (--efficiency of peak for large
                ones, HBM-bound when a per-rank slice is thin), attention at --attention-efficiency,
                norms / RoPE / SwiGLU / residuals / the loss and the optimizer step at --hbm-bandwidth
    collective  wire bytes / bandwidth + calls x hops x latency (time_model.collective_seconds),
                every group's ledger bytes (group_seconds: the `est. s` column of the report)
    overlap     overlap.py, per layer: a ZeRO-3 gather hides behind one layer's compute, a ring hop
                behind one block of attention, DDP's buckets behind the last backward; TP
                collectives and Ulysses' all-to-alls are exposed whole
    step        compute + tp + all-to-all + exposed ring hops + exposed dp traffic
    MFU         model FLOPs / (step x world x peak), in two conventions: `mfu` counts causal
                attention as half the score matrix (the FLOPs a causal kernel does: 6 L H D s per
                token), `mfu_full_attention` counts it whole (12 L H D s, as torchtitan and
                Megatron-LM report), which reads higher for the same step

    bandwidth   intra-node (NVLink) for a group inside one node, inter-node (IB, per GPU) otherwise
    defaults    Cluster below: each field is a flag of python -m minipar.plan, with its source
Kernel launch gaps and the host are not modelled.

Fits: the peak, the largest of what is alive at each phase of the step (peak.py: the loss's
forward, the head's backward, a layer's, the end of backward, the optimizer step), must stay under
`gpu_memory` x (1 - reserve); reserve (default 0.1) stands for the CUDA context, NCCL buffers and
allocator fragmentation.

The search over layouts, and its rules, are layout_search.py's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict

import numpy as np

from . import activation_bytes as pa
from . import collective_counts as pc
from . import feasible, peak
from . import inputs as inputs_mod
from . import model as pm
from . import time_model as tm
from .inputs import Batch, Layout, ModelShape, Options
from .moe import crosses_nodes as moe_crosses_nodes
from .moe import exposed_seconds, matmul_seconds, summary
from .overlap import step_seconds
from .reference_cost import reference_cost, with_reference

# the axes of the grid (R, S, C / u, u, T) that each group spans
AXES = {"tp": (4,), "cp": (2, 3), "cp_ulysses": (3,), "cp_ring": (2,), "dp_shard_cp": (1, 2, 3),
        "dp_replicate": (0,), "dp_cp": (0, 1, 2, 3)}


@dataclass(frozen=True)
class Cluster:
    """The hardware and the time model's constants: each a flag of python -m minipar.plan. The
    defaults are an H100 SXM 80 GB node of 8 with one 400 Gb/s NIC per GPU; benchmarks/
    plan_vs_published.py holds them against published runs (docs/planner.md)."""
    gpus_per_node: int = 8
    gpu_memory_bytes: float = 80 * 2 ** 30   # --gpu-memory 80GiB (a bare number is GiB, as torch reports)
    peak_tflops: float = 989.0     # dense bf16, NVIDIA's H100 SXM data sheet (1,979 is with sparsity)
    intra_gbps: float = 450.0      # NVLink 4: 900 GB/s both directions a GPU, 450 one way
    inter_gbps: float = 50.0       # one ConnectX-7 400 Gb/s NIC per GPU
    efficiency: float = 0.7        # of peak, large GEMMs (cuBLAS bf16 on H100 at these shapes: 0.6-0.8)
    reserve: float = 0.1           # CUDA context, NCCL buffers, allocator fragmentation
    hbm_gbps: float = 3350.0       # H100 SXM HBM3, NVIDIA's data sheet
    attention_efficiency: float = 0.5   # FlashAttention-2 about 1/3 of H100 peak, FlashAttention-3 1/2-3/4
    intra_latency_us: float = 1.0  # per hop over NVLink, the order of nccl-tests' small-message times
    inter_latency_us: float = 5.0  # per hop over InfiniBand, likewise


def distributed_optimizer_memory(mem: dict, layout: Layout, opts: Options) -> dict:
    """Megatron-LM's distributed optimizer (Options.distributed_optimizer, on a layout without
    ZeRO-3): the parameters in the compute dtype and the fp32 main gradients whole on every rank, the
    fp32 master copy (under bf16) and AdamW's two moments sharded over the dp ranks
    (megatron/core/optimizer/distrib_optimizer.py in Megatron-LM); `mem` as model.memory gives it."""
    dp = layout.sizes()["dp_cp"]
    if not opts.distributed_optimizer or layout.sharded or dp == 1 or opts.lora_r:
        return mem
    n, e = mem["param_elements"], inputs_mod.DTYPE_BYTES[opts.dtype]
    params, grads, optimizer = e * n, 4 * n, ((4 if e == 2 else 0) + 8) * n // dp
    return dict(mem, params=params, grads=grads, optimizer=optimizer, persistent=params + grads + optimizer)


def group_seconds(groups: Dict[str, dict], cluster: Cluster) -> Dict[str, float]:
    """Each group's collectives: wire bytes at its placement's bandwidth + hops x latency per call."""
    out = {}
    for name, g in groups.items():
        out[name] = g["seconds"] = sum(tm.collective_seconds(op, g["size"], o["bytes"], g["crosses_nodes"],
                                                             cluster, o["calls"])
                                       for op, o in g["ops"].items())
    return out


def mfu(fl: dict, step: float, world: int, cluster: Cluster) -> dict:
    """Both MFU conventions of models/flops.py (the docstring above), for one step's time."""
    peak = cluster.peak_tflops * 1e12
    return dict(mfu=fl["model"] / (step * world * peak),
                mfu_full_attention=fl["model_full_attention"] / (step * world * peak))


def crosses_nodes(layout: Layout, gpus_per_node: int) -> Dict[str, bool]:
    u = layout.ulysses_size()
    shape = (layout.dp_replicate, layout.dp_shard, layout.cp // u, u, layout.tp)
    node = (np.arange(layout.world) // gpus_per_node).reshape(shape)
    out = {}
    for group, axes in AXES.items():
        rest = [a for a in range(len(shape)) if a not in axes]
        members = node.transpose(rest + list(axes)).reshape(-1, int(np.prod([shape[a] for a in axes])))
        out[group] = bool((members.min(axis=1) != members.max(axis=1)).any())
    return out


def plan(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster: Cluster) -> dict:
    """Everything the planner knows about one layout, as plain values (what --json prints)."""
    problems = feasible.check(model, layout, batch)
    if problems:
        raise ValueError(f"layout {layout} cannot run this model and batch: " + "; ".join(problems))
    mem = distributed_optimizer_memory(pm.memory(model, layout, opts), layout, opts)
    mem = with_reference(mem, layout, opts)      # rl: dpo's frozen copy (reference_cost.py)
    if opts.gather_once_per_step and layout.sharded:          # every unit stays gathered (overlap.py)
        N = layout.dp_shard * layout.cp
        mem["gathered"] = max(mem["gathered"], sum(pm._padded(u.numel, N) * inputs_mod.DTYPE_BYTES[opts.dtype]
                                                   for u in pm.units(model, layout)))
    act = pa.activations(model, layout, batch, opts)
    coll = pc.collectives(model, layout, batch, opts)
    fl = pm.flops(model, layout, batch, opts)
    g = cluster.gpus_per_node
    cross = {**crosses_nodes(layout, g), **moe_crosses_nodes(layout, g)}     # + ep, edp
    sizes = layout.sizes()
    groups: Dict[str, dict] = {}
    for (op, group), (calls, nbytes) in sorted(coll.items()):
        g = groups.setdefault(group, dict(size=sizes[group], crosses_nodes=cross[group], ops={},
                                          wire_bytes=0.0))
        wire = pc.wire_bytes(op, sizes[group], nbytes)
        g["ops"][op] = dict(calls=calls, bytes=nbytes, wire_bytes=wire)
        g["wire_bytes"] += wire
    group_seconds(groups, cluster)
    parts = tm.compute_seconds(model, layout, batch, opts, cluster, model.num_hidden_layers, True,
                               mem["param_elements"])
    us = pm.units(model, layout)
    reducing = batch.micro_steps(layout) if opts.sync_each_batch else 1
    t = step_seconds(model, layout, batch, opts, cluster, groups, cross, parts,
                     [u for u in us if u.kind == "layer"], model.num_hidden_layers, reducing,
                     [u for u in us if u.kind != "layer"])
    step = t.pop("work_s")
    if model.is_moe:                 # the token exchanges wait for nothing to hide behind (moe.py)
        t["moe_s"] = exposed_seconds(groups)
        gemm = lambda m, k, n: tm.gemm_seconds(m, k, n, inputs_mod.DTYPE_BYTES[opts.dtype], cluster)
        again = pa.recompute_shares(model, opts)[0]
        t["moe_matmul_s"] = matmul_seconds(model, layout, batch, opts, gemm, again)
        step += t["moe_s"] + t["moe_matmul_s"]
    ref = reference_cost(model, layout, batch, opts, cluster, parts, groups)   # rl: dpo (reference_cost.py)
    t.update(ref)
    step += ref.get("reference_s", 0.0)
    by_phase = peak.phases(model, layout, batch, opts, mem, act)
    total = max(by_phase.values())
    budget = cluster.gpu_memory_bytes * (1 - cluster.reserve)
    tokens = batch.global_batch_size * batch.sequence_len
    return dict(
        layout=dataclasses.asdict(layout), layout_str=str(layout), world=layout.world,
        nodes=-(-layout.world // cluster.gpus_per_node), micro_steps=batch.micro_steps(layout),
        batch=dataclasses.asdict(batch), micro_batch=batch.micro(layout), options=dataclasses.asdict(opts),
        params=fl["params"], moe=summary(model, layout) if model.is_moe else None,
        memory=dict(mem, activations=act, phases=by_phase, peak_phase=max(by_phase, key=by_phase.get),
                    total=total, budget=budget, fits=total <= budget),
        comm=groups,
        time=dict(parts, **t, step_s=step, tokens_per_s=tokens / step,
                  **mfu(fl, step, layout.world, cluster),
                  model_flops=fl["model"]))

