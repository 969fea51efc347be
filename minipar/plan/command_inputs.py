"""The planner command's inputs: a train.py config and/or flags (and a model file or directory) read
into what the cost model takes (inputs.py's ModelShape, Layout, Batch, Options; estimate.py's
Cluster; pipeline_stage.py's Pipeline). `python -m minipar.plan` (__main__.py) parses the flags and
calls `load` and `cluster`; every flag given replaces the config's value.

    load(args)      -> model, layout, batch, options, world     the config first, then the flags
    layout(...)     the sizes: flags over the config, dp_shard taking the rest of --world
    pipeline(...)   pp, the schedule and its virtual stages (pp 1: none)
    cluster(args)   --gpu's data sheet (minipar/gpus.py), each field replaced by its flag
"""
from __future__ import annotations

import dataclasses
import os
import sys

from minipar.cli import memory_bytes
from minipar.gpus import PRESETS
from minipar.trainer.prediction import from_train_config, read_train_config
from models.activation_checkpoint import check_option
from models.hf_checkpoint import read_hf_config
from models.hf_config import FAMILIES

from .estimate import Cluster
from .inputs import OTHER_TRAINER_FIELDS, Batch, Layout, ModelShape, Options
from .pipeline_stage import Pipeline


def pipeline(args, base: dict) -> Pipeline:
    """The pipeline of the config and/or the flags (pp 1: none)."""
    pp = args.pp or base.get("pp", 1)
    schedule = args.pipeline_schedule or base.get("pipeline_schedule", "1f1b")
    v = args.virtual_stages \
        or (base.get("virtual_stages") if schedule == base.get("pipeline_schedule") else None) \
        or (2 if schedule in ("interleaved_1f1b", "zbv") else 1)
    layers = base.get("pipeline_layers")
    overlap = bool(args.pipeline_overlap_steps or base.get("pipeline_overlap_steps"))
    clipping = args.max_grad_norm if args.max_grad_norm is not None else base.get("max_grad_norm", 1.0)
    return Pipeline(pp, schedule, v, tuple(layers) if layers else None, overlap, bool(overlap and clipping))


def layout(args, base: dict, world: int) -> Layout:
    sizes = dict(base)
    pp = pipeline(args, base).pp
    if world % pp:
        raise ValueError(f"pp {pp} does not divide --world {world}")
    world //= pp                            # the 4D grid of one stage
    for key, flag in (("dp_replicate", args.dp_replicate), ("dp_shard", args.dp_shard), ("cp", args.cp),
                      ("tp", args.tp), ("ep", args.ep)):
        if flag is not None:
            sizes[key] = flag
    if args.sequence_parallel is not None:
        sizes["sequence_parallel"] = args.sequence_parallel
    if args.cp_impl is not None and args.cp_impl != sizes.get("cp_impl"):   # the config's u was its impl's
        sizes.update(cp_impl=args.cp_impl, cp_ulysses_size=None)
    if args.cp_ulysses is not None:
        if sizes.get("cp_impl", "ring") == "ring":     # the trainer would ignore it: say so instead
            raise ValueError(f"--cp-ulysses {args.cp_ulysses} is USP's Ulysses group: give --cp-impl usp "
                             f"(or ulysses, where u is all of cp)")
        sizes["cp_ulysses_size"] = args.cp_ulysses
    others = sizes.get("dp_replicate", 1) * sizes.get("cp", 1) * sizes.get("tp", 1)
    if sizes.get("dp_shard") is None:       # the remainder of the world, as the trainer does
        if world % others:
            raise ValueError(f"dp_replicate x cp x tp = {others} does not divide --world {world}")
        sizes["dp_shard"] = world // others
    lay = Layout(sizes.get("dp_replicate", 1), sizes["dp_shard"], sizes.get("cp", 1), sizes.get("tp", 1),
                 bool(sizes.get("sequence_parallel", False)), sizes.get("cp_impl", "ring"),
                 sizes.get("cp_ulysses_size"), sizes.get("ep") or 1)
    if lay.world != world:
        raise ValueError(f"the sizes ({lay}) multiply to {lay.world * pp}, not --world {world * pp}: "
                         f"change a size "
                         f"or --world, or leave --dp-shard unset to take the remainder")
    return lay


