"""The pipeline's point-to-point traffic under NCCL, two ranks on ONE GPU: does any schedule hang?

    torchrun --nproc-per-node 2 benchmarks/device_p2p.py --schedule 1f1b              on a GPU machine
    torchrun --nproc-per-node 2 benchmarks/device_p2p.py --schedule zbv --device cpu --small   gloo

One schedule per launch (the device check launches each in turn): a world that failed cannot be
formed again reliably in the same processes.

NCCL matches a pair's messages in the order they are posted and a send larger than its buffers
(NCCL_BUFFSIZE, 4 MiB by default) completes only when the receive runs, so a posting order with a
wait cycle hangs there and nowhere else (docs/pipeline_parallel.md; tests/test_pipeline.py replays
the posted order under those rules on the CPU). This runs the trainer under each schedule with
pp 2 and activations of 16 MiB (bf16, 1 x 2048 tokens x 4096), 4 micro-batches, 2 steps, then an
evaluation of 3 batches pipelined forward-only (schedules.forward_order); the model's embeddings tied,
so each step also all-reduces the two copies' gradients over pp_ends, which at pp 2 is the pp group
the sends use (pipeline_parallel/tied_ends.py; zbv holds both ends on one rank); a hang fails after
--timeout seconds (ddp_timeout) instead of blocking the device check.

Two processes on one GPU: NCCL refuses two ranks on one device of one host ("Duplicate GPU
detected"), so each rank claims a host of its own (NCCL_HOSTID) and they talk over sockets
(NCCL_SOCKET_IFNAME=lo; no shared memory, P2P or InfiniBand): the network transport, whose
send-waits-for-receive rule is the one a deadlock needs. Both ranks use device 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SCHEDULES = {"afab": 2, "1f1b": 2, "interleaved_1f1b": 4, "zb_h1": 2, "zbv": 4}   # -> layers


def _one_gpu_env(rank: int) -> None:
    """Before CUDA or NCCL start: every rank on device 0, each its own NCCL 'host'."""
    os.environ["LOCAL_RANK"] = "0"
    os.environ.setdefault("NCCL_HOSTID", f"minipar-device-p2p-{rank}")
    for key, value in (("NCCL_SOCKET_IFNAME", "lo"), ("NCCL_IB_DISABLE", "1"), ("NCCL_P2P_DISABLE", "1"),
                       ("NCCL_SHM_DISABLE", "1")):
        os.environ.setdefault(key, value)


def _argv(schedule: str, layers: int, small: bool, timeout: int, out_dir: str, device: str) -> list:
    hidden, seq = (64, 64) if small else (4096, 2048)
    argv = ["configs/default.yaml", "--pipeline_parallel_size", "2", "--pipeline_schedule", schedule,
            "--context_parallel_size", "1", "--tensor_parallel_size", "1", "--dp_shard_size", "1",
            "--sequence_len", str(seq), "--global_batch_size", "4", "--micro_batch_size", "1",
            "--max_steps", "2", "--warmup_steps", "0", "--eval_steps", "2",
            "--eval_batches", "3", "--save_steps", "0", "--model.tie_word_embeddings", "true",
            "--logging_steps", "1", "--progress_bar", "false", "--save_final_checkpoint", "false",
            "--export_hf", "false", "--ddp_timeout", str(timeout), "--output_dir", out_dir,
            "--model.hidden_size", str(hidden), "--model.intermediate_size", str(hidden),
            "--model.num_hidden_layers", str(layers), "--model.num_attention_heads", "4" if small else "32",
            "--model.num_key_value_heads", "2" if small else "8", "--model.max_position_embeddings", str(seq)]
    return argv + (["--dtype", "bfloat16"] if device == "cuda" else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", required=True, choices=sorted(SCHEDULES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="a tiny model: checks this script, not NCCL")
    ap.add_argument("--timeout", type=int, default=60, help="seconds before a stuck exchange fails")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        _one_gpu_env(int(os.environ.get("RANK", 0)))
    import train
    out_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"minipar_device_p2p_{args.schedule}")
    start = time.perf_counter()
    train.main(_argv(args.schedule, SCHEDULES[args.schedule], args.small, args.timeout, out_dir, args.device))
    print(json.dumps(dict(schedule=args.schedule, seconds=round(time.perf_counter() - start, 1))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
