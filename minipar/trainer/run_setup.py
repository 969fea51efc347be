"""From the command line to a checked run: config, model, layout, batch, data, then the process groups.

Everything that can be checked without communicating is checked here, on every rank, before
minipar.init creates a single group, so a mistake is the same clear error everywhere, never a hang.
setup_run is these steps, in this order, each one function below:

    1. load_config     the YAML file + `--key value` overrides: Axolotl's names mapped (keys.py),
                       keys, types and ranges (pydantic: schema.py, errors.py), then the checks
                       across keys and the data files, all wrong ones in one error (check.py)
                                                                                  train_config.py
    2. _check_base_model  base_model's weight headers against its config.json  models/hf_checkpoint.py
    3. _tokenizer      the tokenizer, its added tokens and chat template; a model from scratch
                       takes its vocabulary, a base model's is resized to it   data/special_tokens.py
                       (run_vocabulary: this step alone, for the planner, which reads no weights)
    4. _layout         the sizes: the command line's, then accelerate's PARALLELISM_CONFIG_*_SIZE
                       variables for the sizes neither it nor the config file sets; without a
                       config file they replace the default layout; a world of one runs any config
                       with all sizes 1. Then cfg.parallelism() -> ParallelismConfig, resolved
                       against the world, checked against the model and the sequence  config.py
    5. _batch          global = micro x accumulation x dp (keys.py); the pipeline's split and
                       schedule against the micro-batches; rl: dpo's pairs whole on every rank
                       (global_batch_size counts pairs: dpo_step.check_pair_split) config/check.py
    6. _data           rl: dpo's preference pairs (data/preference.py, read at each start), or
                       the `datasets` rows (tokenized once, then loaded from dataset_prepared_path:
                       prepared.py, packing.py), or streamed (pretraining_dataset: data/stream.py,
                       nothing read but the held-out head), or the byte corpus; max_steps from
                       num_epochs
    7. _claim_output   the checkpoint to resume from exists; only now the first writes: output_dir
                       created and checked writable, and no live run holding it (rank 0 locks it,
                       released when the process ends)                            run_lock.py
    8. _groups         minipar.init(layout): the groups (mesh.py); the same resolved config on
                       every rank? (one all-gather)                               lifecycle.py

The tp size's path: the YAML's tensor_parallel_size (or tp_size) -> TrainConfig.tp_size (the
schema's alias) -> cfg.parallelism() -> ParallelismConfig.resolve -> minipar.init -> pgm.tp.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

import minipar
from minipar import ParallelismConfig
from minipar.config_files import read_yaml
from minipar.context_parallel import check_ulysses
from minipar.dpo_step import check_pair_split
from minipar.regional_compile import check_compile
from minipar.trainer import lifecycle, run_lock
from minipar.trainer.config import keys as config_keys
from minipar.trainer.config.check import check_pipeline
from minipar.trainer.config.train_config import REPO_ROOT, TrainConfig, load_config, parse_overrides
from minipar.trainer.data import batches as mdata
from minipar.trainer.data.packing import prepare as prepare_datasets
from minipar.trainer.data.preference import prepare_pairs
from minipar.trainer.data.prepared import load_or_prepare
from minipar.trainer.data.special_tokens import (
    changes_tokenizer,
    model_token_ids,
    resize_base_vocab,
    run_tokenizer,
)
from minipar.trainer.data.stream import open_stream
from minipar.trainer.data.tokenizer import (
    HFTokenizer,
    fill_special_token_ids,
    padded_vocab_size,
    tokenizer_path,
)
from models.hf_checkpoint import HFCheckpoint
from models.llama import LlamaForCausalLM

# the grid's sizes (ParallelismConfig's names, and the training config's); ep_size adds no ranks
SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "pp_size")
DEFAULT_CONFIG = os.path.join(REPO_ROOT, "configs", "default.yaml")


@dataclass
class Run:
    cfg: TrainConfig
    pgm: object
    num_micro_steps: int
    train_tokens: torch.Tensor
    val_tokens: torch.Tensor
    notes: List[str] = field(default_factory=list)
    datasets: Optional[object] = None     # packing.DatasetRun (stream.StreamRun when streamed) for `datasets`
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
    """Parse and check everything, then create the process groups (the module's steps 1-8, in
    order). Raises before any collective."""
    path, default_config = DEFAULT_CONFIG, True
    if argv and not argv[0].startswith("--"):
        path, argv, default_config = argv[0], argv[1:], False
    notes = []
    cfg = load_config(path, argv, notes)                                      # 1
    # before the tokenizer is loaded from the same directory and before output_dir is created:
    # a damaged weight file is one line
    base = _check_base_model(cfg) if cfg.base_model else None                 # 2
    tokenizer = _tokenizer(cfg, notes, base)                                  # 3
    pconf = _layout(cfg, path, argv, default_config, notes, base)             # 4
    num_micro = _batch(cfg, pconf)                                            # 5
    datasets, train_tokens, val_tokens = _data(cfg, tokenizer, notes)         # 6
    lock = _claim_output(cfg, notes)                                          # 7
    pgm = _groups(cfg, pconf, lock)                                           # 8
    return Run(cfg, pgm, num_micro, train_tokens, val_tokens, notes, datasets, tokenizer, lock,
               base_model=base)


def _check_base_model(cfg: TrainConfig):
    """Read base_model's headers and match every tensor against the model (meta-built: no memory)."""
    ckpt = HFCheckpoint(cfg.base_model)
    ckpt.check(LlamaForCausalLM(cfg.model, None, device="meta"))
    return ckpt


