"""The planner under pipeline parallelism: what each STAGE of a pp x Layout(dp_replicate, dp_shard, cp,
tp) costs.

With pp > 1 every rank holds one stage (pipeline_parallel/stage.py's split_layers rule, imported):
a contiguous run of layers per model chunk (v chunks per rank under interleaving), the embedding
on the first stage, the final norm + lm_head + loss on the last. Inside a stage the layout is the
4D one of model.py, so the answer is per stage (pipeline_stage.py: its memory, activations in
flight and ledger), and the worst stage is what must fit.

Time: the stage with the most work sets the pace, and the schedule adds the bubble
    step = (compute + tp + all-to-all + exposed cp/dp of the slowest stage) / (1 - bubble) + sends
           (+ rl: dpo's reference forwards, the micro-batches pipelined: M + p - 1 stage forwards,
           and under its frozen copy that copy's stage in each stage's memory: reference_cost.py)
    bubble = (p - 1) / (m + p - 1)  (afab, 1f1b)     (p - 1) / (v m + p - 1)  (interleaved)
             (p - 1) / (3 m + p - 1)  (zb_h1)        (p - 1) / (6 m + p - 1)  (zbv, m >= 2p - 1)
             (simulate.theory_bubble: t_F = t_B (= t_W), the split backward's B and W even;
             with pipeline_overlap_steps the next step's fill overlaps this one's drain, which
             leaves zbv max(0, 4p - 2 - 2m) / (6m + ...): none once m >= 2p - 1)
    sends  = 2 (m v + p - 1) x bytes(h) / bandwidth of pp: the messages on the critical path
             (the fill and drain's p - 1 hops, and each micro-batch chunk's hop in and out)
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

from minipar.pipeline_parallel.schedules import check_schedule, forward_window
from minipar.pipeline_parallel.simulate import forward_span, theory_bubble

from . import activation_bytes as pa
from . import collective_counts as pc
from . import feasible, peak
from . import model as pm
from . import time_model as tm
from .estimate import crosses_nodes, distributed_optimizer_memory, group_seconds, mfu
from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options
from .long_step import plan_stage
from .overlap import step_seconds
from .pipeline_stage import Pipeline, message_bytes
from .reference_cost import reference_cost, with_reference
from .stage_units import stage_units, stages


def check(model: ModelShape, layout: Layout, pipe: Pipeline, batch: Batch) -> List[str]:
    """The trainer's pipeline checks (schedule, split), as messages."""
    try:
        check_schedule(pipe.schedule, pipe.pp, batch.micro_steps(layout), pipe.virtual_stages)
        stages(model, pipe)
    except ValueError as err:
        return [str(err)]
    return []


def bubble(pipe: Pipeline, m: int) -> float:
    return theory_bubble(pipe.schedule, pipe.pp, m, pipe.virtual_stages, steady=pipe.overlap_steps)


def critical_sends(pipe: Pipeline, m: int) -> int:
    """Messages on the critical path: each micro-batch chunk's hop in and out, plus the fill and
    drain's p - 1 hops each way."""
    return 2 * (m * pipe.virtual_stages + pipe.pp - 1)


