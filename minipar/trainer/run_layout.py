"""setup_run's step 4, the layout: which sizes this launch asked for, resolved against the world.

The sizes come from, strongest first: the command line (`--tensor_parallel_size 2`), accelerate's
PARALLELISM_CONFIG_{DP_REPLICATE,DP_SHARD,CP,TP,PP}_SIZE variables (for the sizes neither the
command line nor an explicit config file sets), the config file. Without a config file, sizes
given replace the default 8-process layout; a world of one runs any config with all sizes 1.
cfg.parallelism() -> ParallelismConfig.resolve(world) (dp_shard takes the remainder), then the
model, the sequence, Ulysses' heads and compile are checked against the resolved sizes. A layout
that does not fit the world names a launch that does. Nothing here communicates: every rank
raises the same error before any group exists.
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Optional

import torch.distributed as dist

from minipar import ParallelismConfig
from minipar.config_files import read_yaml
from minipar.context_parallel import check_ulysses
from minipar.regional_compile import check_compile
from minipar.trainer.config import keys as config_keys
from minipar.trainer.config.train_config import TrainConfig, parse_overrides
from models.hf_checkpoint import HFCheckpoint

# the grid's sizes (ParallelismConfig's names, and the training config's); ep_size adds no ranks
SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "pp_size")


def world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def layout(cfg: TrainConfig, path: str, argv: List[str], default_config: bool,
            notes: list, base: Optional[HFCheckpoint] = None) -> ParallelismConfig:
    """The grid's config for this launch: the sizes given (command line, then accelerate's
    variables), cfg.parallelism() resolved against the world, checked against the model."""
    given = config_keys.size_keys(parse_overrides(argv)) & set(SIZE_KEYS)
    # accelerate's variables count as sizes given for this launch
    given |= _sizes_from_env(cfg, path, default_config, given, notes)
    if default_config and given:
        # The default config's layout (cp 2 x tp 2) is the 8-process showcase. Sizes given on the
        # command line replace that layout instead of combining with it, so that
        # `torchrun --nproc-per-node 2 train.py --tensor_parallel_size 2` is plain TP on 2 ranks.
        unset = [k for k in SIZE_KEYS if k not in given]
        for key in unset:
            setattr(cfg, key, None if key == "dp_shard_size" else 1)
        notes.append(f"parallel sizes from the command line replace the default layout ({', '.join(unset)} "
                     f"reset: dp_shard_size takes the remainder, the others are 1)")
    world = world_size()
    pconf = cfg.parallelism()
    if world == 1 and not given and any((v or 1) > 1 for v in [*pconf.sizes.values(), pconf.ep_size]):
        # `python train.py` on a config written for a torchrun launch: run it on one process
        sizes = dict(pconf.sizes, **({"ep_size": pconf.ep_size} if pconf.ep_size > 1 else {}))
        notes.append(f"one process: the config's parallel sizes ({_fmt(sizes)}) apply to torchrun "
                     f"launches; running with all sizes 1")
        pconf = dataclasses.replace(pconf, **dict.fromkeys([*SIZE_KEYS, "ep_size"], 1))
    try:
        resolved = pconf.resolve(world)
    except ValueError as err:
        raise ValueError(f"{err} ({_launch_hint(pconf, world, path, argv, default_config)})") from None
    if base is not None and base.vocab_resize is not None and cfg.model.vocab_size % resolved.tp_size:
        v = cfg.model.vocab_size
        raise ValueError(f"the vocabulary resized for the added tokens ({v}) does not divide by tp_size "
                         f"{resolved.tp_size} (the embedding is split in rows): set "
                         f"resize_token_embeddings_to_32x: true (rounds it to {-(-v // 32) * 32}), add "
                         f"tokens to reach a multiple of {resolved.tp_size}, or use a tp_size that "
                         f"divides {v}")
    resolved.validate_model(cfg.model, cfg.sequence_len)
    if resolved.cp_size > 1 and resolved.cp_impl != "ring":   # Ulysses splits the heads of each tp rank
        problems = check_ulysses(cfg.model.num_attention_heads, cfg.model.num_key_value_heads,
                                 resolved.tp_size, resolved.cp_size, resolved.cp_ulysses_size)
        if problems:
            raise ValueError(f"cp_impl {resolved.cp_impl}: " + "; ".join(problems))
    # compile: the combinations that cannot compile on the sizes this world runs (regional_compile.py)
    problem = check_compile(cfg.compile is True, cfg.compile_backend, cfg.compile_mode,
                            cfg.pipeline_schedule if resolved.pp_size > 1 else "1f1b",
                            cfg.gradient_checkpointing, cfg.selective_ac_option,
                            boundaries=resolved.tp_size > 1 or resolved.cp_size > 1
                            or cfg.model.num_local_experts > 0)
    if problem:
        raise ValueError(problem)
    if cfg.sequence_len > cfg.model.max_position_embeddings:
        raise ValueError(f"sequence_len {cfg.sequence_len} exceeds model.max_position_embeddings "
                         f"{cfg.model.max_position_embeddings}")
    return resolved


def _launch_hint(pconf: ParallelismConfig, world: int, path: str, argv: List[str],
                 default_config: bool) -> str:
    """A launch that fits the sizes asked for: the same arguments, a process count they resolve to."""
    fixed = dataclasses.replace(pconf, dp_shard_size=1).total_size    # pp x dp_replicate x cp x tp
    if pconf.dp_shard_size is not None:
        counts = [fixed * pconf.dp_shard_size]
    else:                                               # dp_shard takes the remainder: multiples fit
        below = world // fixed * fixed
        counts = [n for n in (below, below + fixed) if n > 0]
    args = " ".join(([] if default_config else [path]) + list(argv))
    tail = " " + args if args else ""
    launches = " or ".join(f"`torchrun --nproc-per-node {n} train.py{tail}`" for n in counts)
    return f"config {path}; launch {launches}, or change the sizes so that they fit {world} processes"


def _sizes_from_env(cfg: TrainConfig, path: str, default_config: bool, from_cli: set, notes: list) -> set:
    """Apply accelerate's PARALLELISM_CONFIG_{DP_REPLICATE,DP_SHARD,CP,TP,PP}_SIZE to the sizes that
    the command line does not give and an explicit config file does not set; returns the keys set.
    (The command line wins over the variables, the variables over the file's unset keys and over
    the implicit default layout.)"""
    env = {k: v for k, v in ParallelismConfig.from_env().sizes.items() if v is not None}
    if not env:
        return set()
    in_file = set()
    if not default_config:
        in_file = config_keys.size_keys(read_yaml(path) or {}) & set(SIZE_KEYS)
    applied = {k: v for k, v in env.items() if k not in from_cli and k not in in_file}
    for key, value in applied.items():
        setattr(cfg, key, value)
    ignored = sorted(set(env) - set(applied))
    notes.append(f"sizes from PARALLELISM_CONFIG_* variables: {_fmt(applied) or 'none applied'}"
                 + (f" (ignored for {', '.join(ignored)}: set by the command line or {path})"
                    if ignored else ""))
    return set(applied)


def _fmt(sizes: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sizes.items())
