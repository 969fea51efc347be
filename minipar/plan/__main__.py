"""python -m minipar.plan: memory, bytes and time per rank of a layout, before renting the cluster.

    python -m minipar.plan configs/fsdp.yaml                       the config's model, layout, batch
    python -m minipar.plan --model configs/models/llama-3.1-8b.json --world 16 --tp 8 --sp
    python -m minipar.plan --model configs/models/llama-3.1-70b.json --world 1024 --search
    python -m minipar.plan configs/5d.yaml                         pipeline: one line per stage,
                                                                   the worst in full
    ... --json                                                     the same, as JSON for scripts

The counts are minipar's own code paths (minipar/plan/model.py; per pipeline stage
minipar/plan/pipeline.py), held exactly against real runs by
tests/test_plan.py; the time is a stated model (minipar/plan/estimate.py), not a measurement.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from minipar.cli import fail, positive_ints
from minipar.training.config.train_config import load_config
from minipar.training.pipeline_step import virtual_stages
from models.hf_checkpoint import read_hf_config

from .estimate import Cluster, plan
from .inputs import Batch, Layout, ModelShape, Options
from .layout_search import search, smallest_world
from .pipeline import plan_pipeline
from .pipeline_stage import Pipeline

GB = 1e9
# the flags that count something: 0 or less is refused by name (minipar/cli.py)
SIZE_FLAGS = dict(world="the number of GPUs", gpus_per_node="GPUs per node", dp_replicate="replicas",
                  dp_shard="ZeRO-3 shards", cp="context-parallel ranks", tp="tensor-parallel ranks",
                  pp="pipeline stages", virtual_stages="model chunks per rank", seq_len="tokens per sequence",
                  global_batch_size="sequences per step", micro_batch_size="rows per forward",
                  top="layouts shown")


def _pipeline(args, base: dict) -> Pipeline:
    """The pipeline of the config and/or the flags (pp 1: none)."""
    pp = args.pp or base.get("pp", 1)
    schedule = args.pipeline_schedule or base.get("pipeline_schedule", "1f1b")
    v = args.virtual_stages \
        or (base.get("virtual_stages") if schedule == base.get("pipeline_schedule") else None) \
        or (2 if schedule == "interleaved_1f1b" else 1)
    layers = base.get("pipeline_layers")
    return Pipeline(pp, schedule, v, tuple(layers) if layers else None)


def _layout(args, base: dict, world: int) -> Layout:
    sizes = dict(base)
    pp = _pipeline(args, base).pp
    if world % pp:
        raise ValueError(f"pp {pp} does not divide --world {world}")
    world //= pp                            # the 4D grid of one stage
    for key, flag in (("dp_replicate", args.dp_replicate), ("dp_shard", args.dp_shard), ("cp", args.cp),
                      ("tp", args.tp)):
        if flag is not None:
            sizes[key] = flag
    if args.sequence_parallel is not None:
        sizes["sequence_parallel"] = args.sequence_parallel
    others = sizes.get("dp_replicate", 1) * sizes.get("cp", 1) * sizes.get("tp", 1)
    if sizes.get("dp_shard") is None:       # the remainder of the world, as the trainer does
        if world % others:
            raise ValueError(f"dp_replicate x cp x tp = {others} does not divide --world {world}")
        sizes["dp_shard"] = world // others
    lay = Layout(sizes.get("dp_replicate", 1), sizes["dp_shard"], sizes.get("cp", 1), sizes.get("tp", 1),
                 bool(sizes.get("sequence_parallel", False)))
    if lay.world != world:
        raise ValueError(f"the sizes ({lay}) multiply to {lay.world * pp}, not --world {world * pp}: "
                         f"change a size "
                         f"or --world, or leave --dp-shard unset to take the remainder")
    return lay


def from_train_config(cfg):
    """(model, layout sizes, batch, options) of a TrainConfig (what train.py would run)."""
    model = ModelShape.from_dict(dataclasses.asdict(cfg.model))
    sizes = dict(dp_replicate=cfg.dp_replicate_size, dp_shard=cfg.dp_shard_size, cp=cfg.context_parallel_size,
                 tp=cfg.tensor_parallel_size, sequence_parallel=cfg.sequence_parallel)
    if (getattr(cfg, "pipeline_parallel_size", 1) or 1) > 1:          # minipar/plan/pipeline.py
        sizes.update(pp=cfg.pipeline_parallel_size, pipeline_schedule=cfg.pipeline_schedule,
                     virtual_stages=virtual_stages(cfg), pipeline_layers=cfg.pipeline_layers)
    batch = Batch(cfg.global_batch_size, cfg.micro_batch_size, cfg.sequence_len)
    opts = Options(dtype=cfg.dtype, prefetch=cfg.fsdp.prefetch,
                   reshard_after_forward=cfg.fsdp.reshard_after_forward,
                   sync_each_batch=cfg.fsdp.sync_each_batch,
                   gradient_checkpointing=cfg.gradient_checkpointing, max_grad_norm=bool(cfg.max_grad_norm))
    return model, sizes, batch, opts


def load(args):
    """(model, layout sizes, batch, options, default world) from a config YAML and/or --model."""
    base, world = {}, None
    model = batch = None
    opts = Options()
    if args.config:
        cfg = load_config(args.config)
        model, base, batch, opts = from_train_config(cfg)
        world = (cfg.dp_replicate_size * (cfg.dp_shard_size or 1) * cfg.context_parallel_size
                 * cfg.tensor_parallel_size * (cfg.pipeline_parallel_size or 1))
    if args.model:                          # train.py's base_model check: a Llama decoder, valid JSON
        model = ModelShape.from_dict(read_hf_config(args.model, f"--model {args.model}"))
        if not args.config:
            opts = Options(dtype="bfloat16")
    if model is None:
        raise ValueError("give a config YAML (python -m minipar.plan configs/fsdp.yaml) or --model "
                         "config.json")
    world = args.world or world or 1
    seq = args.seq_len or (batch.sequence_len if batch else 8192)
    gbs = args.global_batch_size or (batch.global_batch_size if batch else world)
    mbs = args.micro_batch_size or (batch.micro_batch_size if batch else 1)
    batch = Batch(gbs, mbs, seq)
    flags = dict(dtype=args.dtype, prefetch=args.prefetch, sync_each_batch=args.sync_each_batch,
                 gradient_checkpointing=args.gradient_checkpointing)
    changes = {k: v for k, v in flags.items() if v is not None}
    return model, base, batch, dataclasses.replace(opts, **changes), world


def _unit(largest: float):
    """(name, bytes) of the decimal unit that shows `largest` with a few digits before the point."""
    for name, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if largest >= size:
            return name, size
    return "B", 1.0


def describe(p: dict, model: ModelShape) -> str:
    m, t, o = p["memory"], p["time"], p["options"]
    a = m["activations"]
    lines = [f"model: {p['params'] / 1e9:.3f} B parameters ({model.num_hidden_layers} layers, hidden "
             f"{model.hidden_size}, {model.num_attention_heads}/{model.num_key_value_heads} heads, "
             f"vocab {model.vocab_size})",
             f"layout: {p['layout_str']} on {p['world']} GPUs ({p['nodes']} node(s))",
             f"batch: {p['batch']['global_batch_size']} x {p['batch']['sequence_len']} tokens per step, "
             f"micro-batch {p['micro_batch']} row(s) x {p['micro_steps']} step(s) per dp rank; {o['dtype']}, "
             f"prefetch {o['prefetch']}, activation checkpointing "
             f"{'on' if o['gradient_checkpointing'] else 'off'}",
             ""]
    unit, size = _unit(m["total"])
    lines.append(f"memory per rank ({unit})")
    sharded = p["layout"]["dp_shard"] * p["layout"]["cp"] > 1        # ZeRO-3 over dp_shard_cp
    gathered = f"gathered units ({o['dtype']}: root + {1 + o['prefetch']} units)" \
        if sharded else "gathered units (no ZeRO-3)"
    rows = [("parameters (fp32 masters" + (", 1/N shards)" if sharded else ")"), m["params"]),
            ("gradients (fp32)", m["grads"]), ("optimizer (AdamW m, v fp32 + step)", m["optimizer"]),
            ("= persistent", m["persistent"]), (gathered, m["gathered"]),
            ("accumulated grads (no_sync: fp32, unsharded)", m["accumulated_grads"]),
            ("activations, no checkpointing", a["full"]),
            ("activations, checkpointing (kept / peak)", None),
            ("transient (logits, gradients in flight)", m["transient"]),
            ("= total (as chosen)", m["total"])]
    for label, v in rows:
        if v is None:
            kept, peak = a["checkpointed"] / size, a["checkpointed_peak"] / size
            lines.append(f"  {label:<44}{kept:10.3f} / {peak:.3f}")
        else:
            lines.append(f"  {label:<44}{v / size:10.3f}")
    lines.append(f"  {'budget (GPU memory less the reserve)':<44}{m['budget'] / size:10.3f}   "
                 + ("fits" if m["fits"] else "DOES NOT FIT"))
    unit, size = _unit(max([c["bytes"] for g in p["comm"].values() for c in g["ops"].values()] or [0]))
    lines += ["", "communication per step per rank (buffer: the bytes comm.py's ledger records; "
              "wire: what the rank sends)",
              f"  {'group':<13}{'size':>5}  {'crosses nodes':<14}{'op':<16}{'calls':>7}{'buffer ' + unit:>12}"
              f"{'wire ' + unit:>10}{'est. s':>10}"]
    for group, g in p["comm"].items():
        for i, (op, c) in enumerate(g["ops"].items()):
            head = f"  {group:<13}{g['size']:>5}  {('yes' if g['crosses_nodes'] else 'no'):<14}" if i == 0 \
                else " " * 36
            sec = f"{g['seconds']:10.2e}" if i == 0 else ""
            nbytes, wire = c["bytes"] / size, c["wire_bytes"] / size
            lines.append(f"{head}{op:<16}{c['calls']:>7}{nbytes:12.3f}{wire:10.3f}{sec}")
    lines += ["", f"estimated step (the model of minipar/plan/estimate.py): {t['step_s']:.3g} s = compute "
              f"{t['compute_s']:.3g} + tp {t['tp_s']:.3g} + what cp ({t['cp_s']:.3g}) and dp "
              f"({t['dp_s']:.3g}) "
              f"do not hide; {t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f} %"]
    return "\n".join(lines)


def describe_pipeline(p: dict, model: ModelShape) -> str:
    """Each stage's line, then the worst stage (the most memory) in full, then the pipeline's time."""
    t = p["time"]
    unit, size = _unit(max(s["memory"]["total"] for s in p["stages"]))
    lines = [f"pipeline: {p['layout_str']} on {p['world']} GPUs; per stage ({unit} per rank; "
             f"activations = per micro-batch x in flight):",
             f"  {'stage':<7}{'layers':<18}{'persistent':>11}{'gathered':>10}{'activations':>12}"
             f"{'in flight':>10}"
             f"{'total':>10}{'sends':>7}"]
    chosen = "checkpointed_peak" if p["options"]["gradient_checkpointing"] else "full"
    for s in p["stages"]:
        m, a = s["memory"], s["activations"]
        layers = "+".join(f"{c[0]}-{c[-1]}" for c in s["layers"]) + (" +emb" if s["first"] else "") + \
            (" +head" if s["last"] else "")
        sends = s["comm"].get("pp", {}).get("ops", {}).get("send", {}).get("calls", 0)
        lines.append(f"  {s['rank']:<7}{layers:<18}{m['persistent'] / size:11.3f}{m['gathered'] / size:10.3f}"
                     f"{a[chosen] / size:12.3f}{a['in_flight']:10d}{m['total'] / size:10.3f}{sends:7d}")
    body = describe(p, model).split("\n")[:-1]        # the 4D step line does not apply
    body[1] = f"layout: {p['layout_str']} on {p['world']} GPUs ({p['nodes']} node(s)); the worst stage: " \
              f"{p['worst_stage']}, shown below"
    tail = [f"estimated step (minipar/plan/pipeline.py): {t['step_s']:.3g} s = the slowest stage's work "
            f"(stage {t['slowest_stage']}: {t['work_s']:.3g} s) / (1 - bubble {t['bubble']:.3f}) "
            f"+ the sends on the critical path {t['pp_s']:.3g} s; "
            f"{t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f} %"]
    return "\n".join(body + [""] + lines + ["", *tail])


def describe_search(s: dict, model: ModelShape, top: int = 10) -> str:
    lines = [f"{len(s['ranked'])} of {s['considered']} layouts fit; fastest first "
             f"(est. step s, MFU, GB per rank):"]
    for p in s["ranked"][:top]:
        ac = " +AC" if p["options"]["gradient_checkpointing"] else ""
        t = p["time"]
        lines.append(f"  {p['layout_str'] + ac:<66}{t['step_s']:8.3f} s {100 * t['mfu']:5.1f} %"
                     f"{p['memory']['total'] / GB:8.1f} GB")
    if len(s["ranked"]) > top:
        lines.append(f"  ... {len(s['ranked']) - top} more (--top)")
    rec = s["recommended"]
    if rec is None:
        need = s.get("smallest_world")
        where = f"the fewest that fit are {need} GPUs (--world {need})" if need else \
            "none fits up to 4096 GPUs"
        return "\n".join(lines + [f"no layout fits (the persistent state alone is 16 B x "
                                   f"{s['params'] / 1e9:.2f} B "
                                   f"parameters, over all GPUs); {where}, or use a shorter sequence"])
    rules = ", ".join(s["rules_applied"]) or "none"
    lines += ["", f"recommended (rules: {rules}; then the fastest; within 1 % "
              f"of it the most memory free):", ""]
    return "\n".join(lines) + "\n" + (describe_pipeline if "stages" in rec else describe)(rec, model)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minipar.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a train.py config YAML (model, layout, batch, dtype)")
    ap.add_argument("--model", help="a Hugging Face config.json (replaces the config's model)")
    ap.add_argument("--world", type=int, help="number of GPUs (default: the layout's product)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GB per GPU (default 80, H100)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--intra-bw", type=float, default=450.0, help="GB/s per GPU inside a node (NVLink)")
    ap.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per GPU between nodes (IB 400 Gb/s)")
    ap.add_argument("--efficiency", type=float, default=0.6, help="achieved fraction of peak on the matmuls")
    ap.add_argument("--reserve", type=float, default=0.1, help="fraction of GPU memory kept free")
    for size in ("dp-replicate", "dp-shard", "cp", "tp"):
        ap.add_argument(f"--{size}", type=int)
    ap.add_argument("--pp", type=int, help="pipeline stages (default: the config's; --search tries every pp)")
    ap.add_argument("--pipeline-schedule", choices=("afab", "1f1b", "interleaved_1f1b"))
    ap.add_argument("--virtual-stages", type=int, help="model chunks per rank (interleaved_1f1b; default 2)")
    ap.add_argument("--sp", "--sequence-parallel", dest="sequence_parallel", action="store_const", const=True)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--global-batch-size", type=int,
                    help="sequences per step (default with --model: --world)")
    ap.add_argument("--micro-batch-size", type=int,
                    help="rows per dp rank per forward (default with --model: 1)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--prefetch", type=int)
    ap.add_argument("--no-sync", dest="sync_each_batch", action="store_const", const=False,
                    help="ZeRO-3: accumulate unsharded gradients, one reduce-scatter per step")
    ap.add_argument("--gradient-checkpointing", action="store_const", const=True)
    ap.add_argument("--search", action="store_true",
                    help="rank every layout of --world that fits (pp included)")
    ap.add_argument("--no-pp", action="store_true",
                    help="with --search: layouts without pipeline parallelism only")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        positive_ints(args, SIZE_FLAGS)      # --world 0 is refused, not read as "not given"
        model, base, batch, opts, world = load(args)
        cluster = Cluster(args.gpus_per_node, args.gpu_memory, args.peak_tflops, args.intra_bw, args.inter_bw,
                          args.efficiency, args.reserve)
        pipe = _pipeline(args, base)
        if args.search and (args.pp or args.pipeline_schedule or args.virtual_stages):
            raise ValueError("--search ranks every pipeline size itself "
                             "(pp 1 and each pp that divides the world, 1F1B); "
                             "drop --pp/--pipeline-schedule/--virtual-stages, or drop --search to plan one "
                             "pipeline layout")
        if args.search:
            result = search(model, batch, opts, cluster, world, pipeline=not args.no_pp)
            if result["recommended"] is None:
                result["smallest_world"] = smallest_world(model, batch, opts, cluster, world)
            text = describe_search(result, model, args.top)
        elif pipe.pp > 1:
            result = plan_pipeline(model, _layout(args, base, world), pipe, batch, opts, cluster)
            text = describe_pipeline(result, model)
        else:
            result = plan(model, _layout(args, base, world), batch, opts, cluster)
            text = describe(result, model)
    except (ValueError, FileNotFoundError) as err:
        return fail(err)                     # one line, exit 2 (minipar/cli.py)
    print(json.dumps(result, indent=1) if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
