"""python -m minipar.plan: memory, bytes and time per rank of a layout, before renting the cluster.

    python -m minipar.plan configs/fsdp.yaml                       the config's model, layout, batch
    python -m minipar.plan --model configs/models/llama-3.1-8b.json --world 16 --tp 8 --sp
    python -m minipar.plan --model configs/models/llama-3.1-70b.json --world 1024 --search
    python -m minipar.plan configs/cp_tp.yaml --cp-impl usp --cp-ulysses 2 --cp 4 --world 8
                                                                   attention across cp: ring
                                                                   (default), ulysses or usp
    python -m minipar.plan configs/moe.yaml                        a mixture of experts (--ep N)
    python -m minipar.plan configs/5d.yaml                         pipeline: one line per stage,
                                                                   the worst in full
    ... --json                                                     the same, as JSON for scripts

The counts are minipar's own code paths (minipar/plan/model.py, activation_bytes.py, collective_counts.py;
per pipeline stage minipar/plan/pipeline.py), held exactly against real runs by
tests/test_plan.py (cp_impl ulysses / usp: tests/test_plan_cp_impls.py); the time is a stated
model (minipar/plan/estimate.py), not a measurement; the text is minipar/plan/report.py's.
"""
from __future__ import annotations

import argparse
import json
import sys

from minipar.cli import fail, memory_bytes, positive_ints, within
from minipar.gpus import PRESETS
from minipar.optim import OPTIMIZERS
from minipar.optim_bnb import BNB_OPTIMIZERS

from . import command_inputs
from .estimate import plan
from .inputs import OTHER_TRAINER_FIELDS
from .layout_search import search, smallest_world
from .pipeline import plan_pipeline
from .report import describe, describe_pipeline, describe_search

# the flags that count something: 0 or less is refused by name (minipar/cli.py)
SIZE_FLAGS = dict(world="the number of GPUs", gpus_per_node="GPUs per node", dp_replicate="replicas",
                  dp_shard="ZeRO-3 shards", cp="context-parallel ranks", tp="tensor-parallel ranks",
                  pp="pipeline stages", virtual_stages="model chunks per rank", seq_len="tokens per sequence",
                  global_batch_size="sequences per step", micro_batch_size="rows per forward",
                  top="layouts shown", cp_ulysses="ranks of a Ulysses group", ep="expert-parallel ranks")
# how another trainer runs the step (inputs.py's Options; time_model.py and overlap.py price them)
OTHER_TRAINERS = dict(
    fused_kernels="memory-bound ops fused, each region reading its inputs and writing its outputs once "
                  "(torch.compile, Transformer Engine)",
    sac_every_other_matmul="with selective op AC: torchtitan's policy, every second matmul of a layer "
                           "recomputed (k, o, up)",
    distributed_optimizer="DDP layouts: Megatron-LM's distributed optimizer, gradients reduce-scattered "
                          "in the last backward, parameters all-gathered behind the next forward, the "
                          "fp32 master and moments sharded over dp",
    tp_comm_overlap="Megatron-LM's --tp-comm-overlap: TP collectives pipelined with their GEMMs",
    gather_once_per_step="ZeRO-3: each layer gathered once per step and kept to its last backward "
                         "(PyTorch pipelining with reshard_after_forward False)",
    cp_all_gather_kv="context parallelism as the Llama 3 paper: K/V all-gathered, exposed")