def load(args):
    """(model, layout sizes, batch, options, default world) from a config YAML and/or --model."""
    base, world = {}, None
    model = batch = cfg = None
    opts = Options()
    if args.config:
        notes = []          # train.py's reading: the file, then its tokenizer's vocabulary
        cfg = read_train_config(args.config, notes=notes)
        for note in notes:
            if "vocab" in note or "tokenizer" in note:
                print(f"[minipar.plan] {note}", file=sys.stderr)
        model, base, batch, opts = from_train_config(cfg)
        world = (cfg.dp_replicate_size * (cfg.dp_shard_size or 1) * cfg.cp_size
                 * cfg.tp_size * (cfg.pp_size or 1))
    if args.model:                          # train.py's base_model check: a Llama decoder, valid JSON
        path = os.path.join(args.model, "config.json") if os.path.isdir(args.model) else args.model
        model = ModelShape.from_dict(read_hf_config(path, f"--model {args.model}", tuple(FAMILIES)))
        if not args.config:
            opts = Options(dtype="bfloat16")
    if model is None:
        raise ValueError("give a config YAML (python -m minipar.plan configs/fsdp.yaml) or --model "
                         "config.json")
    world = args.world or world or 1
    seq = args.seq_len or (batch.sequence_len if batch else 8192)
    gbs = args.global_batch_size or (batch.global_batch_size if batch else world)
    if gbs is None:                         # Axolotl's form: micro x accumulation x dp, as train.py's
        gbs = global_batch(args, base, world, cfg)
    mbs = args.micro_batch_size or (batch.micro_batch_size if batch else 1)
    batch = Batch(gbs, mbs, seq)
    flags = dict(dtype=args.dtype, prefetch=args.prefetch, optimizer=args.optimizer,
                 sync_each_batch=args.sync_each_batch,
                 gradient_checkpointing=args.gradient_checkpointing,
                 reshard_after_forward=args.reshard_after_forward,
                 selective_ac_option=args.selective_ac_option,
                 **{k: getattr(args, k) for k in OTHER_TRAINER_FIELDS})
    changes = {k: v for k, v in flags.items() if v is not None}
    ac = changes.get("gradient_checkpointing", opts.gradient_checkpointing)
    if args.selective_ac_option is not None and ac != "selective":
        raise ValueError(f"--selective-ac-option {args.selective_ac_option} goes with "
                         f"--gradient-checkpointing selective")
    if args.gather_once_per_step:          # each layer stays gathered: nothing reshards after forward
        if args.reshard_after_forward:
            raise ValueError("--gather-once-per-step keeps every layer gathered from its first forward to "
                             "its last backward: drop --reshard-after-forward")
        changes["reshard_after_forward"] = False
    if args.sac_every_other_matmul and not (ac == "selective" and changes.get(
            "selective_ac_option", opts.selective_ac_option) == "op"):
        raise ValueError("--sac-every-other-matmul goes with --gradient-checkpointing selective "
                         "--selective-ac-option op (torchtitan's per-op policy)")
    if ac not in (True, False):
        problem = check_option(ac, changes.get("selective_ac_option", opts.selective_ac_option))
        if problem:
            raise ValueError(problem)
    return model, base, batch, dataclasses.replace(opts, **changes), world


def global_batch(args, base: dict, world: int, cfg) -> int:
    """global_batch_size of a config that gives micro_batch_size and gradient_accumulation_steps
    instead (trainer/config/keys.py resolve_batch): micro x accumulation x dp of the planned layout
    (with --search, of the layout that puts every rank left by cp, tp and pp on dp)."""
    micro = args.micro_batch_size or cfg.micro_batch_size
    if micro is None:
        raise ValueError(f"gradient_accumulation_steps {cfg.gradient_accumulation_steps} without "
                         f"global_batch_size: set micro_batch_size (or --micro-batch-size), so that global "
                         f"= micro x accumulation x dp")
    try:
        lay = layout(args, base, world)
        dp = lay.dp_replicate * lay.dp_shard
    except ValueError:
        if not args.search:
            raise
        rest = (args.cp or cfg.cp_size) * (args.tp or cfg.tp_size) * (args.pp or cfg.pp_size or 1)
        dp = max(1, world // rest)
    return micro * (cfg.gradient_accumulation_steps or 1) * dp


def cluster(args) -> Cluster:
    """--gpu's data sheet (minipar/gpus.py), each of its fields replaced by its flag where given."""
    given = dict(peak_tflops=args.peak_tflops, hbm_gbps=args.hbm_bandwidth, intra_gbps=args.intra_bw,
                 gpu_memory_bytes=memory_bytes(args.gpu_memory) if args.gpu_memory is not None else None)
    hardware = {k: v if given[k] is None else given[k] for k, v in PRESETS[args.gpu].items()}
    return Cluster(gpus_per_node=args.gpus_per_node, inter_gbps=args.inter_bw, efficiency=args.efficiency,
                   reserve=args.reserve, attention_efficiency=args.attention_efficiency,
                   intra_latency_us=args.intra_latency_us, inter_latency_us=args.inter_latency_us, **hardware)