def _tokenizer(cfg: TrainConfig, notes: list, base: Optional[HFCheckpoint] = None):
    """The run's tokenizer, with the file's special_tokens, tokens and chat template
    (data/special_tokens.py); a model from scratch takes its vocabulary (padded so any tp up to 64
    divides it), a base model's embedding is resized to the tokens added (models/resize_vocab.py),
    and the exported config.json takes the bos/eos/pad ids."""
    tokenizer = run_tokenizer(cfg, notes)
    if isinstance(tokenizer, HFTokenizer) and base is not None:
        resize_base_vocab(cfg, tokenizer, base, notes)
    model_token_ids(cfg.model, tokenizer, cfg.special_tokens)   # the file's bos/eos/pad win
    if isinstance(tokenizer, HFTokenizer) and not getattr(cfg, "base_model", None):
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
    return tokenizer


class _SizeOnly:
    """base_model as step 3 sees it when no model is built: the resize it is asked for is kept (its
    size), its rows never made (no weight is read)."""
    vocab_resize = None

    def resize_vocab(self, resize) -> None:
        self.vocab_resize = resize


def run_vocabulary(cfg: TrainConfig, notes: list) -> None:
    """Step 3 for a reader that builds no model (the planner: minipar/trainer/prediction.py's
    read_train_config): cfg.model's vocab_size and token ids as the run sets them, from the tokenizer
    alone: a model from scratch takes the tokenizer's (padded), a base model's is resized to the
    tokens added (special_tokens, tokens), by the same code as the run. A base_model directory with
    no tokenizer to read (a config.json downloaded to plan with) keeps config.json's size, said in
    `notes`, where the file adds no token; with tokens to add the run's own error is raised."""
    try:
        _tokenizer(cfg, notes, _SizeOnly() if cfg.base_model else None)
    except (ValueError, OSError) as err:
        if cfg.tokenizer_config or changes_tokenizer(cfg):
            raise
        notes.append(f"the tokenizer of base_model {cfg.base_model} was not read ({err}): planned with its "
                     f"config.json's vocab_size {cfg.model.vocab_size}, which a run keeps unless the "
                     f"tokenizer has more tokens")