assert tuple(OTHER_TRAINERS) == OTHER_TRAINER_FIELDS
# the flags that are rates or fractions: each with the test it must pass
FLOAT_FLAGS = dict(peak_tflops=(lambda v: v > 0, "more than 0 (dense bf16 TFLOP/s of one GPU)"),
                   intra_bw=(lambda v: v > 0, "more than 0 (GB/s per GPU inside a node)"),
                   inter_bw=(lambda v: v > 0, "more than 0 (GB/s per GPU between nodes)"),
                   efficiency=(lambda v: 0 < v <= 1, "in (0, 1] (a fraction of peak)"),
                   attention_efficiency=(lambda v: 0 < v <= 1, "in (0, 1] (a fraction of peak)"),
                   hbm_bandwidth=(lambda v: v > 0, "more than 0 (GB/s of GPU memory)"),
                   intra_latency_us=(lambda v: v >= 0, "at least 0 (microseconds per hop)"),
                   inter_latency_us=(lambda v: v >= 0, "at least 0 (microseconds per hop)"),
                   reserve=(lambda v: 0 <= v < 1, "in [0, 1) (a fraction of GPU memory kept free)"),
                   max_grad_norm=(lambda v: v >= 0, "at least 0 (0: no clipping)"))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m minipar.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", help="a train.py config YAML (model, layout, batch, dtype)")
    ap.add_argument("--model", help="a Hugging Face config.json, or the model directory holding it "
                                    "(replaces the config's model)")
    ap.add_argument("--world", type=int, help="number of GPUs (default: the layout's product)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", choices=sorted(PRESETS), default="h100",
                    help="the GPU's data sheet (minipar/gpus.py): its peak, HBM bandwidth, memory and "
                         "NVLink; the four flags below override it (default h100, the SXM 80GB)")
    ap.add_argument("--gpu-memory",
                    help="memory per GPU with its unit: 80GiB, 80GB (10^9), 141GB; a bare number is GiB, "
                         "as torch reports (default: --gpu's, H100 80GiB)")
    ap.add_argument("--peak-tflops", type=float, help="dense bf16 peak (default: --gpu's, H100 SXM 989)")
    ap.add_argument("--intra-bw", type=float,
                    help="GB/s per GPU inside a node, one way (NVLink; default: --gpu's, H100 450)")
    ap.add_argument("--inter-bw", type=float, default=50.0, help="GB/s per GPU between nodes (IB 400 Gb/s)")
    ap.add_argument("--efficiency", type=float, default=0.7, help="achieved fraction of peak on large GEMMs")
    ap.add_argument("--attention-efficiency", type=float, default=0.5,
                    help="achieved fraction of peak in attention (FlashAttention on H100: 0.5-0.75 forward)")
    ap.add_argument("--hbm-bandwidth", type=float,
                    help="GB/s of GPU memory, for memory-bound work (default: --gpu's, H100 SXM HBM3 3350)")
    ap.add_argument("--intra-latency-us", type=float, default=1.0, help="us per hop inside a node")
    ap.add_argument("--inter-latency-us", type=float, default=5.0, help="us per hop between nodes")
    ap.add_argument("--reserve", type=float, default=0.1, help="fraction of GPU memory kept free")
    for size in ("dp-replicate", "dp-shard", "cp", "tp"):
        ap.add_argument(f"--{size}", type=int)
    ap.add_argument("--ep", type=int, help="expert-parallel ranks of an MoE, borrowed from dp_shard x cp")
    ap.add_argument("--cp-impl", choices=("ring", "ulysses", "usp"),
                    help="attention across cp: K/V round a ring, Ulysses' all-to-alls, or both (USP)")
    ap.add_argument("--cp-ulysses", type=int, help="USP's Ulysses group size (divides --cp)")
    ap.add_argument("--pp", type=int, help="pipeline stages (default: the config's; --search tries every pp)")
    ap.add_argument("--pipeline-schedule", choices=("afab", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"))
    ap.add_argument("--pipeline-overlap-steps", action="store_const", const=True,
                    help="the stages update and start the next step without meeting (the trainer's "
                         "pipeline_overlap_steps); with clipping each stage keeps a copy of its state")
    ap.add_argument("--max-grad-norm", type=float,
                    help="clipping, 0 for none (default: the config's, else the trainer's 1.0): under "
                         "--pipeline-overlap-steps it makes the stages post-validate their updates")
    ap.add_argument("--virtual-stages", type=int, help="model chunks per rank (interleaved_1f1b; default 2; "
                    "zbv: 2)")
    ap.add_argument("--sp", "--sequence-parallel", dest="sequence_parallel", action="store_const", const=True)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--global-batch-size", type=int,
                    help="sequences per step (default with --model: --world)")
    ap.add_argument("--micro-batch-size", type=int,
                    help="rows per dp rank per forward (default with --model: 1)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--prefetch", type=int)
    ap.add_argument("--optimizer", choices=(*OPTIMIZERS, *BNB_OPTIMIZERS),
                    help="its state bytes (default: the config's, else adamw_torch): adamw_bnb_8bit ~2 B per "
                         "parameter, AdamW 8 (minipar/optim_bnb.py)")
    ap.add_argument("--no-sync", dest="sync_each_batch", action="store_const", const=False,
                    help="ZeRO-3: accumulate unsharded gradients, one reduce-scatter per step")
    ap.add_argument("--gradient-checkpointing", nargs="?", const=True, choices=(True, "selective"),
                    help="full (no value), or selective (models/activation_checkpoint.py)")
    ap.add_argument("--selective-ac-option", type=lambda v: int(v) if v.isdigit() else v,
                    help="with --gradient-checkpointing selective: op (keep matmul and attention "
                         "outputs, default) or n (every n-th layer)")
    ap.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_const",
                    const=False, help="no activation checkpointing, over the config's")
    ap.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                    help="ZeRO-3: free each layer's gathered weights after its forward and gather them "
                         "again for the backward (the default); --no-reshard-after-forward keeps them, "
                         "one gather per micro-batch for more memory")
    for name, what in OTHER_TRAINERS.items():
        ap.add_argument("--" + name.replace("_", "-"), action="store_const", const=True, help=what)
    ap.add_argument("--search", action="store_true",
                    help="rank every layout of --world that fits (pp included)")
    ap.add_argument("--no-pp", action="store_true",
                    help="with --search: layouts without pipeline parallelism only")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        problems = []
        for check in (lambda: positive_ints(args, SIZE_FLAGS),   # --world 0 refused, not read as "not given"
                      lambda: within(args, FLOAT_FLAGS),
                      lambda: args.gpu_memory is None or memory_bytes(args.gpu_memory)):
            try:
                check()
            except ValueError as err:                            # every wrong flag in one line
                problems.append(str(err))
        if problems:
            raise ValueError("; ".join(problems))
        model, base, batch, opts, world = command_inputs.load(args)
        cluster = command_inputs.cluster(args)
        pipe = command_inputs.pipeline(args, base)
        if args.search and (args.pp or args.pipeline_schedule or args.virtual_stages
                            or args.pipeline_overlap_steps):
            raise ValueError("--search ranks every pipeline size itself "
                             "(pp 1 and each pp that divides the world, 1F1B); "
                             "drop --pp/--pipeline-schedule/--virtual-stages/--pipeline-overlap-steps, or "
                             "drop --search to plan one pipeline layout")
        if pipe.overlap_steps and pipe.pp < 2:
            raise ValueError("--pipeline-overlap-steps overlaps the steps of pipeline stages: "
                             "give --pp 2 or more")
        if model.is_moe and (args.search or pipe.pp > 1):
            raise ValueError(f"a mixture of experts ({model.num_local_experts} experts) is planned on one "
                             f"4D layout (with --ep): drop {'--search' if args.search else 'pp'} "
                             f"(the search and pipeline stages count dense layers only, not yet MoE)")
        if args.search:
            result = search(model, batch, opts, cluster, world, pipeline=not args.no_pp)
            if result["recommended"] is None:
                result["smallest_world"] = smallest_world(model, batch, opts, cluster, world)
            text = describe_search(result, model, args.top)
        elif pipe.pp > 1:
            layout = command_inputs.layout(args, base, world)
            result = plan_pipeline(model, layout, pipe, batch, opts, cluster)
            text = describe_pipeline(result, model)
        else:
            layout = command_inputs.layout(args, base, world)
            result = plan(model, layout, batch, opts, cluster)
            text = describe(result, model)
    except (ValueError, FileNotFoundError) as err:
        return fail(err)                     # one line, exit 2 (minipar/cli.py)
    print(json.dumps(result, indent=1) if args.json else
          f"GPU: {args.gpu} (minipar/gpus.py, flags replace its figures): {cluster.peak_tflops:g} TFLOP/s "
          f"dense bf16, HBM {cluster.hbm_gbps:g} GB/s, {cluster.gpu_memory_bytes / 2 ** 30:.4g} GiB, NVLink "
          f"{cluster.intra_gbps:g} GB/s one way\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
