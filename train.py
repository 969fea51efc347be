"""minipar's training program: one straight path from the config to the loss curve.

    python train.py                                       one process, configs/default.yaml
    torchrun --nproc-per-node 8 train.py                  dp_shard 2 x cp 2 x tp 2
    torchrun --nproc-per-node 4 train.py configs/hsdp.yaml --max_steps 20

The order of a run (as torchtitan's, one step after the other; TP and CP are built into the
decoder, data parallelism wraps it from outside):
  1. config: YAML + `--key value` overrides; every check that needs no communication (sizes
     against the world, the model against tp/cp, the batch against dp, the dataset file) runs on
     every rank before the first collective, so a mistake is a clear error, never a hang;
  2. the grid: minipar.init builds the process groups by hand (mesh.py);
  3. the model: the Llama decoder with TP and CP inside it (models/llama.py), its full weights
     drawn from the seed and sliced, so every layout starts from the same weights;
  4. data parallelism from outside: ZeRO-3 over dp_shard_cp with the decoder layers as units
     (HSDP over dp_replicate) when dp_shard_size > 1, else gradient all-reduce over dp_cp;
  5. AdamW on the local shards, warmup + cosine, global-norm clipping;
  6. the loop: each step reads its global batch (a pure function of seed and step), keeps this
     rank's share (dp samples, micro-batch, cp zigzag chunks), accumulates gradients, clips,
     steps; logs, evaluates and checkpoints (atomically) on schedule; resumes exactly;
  7. the end: on SIGTERM the ranks finish the step, save it and exit 143; at the end every group
     is destroyed before Python exits (lifecycle.py).

Exit status: 0 done, 1 crashed (or a collective failed: a peer stuck past ddp_timeout, or dead;
or a checkpoint could not be written: a full disk, the older checkpoints intact), 2 bad config or
input, 143 stopped on SIGTERM after saving (resume_from_checkpoint: latest).
"""
from __future__ import annotations

import dataclasses
import os
import sys

from pydantic import BaseModel

from minipar.comm_calls import CollectiveError
from minipar.trainer import lifecycle
from minipar.trainer.checkpoint.atomic import CheckpointWriteError
from minipar.trainer.config.keys import ALIASES
from minipar.trainer.config.train_config import TrainConfig
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

USAGE = """usage: train.py [CONFIG.yaml] [--key value ...]

  CONFIG.yaml     default: configs/default.yaml (see configs/ for one file per layout)
  --key value     any config key, nested ones with a dot: --max_steps 20 --model.hidden_size 64

keys (types and defaults in minipar/trainer/config/schema.py):
"""


def _usage() -> str:
    lines = []
    for name, value in TrainConfig():
        if isinstance(value, BaseModel) or dataclasses.is_dataclass(value):
            lines.append(f"  {name}.{{{', '.join(vars(value))}}}")
        else:
            lines.append(f"  {name} = {value!r}")
    aliases = ", ".join(f"{axolotl} = {name}" for axolotl, name in ALIASES.items())
    return USAGE + "\n".join(lines) + f"\n\nAxolotl's names are accepted too: {aliases}"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(_usage())
        return
    run = setup_run(argv)           # raises ValueError/FileNotFoundError on every rank, before any collective
    clean = False
    try:
        Trainer(run).train()
        clean = True
    except lifecycle.Preempted:
        clean = True                # every rank stopped after the same step and saved it
        raise
    finally:
        # every group destroyed and its threads joined while Python is whole (lifecycle.py);
        # after an error no barrier: a peer may be dead or stuck
        lifecycle.teardown(run.pgm, clean=clean)


if __name__ == "__main__":
    rank = os.environ.get("RANK", "0")
    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        print(f"[rank {rank}] error: {err}", file=sys.stderr)
        sys.exit(2)
    except lifecycle.Preempted:
        sys.exit(lifecycle.EXIT_PREEMPTED)      # 143: saved; relaunch with resume_from_checkpoint latest
    except CollectiveError as err:             # a peer stuck past ddp_timeout, or dead
        print(f"[rank {rank}] error: {err}", file=sys.stderr)
        sys.exit(1)
    except CheckpointWriteError as err:        # a full disk during a save: 1, the machine failed, not
        print(f"[rank {rank}] error: {err}", file=sys.stderr)   # the config (2 would say: fix it)
        sys.exit(1)