def _layout(cfg: TrainConfig, path: str, argv: List[str], default_config: bool,
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
    world = _world_size()
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


def _batch(cfg: TrainConfig, pconf: ParallelismConfig) -> int:
    """The micro-batches per step: global = micro x accumulation x dp; with pipeline stages, the
    split and the schedule checked against them, before any group exists."""
    dp = pconf.dp_replicate_size * pconf.dp_shard_size
    num_micro = config_keys.resolve_batch(cfg, dp)
    if cfg.rl:                            # pairs: 2 rows each, a pair never split over ranks (dpo_step.py)
        check_pair_split(2 * cfg.global_batch_size, SimpleNamespace(dp=SimpleNamespace(size=dp)), num_micro)
    if pconf.pp_size > 1:
        check_pipeline(cfg, pconf.pp_size, num_micro)
    return num_micro


def _data(cfg: TrainConfig, tokenizer, notes: list) -> Tuple[Optional[object], torch.Tensor, torch.Tensor]:
    """(datasets, train tokens, val tokens): the `datasets` rows, tokenized once and then loaded from
    dataset_prepared_path (one writer per node, no collective), or the byte corpus cut into windows;
    then max_steps from num_epochs and the sampler's samples per epoch."""
    datasets = None
    if cfg.rl:                            # preference pairs (data/preference.py), the SFT rows otherwise
        datasets = prepare_pairs(cfg, tokenizer)
        notes.extend(datasets.notes)
        train_tokens = val_tokens = torch.empty(0, dtype=torch.uint8)
    elif cfg.datasets and cfg.streaming:  # read as the steps need it: only the held-out head now
        datasets = open_stream(cfg, tokenizer)
        notes.extend(datasets.notes)
        train_tokens = val_tokens = torch.empty(0, dtype=torch.uint8)
    elif cfg.datasets:
        progress = int(os.environ.get("RANK", 0)) == 0
        datasets = load_or_prepare(cfg, tokenizer, prepare_datasets, progress=progress)
        notes.extend(datasets.notes)
        train_tokens = val_tokens = torch.empty(0, dtype=torch.uint8)
    else:
        train_tokens, val_tokens = mdata.load_corpus(cfg.dataset, cfg.val_fraction,
                                                     sequence_len=cfg.sequence_len,
                                                     tokenizer=tokenizer)
    if cfg.num_epochs is not None and not cfg.streaming:   # a stream's epoch length is unknown
        samples = datasets.train.num_rows if datasets is not None else \
            mdata.BatchSampler(len(train_tokens), cfg.sequence_len, cfg.global_batch_size).num_windows
        config_keys.resolve_max_steps(cfg, samples, notes)
    return datasets, train_tokens, val_tokens


def _claim_output(cfg: TrainConfig, notes: list) -> Optional[run_lock.RunLock]:
    """The last check, then the first writes: output_dir is created and locked only for a run that
    passed every check before it (a refused run leaves it as it was)."""
    resume = cfg.resume_from_checkpoint
    if resume and resume != "latest" and not os.path.isdir(resume):
        raise FileNotFoundError(f"resume_from_checkpoint={resume!r}: no such checkpoint directory")
    run_lock.check_writable(cfg.output_dir, cfg.metrics_path)    # every rank, before anything is written
    return run_lock.acquire(cfg.output_dir, _rank(), notes)


def _groups(cfg: TrainConfig, pconf: ParallelismConfig, lock: Optional[run_lock.RunLock]):
    """The process groups, then one all-gather: launchers given different flags are an error, not
    a hang (the lock released and the groups torn down before it is raised)."""
    pgm = minipar.init(pconf, timeout_s=cfg.ddp_timeout)
    try:
        lifecycle.check_same_config(cfg, pgm)
    except ValueError:
        if lock is not None:
            lock.release()
        lifecycle.teardown(pgm, clean=False)
        raise
    return pgm
