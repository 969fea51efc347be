r"""Start-up memory: a 317 M parameter Llama checkpoint loaded on 8 ranks and on 1, meta-device
construction with sliced reads against today's path (build the full TP-local model, then shard).

    .venv/bin/python benchmarks/bench_load.py [--dir /tmp/minipar-bench-load] \
        [--out benchmarks/results/bench_load.md]

The checkpoint (bf16, ~0.6 GiB in 512 MiB safetensors shards, random weights) is written once by
minipar.trainer.data.make_example.write_checkpoint, tensor by tensor. Each run launches its ranks as
fresh processes (like torchrun: nothing inherited from this script), gloo over a FileStore, one
torch thread each. Per rank:

  baseline     resident memory after `import torch` and the process groups, before the model
  peak         the most resident memory while building and loading (VmHWM, reset to the baseline
               through /proc/self/clear_refs just before the build)
  shards       the parameter bytes the rank keeps (ZeRO-3 flat shards, or the TP-local model), fp32
  unit         the largest unit, TP-local, fp32 (fully_shard's units: the embedding, each decoder
               layer, the root with the final norm and lm_head)
  theory       shards + unit + baseline: what the rank keeps, plus one unit in flight, plus the runtime
  load s       wall time of build + load (every rank, to the barrier after it)

Runs: `meta` (LlamaForCausalLM(..., device="meta"), then fully_shard(init=checkpoint reader): every
rank reads only the slices of its shards) on the default 8-rank layout dp_shard 2 x cp 2 x tp 2 and
on 1 rank (materialize: the whole model is that rank's), and `full` (today's code before meta
construction: the eagerly initialised TP-local model, then fully_shard) on the same 8 ranks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

CFG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
           num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096, rope_theta=500000.0)
LAYOUT8 = dict(dp_shard_size=2, cp_size=2, tp_size=2)
MB = 2 ** 20


def worker(args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from common import current_rss, peak_rss, reset_peak_rss

    import minipar
    from minipar import ParallelismConfig
    from minipar.tensor_parallel import VocabParallelEmbedding
    from minipar.zero3 import fully_shard, plan_units
    from models.hf_checkpoint import HFCheckpoint
    from models.llama import LlamaForCausalLM
    from models.llama_init import materialize
    from models.llama_layer import LlamaDecoderLayer
    store = dist.FileStore(args.store, args.world)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world)
    sizes = LAYOUT8 if args.world == 8 else {}
    pgm = minipar.init(ParallelismConfig(**sizes).resolve(args.world))
    ckpt = HFCheckpoint(args.dir)
    meta = LlamaForCausalLM(ckpt.config, pgm, device="meta")
    n_params = sum(math.prod(p.tp_full_shape) for p in meta.parameters())
    unit_classes = (VocabParallelEmbedding, LlamaDecoderLayer)          # fully_shard's default units
    units = [sum(p.numel() for _, p in params) * 4 for _, _, params, _ in plan_units(meta, unit_classes)]
    sharded = pgm.dp_shard_cp.size > 1                                  # as the trainer decides
    dist.barrier()
    try:                                           # Linux >= 4.0: VmHWM := current RSS
        baseline, reset = reset_peak_rss(), True
    except OSError:
        baseline, reset = current_rss(), False
    t0 = time.perf_counter()
    if args.mode == "meta":
        ckpt.check(meta)
        model = meta
        if sharded:
            fully_shard(model, pgm, init=ckpt.source(pgm.tp))
        else:
            materialize(model, ckpt.source(pgm.tp))
    else:                                          # today's path: the whole TP-local model first
        model = LlamaForCausalLM(ckpt.config, pgm, seed=0)
        if sharded:
            fully_shard(model, pgm)
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = peak_rss()                              # without the reset: since start (an upper bound)
    shards = sum(p.numel() * p.element_size() for p in model.parameters())
    out = dict(rank=args.rank, baseline=baseline, peak=peak, shards=shards, unit=max(units), seconds=seconds,
               reset=reset, n_params=n_params)
    with open(args.result, "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def launch(mode: str, world: int, directory: str):
    tmp = tempfile.mkdtemp(prefix="minipar-bench-load-")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", mode, "--rank", str(r),
                               "--world", str(world), "--store", os.path.join(tmp, "store"),
                               "--dir", directory, "--result", os.path.join(tmp, f"r{r}.json")], env=env)
             for r in range(world)]
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"{mode} on {world} ranks: exit codes {codes}")
    return [json.load(open(os.path.join(tmp, f"r{r}.json"))) for r in range(world)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "minipar-bench-load"))
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_load.md"))
    parser.add_argument("--tiny", action="store_true",
                        help="a 4 M parameter model: a smoke test of the script")
    parser.add_argument("--worker", choices=["meta", "full"], help=argparse.SUPPRESS)
    for a in ("--rank", "--world"):
        parser.add_argument(a, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(argparse.Namespace(**{**vars(args), "mode": args.worker}))
    import torch

    from minipar.trainer.data.make_example import write_checkpoint
    from models.llama_config import LlamaConfig
    if args.tiny:
        CFG.update(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=4)
        args.dir += "-tiny"
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        t = time.perf_counter()
        print(f"writing the checkpoint to {args.dir} ...", flush=True)
        write_checkpoint(args.dir, LlamaConfig(**CFG), seed=0, dtype=torch.bfloat16, max_shard_bytes=512 * MB,
                         progress=True)
        print(f"  {time.perf_counter() - t:.0f} s", flush=True)
    file_mb = sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir)
                  if f.endswith(".safetensors")) / MB
    rows, n_params = [], None
    for mode, world in (("meta", 8), ("meta", 1), ("full", 8)):
        print(f"{mode} on {world} rank(s) ...", flush=True)
        results = launch(mode, world, args.dir)
        n_params = n_params or results[0]["n_params"]
        for r in results:
            theory = r["shards"] + r["unit"] + r["baseline"]
            rows.append((mode, world, r["rank"], r["baseline"] / MB, r["shards"] / MB, r["unit"] / MB,
                         theory / MB, r["peak"] / MB, r["peak"] / theory, r["seconds"]))
    lines = ["# bench_load: start-up memory, meta-device construction + sliced loading "
             "vs the full TP-local model",
             "",
             f"Llama {CFG}, {n_params / 1e6:.0f} M parameters; checkpoint bf16, "
             f"{file_mb:.0f} MiB in safetensors shards; "
             f"8 ranks = dp_shard 2 x cp 2 x tp 2 (ZeRO-3 over dp_shard_cp = 4, TP 2); gloo on CPU, "
             f"fresh processes, 1 thread each; torch {torch.__version__}. MiB per rank; "
             f"theory = shards + one unit + baseline; the goal is peak <= 1.3 x theory.",
             "",
             "| path | ranks | rank | baseline | shards | largest unit | theory | peak | peak / theory "
             "| load s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, world, rank, base, shards, unit, theory, peak, ratio, sec in rows:
        name = "meta + sliced read" if mode == "meta" else "full TP-local model, then shard (before)"
        lines.append(f"| {name} | {world} | {rank} | {base:.0f} | {shards:.0f} | {unit:.0f} | {theory:.0f} | "
                     f"{peak:.0f} | {ratio:.2f} | {sec:.1f} |")
    worst = max(r[8] for r in rows if r[0] == "meta")
    lines += ["", f"meta + sliced read: worst peak / theory = {worst:.2f} "
                  f"({'within' if worst <= 1.3 else 'ABOVE'} the 1.3x goal). The 'before' rows keep the same "
                  f"shards but first hold the whole TP-local model (and draw its random init)."]
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
