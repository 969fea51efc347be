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
    4. layout          the sizes: the command line's, then accelerate's PARALLELISM_CONFIG_*_SIZE
                       variables for the sizes neither it nor the config file sets; without a
                       config file they replace the default layout; a world of one runs any config
                       with all sizes 1. Then cfg.parallelism() -> ParallelismConfig, resolved
                       against the world, checked against the model and the sequence  run_layout.py
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

The tp size's path, stop by stop and file by file, is docs/README.md's "One size from the YAML to
the collective": cfg.tp_size (the schema's alias of tensor_parallel_size) -> cfg.parallelism() ->
ParallelismConfig.resolve -> minipar.init -> pgm.tp -> compose.build -> parallelize -> the tp
layers -> f and g -> comm.py. The decoder's layer file (models/llama_layer.py) is not on it: the
group reaches the layers when parallelize swaps them in.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

import minipar
from minipar import ParallelismConfig
from minipar.dpo_step import check_pair_split
from minipar.trainer import lifecycle, run_lock
from minipar.trainer.config import keys as config_keys
from minipar.trainer.config.check import check_pipeline
from minipar.trainer.config.train_config import REPO_ROOT, TrainConfig, load_config
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
from minipar.trainer.run_layout import layout
from models.hf_checkpoint import HFCheckpoint
from models.llama import LlamaForCausalLM

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
    pconf = layout(cfg, path, argv, default_config, notes, base)              # 4
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
