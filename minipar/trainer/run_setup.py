"""From the command line to a checked run: config, layout, data, then the process groups.

Everything that can be checked without communicating is checked here, on every rank, before
minipar.init creates a single group, so a mistake is the same clear error everywhere, never a hang:

    argv -> load_config (YAML + --key value, unknown keys, types, then  train_config.py
            every value and data file at once, all wrong ones in one error) check.py
         -> base_model's weight headers against its config.json          models/hf_checkpoint.py
         -> the layout: the config's sizes, resolved against the world   config.py
              (a world of one runs any config with all sizes 1; without a config file, sizes on
               the command line replace the default layout; accelerate's PARALLELISM_CONFIG_*_SIZE
               variables set the sizes that neither the command line nor the config file sets)
         -> the tokenizer and the `datasets` rows (tokenizer.py, datasets.py, packing.py), loaded
            from dataset_prepared_path when prepared before (prepared.py), or the byte corpus
         -> the model against tp/cp and the sequence, the batch against dp (global = micro x
            accumulation x dp), max_steps from num_epochs, the checkpoint to resume from
                                                                         keys.py
         -> only now the first writes: output_dir created and checked writable, and no live run
            holding it (rank 0 locks it, released when the process ends)   run_lock.py
         -> minipar.init(layout): the groups                              mesh.py
         -> the same resolved config on every rank? (one all-gather)      lifecycle.py
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

import minipar
from minipar import ParallelismConfig
from minipar.config_files import read_yaml
from minipar.context_parallel import check_ulysses
from minipar.trainer import lifecycle, run_lock
from minipar.trainer.config import keys as config_keys
from minipar.trainer.config.check import check_pipeline
from minipar.trainer.config.train_config import REPO_ROOT, TrainConfig, load_config, parse_overrides
from minipar.trainer.data import batches as mdata
from minipar.trainer.data.packing import prepare as prepare_datasets
from minipar.trainer.data.prepared import load_or_prepare
from minipar.trainer.data.tokenizer import (
    HFTokenizer,
    fill_special_token_ids,
    load_tokenizer,
    padded_vocab_size,
    tokenizer_path,
)
from models.hf_checkpoint import HFCheckpoint
from models.llama import LlamaForCausalLM

SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "context_parallel_size", "tensor_parallel_size",
             "pipeline_parallel_size")
# ParallelismConfig's field (and PARALLELISM_CONFIG_<FIELD> variable) -> the training config's key
ENV_SIZE_KEYS = dict(dp_replicate_size="dp_replicate_size", dp_shard_size="dp_shard_size",
                     cp_size="context_parallel_size", tp_size="tensor_parallel_size",
                     pp_size="pipeline_parallel_size")
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "default.yaml")


@dataclass
class Run:
    cfg: TrainConfig
    pgm: object
    num_micro_steps: int
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    notes: List[str] = field(default_factory=list)
    datasets: Optional[object] = None     # packing.DatasetRun when `datasets` is set, else the byte corpus
    tokenizer: Optional[object] = None
    lock: Optional[run_lock.RunLock] = None     # rank 0 holds output_dir/minipar.lock until the run ends
    base_model: Optional[object] = None   # the checked hf_checkpoint.HFCheckpoint of cfg.base_model


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def _rank() -> int:
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def setup_run(argv: List[str]) -> Run:
    """Parse and check everything, then create the process groups. Raises before any collective."""
    path, default_config = DEFAULT_CONFIG, True
    if argv and not argv[0].startswith("--"):
        path, argv, default_config = argv[0], argv[1:], False
    from_cli = set(parse_overrides(argv)) & set(SIZE_KEYS)
    notes = []
    cfg = load_config(path, argv, notes)      # every value checked, all wrong ones in one error
    # base_model's config.json was read above; its weight headers now, before the tokenizer is
    # loaded from the same directory and before output_dir is created: a damaged file is one line
    base = _check_base_model(cfg) if cfg.base_model else None
    from_env = _sizes_from_env(cfg, path, default_config, from_cli, notes)
    from_cli = from_cli | from_env          # accelerate's variables count as sizes given for this launch
    if default_config and from_cli:
        # The default config's layout (cp 2 x tp 2) is the 8-process showcase. Sizes given on the
        # command line replace that layout instead of combining with it, so that
        # `torchrun --nproc-per-node 2 train.py --tensor_parallel_size 2` is plain TP on 2 ranks.
        unset = [k for k in SIZE_KEYS if k not in from_cli]
        for key in unset:
            setattr(cfg, key, None if key == "dp_shard_size" else 1)
        notes.append(f"parallel sizes from the command line replace the default layout ({', '.join(unset)} "
                     f"reset: dp_shard_size takes the remainder, the others are 1)")
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    if isinstance(tokenizer, HFTokenizer) and not getattr(cfg, "base_model", None):
        # a model from scratch takes the tokenizer's vocabulary (padded so any tp up to 64 divides it)
        vocab = padded_vocab_size(tokenizer.vocab_size)
        if cfg.model.vocab_size != vocab:
            notes.append(f"model.vocab_size {cfg.model.vocab_size} -> {vocab}: the tokenizer's "
                         f"{tokenizer.vocab_size} "
                         f"tokens, padded to a multiple of 64")
            cfg.model.vocab_size = vocab
    fill_special_token_ids(cfg.model, tokenizer)   # bos/eos/pad ids, for the exported config.json
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the tokenizer ({tokenizer_path(cfg)}) has {tokenizer.vocab_size} tokens, "
                         f"more than "
                         f"model.vocab_size {cfg.model.vocab_size}: use the model's own tokenizer")
    world = _world_size()
    sizes = dict(dp_replicate_size=cfg.dp_replicate_size, dp_shard_size=cfg.dp_shard_size,
                 cp_size=cfg.context_parallel_size, tp_size=cfg.tensor_parallel_size,
                 pp_size=cfg.pipeline_parallel_size)
    ep = cfg.expert_parallel_size
    if world == 1 and not from_cli and any((v or 1) > 1 for v in list(sizes.values()) + [ep]):
        # `python train.py` on a config written for a torchrun launch: run it on one process
        notes.append(f"one process: the config's parallel sizes ({_fmt(sizes)}) apply to torchrun "
                     f"launches; running with all sizes 1")
        sizes, ep = dict.fromkeys(sizes, 1), 1
    pconf = ParallelismConfig(**sizes, sequence_parallel=cfg.sequence_parallel,
                              tp_async_overlap=cfg.tp_async_overlap, cp_layout=cfg.cp_layout,
                              cp_impl=cfg.cp_impl, cp_ulysses_size=cfg.cp_ulysses_size,
                              attention_backend=cfg.attention_backend,
                              ep_size=ep)
    try:
        pconf = pconf.resolve(world)
    except ValueError as err:
        raise ValueError(f"{err} ({_launch_hint(pconf, world, path, argv, default_config)})") from None
    pconf.validate_model(cfg.model, cfg.sequence_len)
    if pconf.cp_size > 1 and pconf.cp_impl != "ring":   # Ulysses splits the heads of each tp rank
        problems = check_ulysses(cfg.model.num_attention_heads, cfg.model.num_key_value_heads,
                                 pconf.tp_size, pconf.cp_size, pconf.cp_ulysses_size)
        if problems:
            raise ValueError(f"cp_impl {pconf.cp_impl}: " + "; ".join(problems))
    dp = pconf.dp_replicate_size * pconf.dp_shard_size
    num_micro = config_keys.resolve_batch(cfg, dp)      # global = micro x accumulation x dp
    if pconf.pp_size > 1:                         # the split and the schedule, before any group exists
        check_pipeline(cfg, pconf.pp_size, num_micro)
    if cfg.sequence_len > cfg.model.max_position_embeddings:
        raise ValueError(f"sequence_len {cfg.sequence_len} exceeds model.max_position_embeddings "
                         f"{cfg.model.max_position_embeddings}")
    datasets = None
    if cfg.datasets:
        # tokenized once, then loaded from dataset_prepared_path (one writer per node, no collective)
        progress = int(os.environ.get("RANK", 0)) == 0
        datasets = load_or_prepare(cfg, tokenizer, prepare_datasets, progress=progress)
        notes.extend(datasets.notes)
        train_tokens = val_tokens = torch.empty(0, dtype=torch.uint8)
    else:
        train_tokens, val_tokens = mdata.load_corpus(cfg.dataset, cfg.val_fraction,
                                                     sequence_len=cfg.sequence_len,
                                                     tokenizer=tokenizer)
    if cfg.num_epochs is not None:                      # max_steps from the sampler's samples per epoch
        samples = datasets.train.num_rows if datasets is not None else \
            mdata.BatchSampler(len(train_tokens), cfg.sequence_len, cfg.global_batch_size).num_windows
        config_keys.resolve_max_steps(cfg, samples, notes)
    resume = cfg.resume_from_checkpoint
    if resume and resume != "latest" and not os.path.isdir(resume):
        raise FileNotFoundError(f"resume_from_checkpoint={resume!r}: no such checkpoint directory")
    # the last checks, then the first writes: output_dir is created and locked only for a run
    # that passed every check above (a refused run leaves it as it was)
    run_lock.check_writable(cfg.output_dir, cfg.metrics_path)    # every rank, before anything is written
    lock = run_lock.acquire(cfg.output_dir, _rank(), notes)
    pgm = minipar.init(pconf, timeout_s=cfg.ddp_timeout)
    try:
        lifecycle.check_same_config(cfg, pgm)   # launchers given different flags: an error, not a hang
    except ValueError:
        if lock is not None:
            lock.release()
        lifecycle.teardown(pgm, clean=False)
        raise
    return Run(cfg, pgm, num_micro, train_tokens, val_tokens, notes, datasets, tokenizer, lock,
               base_model=base)


def _launch_hint(pconf: ParallelismConfig, world: int, path: str, argv: List[str],
                 default_config: bool) -> str:
    """A launch that fits the sizes asked for: the same arguments, a process count they resolve to."""
    fixed = (pconf.dp_replicate_size or 1) * (pconf.cp_size or 1) * (pconf.tp_size or 1)
    if pconf.dp_shard_size is not None:
        counts = [fixed * pconf.dp_shard_size]
    else:                                               # dp_shard takes the remainder: multiples fit
        below = world // fixed * fixed
        counts = [n for n in (below, below + fixed) if n > 0]
    args = " ".join(([] if default_config else [path]) + list(argv))
    tail = " " + args if args else ""
    launches = " or ".join(f"`torchrun --nproc-per-node {n} train.py{tail}`" for n in counts)
    return f"config {path}; launch {launches}, or change the sizes so that they fit {world} processes"


def _check_base_model(cfg: TrainConfig):
    """Read base_model's headers and match every tensor against the model (meta-built: no memory)."""
    ckpt = HFCheckpoint(cfg.base_model)
    ckpt.check(LlamaForCausalLM(cfg.model, None, device="meta"))
    return ckpt


def _sizes_from_env(cfg: TrainConfig, path: str, default_config: bool, from_cli: set, notes: list) -> set:
    """Apply accelerate's PARALLELISM_CONFIG_{DP_REPLICATE,DP_SHARD,CP,TP,PP}_SIZE to the sizes that
    the command line does not give and an explicit config file does not set; returns the keys set.
    (The command line wins over the variables, the variables over the file's unset keys and over
    the implicit default layout.)"""
    env = {ENV_SIZE_KEYS[k]: v for k, v in ParallelismConfig.from_env().sizes.items() if v is not None}
    if not env:
        return set()
    in_file = set()
    if not default_config:
        in_file = set(read_yaml(path) or {}) & set(SIZE_KEYS)
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