def plan_pipeline(model: ModelShape, layout: Layout, pipe: Pipeline, batch: Batch, opts: Options,
                  cluster) -> dict:
    """estimate.plan's answer for pp x layout: one entry per stage under "stages", and the worst
    stage's (the most memory) at the top level, so that what prints for 4D prints for it too."""
    problems = feasible.check(model, layout, batch) + check(model, layout, pipe, batch)
    if problems:
        raise ValueError(f"layout {pipe} x {layout} cannot run this model and batch: " + "; ".join(problems))
    W, g, e = layout.world, cluster.gpus_per_node, DTYPE_BYTES[opts.dtype]
    world, M = W * pipe.pp, batch.micro_steps(layout)
    cross = crosses_nodes(layout, g)
    cross["pp"] = any(len({(w + k * W) // g for k in range(pipe.pp)}) > 1 for w in range(W))
    cross["world"] = world > g                            # pipeline_overlap_steps' background sums
    cross["pp_ends"] = cross["pp"]                        # a tied embedding's sum: first and last stage
    sizes = dict(layout.sizes(), pp=pipe.pp, world=world, pp_ends=2)
    tokens = batch.global_batch_size * batch.sequence_len
    fl = pm.flops(model, layout, batch, opts)
    budget = cluster.gpu_memory_bytes * (1 - cluster.reserve)
    per_micro = pa.activations(model, layout, batch, opts)      # one micro-batch's, per layer
    out = []
    for st in stages(model, pipe):
        p = plan_stage(model, layout, pipe, st, batch, opts)
        groups: Dict[str, dict] = {}
        for (op, group), (calls, nbytes) in sorted(p.pop("collectives").items()):
            gr = groups.setdefault(group, dict(size=sizes[group], crosses_nodes=cross[group], ops={},
                                               wire_bytes=0.0))
            wire = nbytes if op == "send" else pc.wire_bytes(op, sizes[group], nbytes)   # p2p: as is
            gr["ops"][op] = dict(calls=calls, bytes=nbytes, wire_bytes=wire)
            gr["wire_bytes"] += wire
        group_seconds(groups, cluster)
        indices = [i for c in st.chunks for i in c]          # the stage's layers (masked ones priced apart)
        parts = tm.compute_seconds(model, layout, batch, opts, cluster, st.num_layers, st.last,
                                   p["memory"]["param_elements"], indices)
        if p["memory"]["kept"]:            # post-validation copies the state each step (read + write);
            extra = 2 * p["memory"]["kept"] / (cluster.hbm_gbps * 1e9)    # its redone steps are not counted
            parts["optimizer_s"] += extra
            parts["compute_s"] += extra
        # compose.py reduces once per step (no_sync until the rank's last backward), and every
        # micro-batch regathers the stage's layers: overlap.py's per-layer sum over the stage
        us = stage_units(model, layout, st)
        t = step_seconds(model, layout, batch, opts, cluster, groups, cross, parts,
                         [u for u in us if u.kind == "layer"], st.num_layers, 1,
                         [u for u in us if u.kind != "layer"], indices)
        mem, acts = distributed_optimizer_memory(p["memory"], layout, opts), p["activations"]
        mem = with_reference(mem, layout, opts)      # rl: dpo's frozen copy of this stage
        if opts.gather_once_per_step and layout.sharded:      # every unit of the stage stays gathered
            N = layout.dp_shard * layout.cp
            mem["gathered"] = max(mem["gathered"], sum(pm._padded(u.numel, N) * e for u in us))
        # the peak: the largest of the stage's own phases (peak.py), each with the activations its
        # schedule keeps in flight at their worst
        first_back = next((c[-1] for c in reversed(st.chunks) if c), 0)     # its first layer of backward
        holds = peak.Holds(us, acts["as_configured"], acts["after_backward"], first_back, st.last)
        # tied with the ends apart, each end is an untied one's: an embedding unit on the first, an
        # lm_head whose gradient nothing adds to on the last (its copy of E: tied_ends.py)
        ends = model if st.first and st.last else dataclasses.replace(model, tie_word_embeddings=False)
        by_phase = peak.phases(ends, layout, batch, opts, mem, per_micro, holds)
        total = max(by_phase.values())
        p.update(memory=dict(mem, activations=acts, phases=by_phase,
                             peak_phase=max(by_phase, key=by_phase.get), total=total, budget=budget,
                             fits=total <= budget),
                 comm=groups, time=dict(parts, **t))
        out.append(p)
    bub = bubble(pipe, M)
    bw = (cluster.inter_gbps if cross["pp"] else cluster.intra_gbps) * 1e9
    pp_s = critical_sends(pipe, M) * message_bytes(model, layout, batch, opts) / bw \
        + tm.latency_seconds("send", pipe.pp, critical_sends(pipe, M), cross["pp"], cluster)
    slowest = max(out, key=lambda p: p["time"]["work_s"])
    # rl: dpo's reference forwards go down the pipeline together (reference_cost.py): n items of
    # one_s whole-model seconds (the slowest stage's layer times) take forward_span stage forwards
    # of one_s / p each, and the forward half of the critical sends
    hop_s = message_bytes(model, layout, batch, opts) / bw \
        + tm.latency_seconds("send", pipe.pp, 1, cross["pp"], cluster)

    def pipelined(one_s: float, n: int) -> float:
        span = forward_span(pipe.schedule, pipe.pp, n, pipe.virtual_stages)
        return one_s / pipe.pp * span + (n * pipe.virtual_stages + pipe.pp - 1) * hop_s
    ep_s = sum(p["comm"].get("ep", {}).get("seconds", 0.0) for p in out)     # every stage's MoE layers
    first = stage_units(model, layout, stages(model, pipe)[0])               # gathers: the first stage's
    ref = reference_cost(model, layout, batch, opts, cluster, slowest["time"], {"ep": dict(seconds=ep_s)},
                         first, pipelined, forward_window(pipe.pp))
    step = slowest["time"]["work_s"] / (1 - bub) + pp_s + ref.get("reference_s", 0.0)
    worst = max(out, key=lambda p: p["memory"]["total"])
    t = dict(slowest["time"], **ref, step_s=step, bubble=bub, pp_s=pp_s, slowest_stage=slowest["rank"],
             tokens_per_s=tokens / step, model_flops=fl["model"], **mfu(fl, step, world, cluster))
    return dict(layout=dict(dataclasses.asdict(layout), pp=pipe.pp), pipeline=dataclasses.asdict(pipe),
                layout_str=f"{pipe} x {layout}", world=world, nodes=-(-world // g), micro_steps=M,
                batch=dataclasses.asdict(batch), micro_batch=batch.micro(layout),
                options=dataclasses.asdict(opts), params=model.num_params(), worst_stage=worst["rank"],
                memory=worst["memory"], comm=worst["comm"], time=t, stages=out,
                fits=all(p["memory"]["fits"] for p in out))
