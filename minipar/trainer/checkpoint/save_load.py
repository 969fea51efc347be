"""Checkpoints: save a 4D-parallel run, resume it exactly, on the same layout or on another one.

What a rank holds is a list of SEGMENTS: contiguous runs of the TP-local flat view of a named (HF)
parameter (a ZeRO-3 flat shard is one segment per tensor it overlaps). layout.py builds
them, rebuilds FULL tensors from them and cuts any other layout out of those; the same segments
place the parameter and every optimizer state shaped like it, so one mechanism moves all of them:

    SHARDED_STATE_DICT  each rank writes shards/rank-R.pt: its segments and local tensors. One copy
                        of each distinct shard: dp_cp rank 0 for plain/TP models (replicated over
                        dp and cp), dp_replicate rank 0 under ZeRO-3 (distinct over dp_shard_cp).
    FULL_STATE_DICT     the full model (HF names) and optimizer states are gathered as the model
                        gathers its weights; rank 0 writes model.safetensors + optimizer.pt.
    loading (either)    every rank reads the files, rebuilds FULL tensors by name (concatenated
                        over tp along tp_split_dim), and cuts its own layout with local_from_full():
                        saved on 2x2x2, resumed on 4x1x2 or on one process, with or without ZeRO-3.
    pipeline stages     a stage's layers carry their global HF names (model.layers.6...), so each
                        stage writes its own shards and loading is the same; the manifest lists the
                        whole model (stage.full_param_shapes). FULL_STATE_DICT gathers over pp too.

    step-N/  manifest.json   trainer_state.pt (step, scheduler, extra, optimizer hyper-parameters)
             rng/rank-R.pt (every rank)   shards/rank-R.pt  or  model.safetensors + optimizer.pt

Communication: a save costs a broadcast of the temporary directory's name and two status
all-reduces (barriers that also tell every rank whether any rank failed); FULL_STATE_DICT adds the
gathers of the model and of each optimizer state (an all-gather of the model's size per tensor
kind), each full tensor moved to the host as it is gathered (the device holds one at a time, plus
one ZeRO-3 unit), and under pp the stages' tensors handed over one at a time (stage.py
stream_over_stages). A load costs one status all-reduce: every rank checks the files itself
first, so all refuse a damaged checkpoint together and none is left waiting in a collective.
Atomicity, the manifest and the checksums are atomic.py and verify.py. The scheme is
torch.distributed.checkpoint's (save local shards with their global placement, reshard at load)
in miniature; ZeRO-3 is Rajbhandari et al. (2020). Each loading rank holds the full model and
optimizer in CPU memory for a moment: simple and fine at minipar's sizes, where DCP would read
only the overlapping pieces.
"""
from __future__ import annotations

import copy
import os
import shutil
import time
from typing import Callable, Optional, Tuple

import torch
from safetensors.torch import load_file, save

from minipar.lora import adapter_config, full_adapters, merge, save_adapter
from minipar.lora.peft_format import OURS
from minipar.optim import resume_group
from minipar.pipeline_parallel.stage import gather_over_stages
from minipar.trainer.checkpoint import atomic as cio
from minipar.trainer.checkpoint import files as ck_files
from minipar.trainer.checkpoint import verify as ck_verify
from minipar.trainer.checkpoint.layout import (
    _local_records,
    _param_shapes,
    _tensors,
    full_optimizer_state,
    local_from_full,
    merge_records,
)
from models.hf_checkpoint import TOKENIZER_FILES, save_pretrained
from models.hf_shards import MAX_SHARD_BYTES
from models.resize_vocab import VOCAB_PARAMS

STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
TRAINER_STATE, FULL_MODEL, FULL_OPTIM = "trainer_state.pt", "model.safetensors", "optimizer.pt"


def _device(model) -> torch.device:
    return next(iter(model.parameters())).device


def _writes_shards(model, pgm) -> bool:
    """One copy of each distinct shard: coordinate 0 of the dims the shards are replicated over."""
    return (pgm.dp_replicate if getattr(model, "zero3", None) is not None else pgm.dp_cp).rank == 0


# -------------------------------------------------------------------------------------- save
def save_checkpoint(directory: str, model, optimizer, pgm, *, step: int, scheduler=None,
                    extra: Optional[dict] = None, state_dict_type: str = "SHARDED_STATE_DICT",
                    keep_last: Optional[int] = None) -> str:
    """Write the run's state into `directory` (output_dir/step-N) atomically; returns it. Collective.
    keep_last: afterwards keep only the newest `keep_last` step-N siblings whose checksums hold (None
    or 0: all; never fewer than this one and the newest good one: atomic.rotate_checkpoints).
    An OS error (a full disk) raises atomic.CheckpointWriteError on every rank."""
    write, manifest = prepare_save(directory, model, optimizer, pgm, step=step, scheduler=scheduler,
                                   extra=extra, state_dict_type=state_dict_type)
    return cio.atomic_save(directory, pgm, _device(model), write, manifest, keep_last)


def prepare_save(directory: str, model, optimizer, pgm, *, step: int, scheduler=None,
                 extra: Optional[dict] = None, state_dict_type: str = "SHARDED_STATE_DICT",
                 to_host: Optional[Callable] = None) -> Tuple[Callable[[str], dict], Callable[[], dict]]:
    """(write(tmp), manifest()) for atomic.atomic_save; checks the arguments and runs FULL_STATE_DICT's
    gathers first. to_host None (save_checkpoint): write() reads the live model when it runs.
    to_host given (async_save.py): every tensor this rank writes is copied with it NOW, and the
    trainer state, RNG and manifest fields are taken now too, so that write() and manifest() read
    only those copies and may run in another thread while training changes the model."""
    if state_dict_type not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={state_dict_type!r}: use one of {STATE_DICT_TYPES}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict (data position, config, ...), got {type(extra).__name__}")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"checkpoint path {directory} exists and is not a directory")
    full, now = state_dict_type == "FULL_STATE_DICT", to_host is not None
    keep = copy.deepcopy if now else (lambda x: x)
    if full:                                     # the collectives come first: nothing can fail before them
        # each full tensor to the host as it is gathered: the device never holds the whole model
        model_full = {n: to_host(t) if now else t.detach().cpu().contiguous()
                      for n, t in model.full_state_items()}
        optim_full = full_optimizer_state(model, optimizer, pgm) if optimizer is not None else None
        pp = getattr(pgm, "pp", None)
        if pp is not None and pp.size > 1 and optim_full is not None:   # each stage has its layers' states
            kinds = {k: gather_over_stages(v, pgm) for k, v in optim_full[0].items()}
            optim_full = (kinds, gather_over_stages(optim_full[1], pgm))
        if now and optim_full is not None:       # (on one process these may be the optimizer's own)
            optim_full = ({k: {n: to_host(t) for n, t in v.items()} for k, v in optim_full[0].items()},
                          copy.deepcopy(optim_full[1]))

    def state() -> dict:                         # what this rank writes, on the host
        rank = pgm.global_rank
        records = (_local_records(model, optimizer, pgm, *([to_host] if now else []))
                   if not full and _writes_shards(model, pgm) else [])
        out = dict(rng=ck_files.rng_state(), records=records)
        if rank == 0:
            groups = None if optimizer is None else [{k: keep(v) for k, v in g.items() if k != "params"}
                                                     for g in optimizer.param_groups]
            out["trainer"] = dict(step=step, extra=keep(extra), param_groups=groups,
                                  scheduler=keep(scheduler.state_dict()) if scheduler is not None else None)
            out["manifest"] = dict(
                step=step, state_dict_type=state_dict_type, torch=torch.__version__,
                layout=dict(pgm.config.sizes, world_size=pgm.world_size, zero3=hasattr(model, "zero3"),
                            sequence_parallel=pgm.config.sequence_parallel),
                model_config=ck_files.config_dict(model), params=_param_shapes(model, pgm),
                optimizer=type(optimizer).__name__ if optimizer is not None else None,
                optimizer_groups=len(optimizer.param_groups) if optimizer is not None else 0)
        return out

    taken = None
    if now:
        try:
            taken = state()
        except Exception as e:                   # noqa: BLE001 - raised by write(), where every rank learns
            taken = e

    def write(tmp: str) -> dict:
        got = taken if now else state()
        if isinstance(got, Exception):
            raise got
        rank = pgm.global_rank
        entries = cio.write_file(tmp, f"rng/rank-{rank:05d}.pt", ck_files.to_bytes(got["rng"]))
        if got["records"]:                       # (none: LoRA's frozen shards, adapters written by another)
            shard = dict(rank=rank, coords=pgm.coords, records=got["records"])
            entries.update(cio.write_file(tmp, f"shards/rank-{rank:05d}.pt", ck_files.to_bytes(shard)))
        if rank != 0:
            return entries
        entries.update(cio.write_file(tmp, TRAINER_STATE, ck_files.to_bytes(got["trainer"])))
        if not now:
            fields[0] = got["manifest"]
        if full:
            entries.update(cio.write_file(tmp, FULL_MODEL, save(model_full, metadata={"format": "pt"})))
            if optim_full is not None:
                optim = ck_files.to_bytes(dict(state=optim_full[0], scalars=optim_full[1]))
                entries.update(cio.write_file(tmp, FULL_OPTIM, optim))
        return entries

    fields = [taken.get("manifest") if isinstance(taken, dict) else None]   # (rank 0's)

    def manifest() -> dict:                      # rank 0, after every rank's files are on disk
        return dict(fields[0], created=time.time())

    return write, manifest


# -------------------------------------------------------------------------------------- load
def load_checkpoint(directory: str, model, optimizer, pgm, *, scheduler=None) -> Optional[dict]:
    """Restore model, optimizer, scheduler and RNG from `directory` (saved on any layout, either
    state dict type); returns the saved `extra`. Collective. A damaged, partial or foreign
    checkpoint is refused on every rank with a ValueError that names the file or the fields."""
    error = manifest = None
    try:                                         # every check, before any communication
        manifest = ck_verify.verify(directory)
        ck_verify.remember_verified(directory, manifest)   # hashed just now: rotation need not hash it again
        groups = len(optimizer.param_groups) if optimizer is not None else None
        ck_files.check_model(directory, manifest, ck_files.config_dict(model), _param_shapes(model, pgm),
                             groups)
    except Exception as e:                       # noqa: BLE001 - every rank learns of it below
        error = e
    if cio.agree(error is not None, pgm, _device(model)):
        raise error or ValueError(f"checkpoint {directory} was refused on another rank (see its error)")
    files = manifest["files"]
    if manifest["state_dict_type"] == "FULL_STATE_DICT":
        full, scalars = {"param": load_file(os.path.join(directory, FULL_MODEL))}, {}
        if FULL_OPTIM in files:
            saved = ck_files.load(os.path.join(directory, FULL_OPTIM))
            full.update(saved["state"])
            scalars = saved["scalars"]
    else:
        shards = [ck_files.load(os.path.join(directory, f)) for f in files if f.startswith("shards/")]
        full, scalars = merge_records([r for s in shards for r in s["records"]], source=directory)
    with torch.no_grad():
        for p, t in local_from_full(model, pgm, full["param"], source=directory).items():
            p.copy_(t)
    trainer = ck_files.load(os.path.join(directory, TRAINER_STATE))
    if optimizer is not None:
        _load_optimizer(model, optimizer, pgm, full, scalars, trainer["param_groups"], directory)
    if scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    rng = f"rng/rank-{pgm.global_rank:05d}.pt"    # a rank the saving run did not have takes rank 0's
    ck_files.set_rng_state(ck_files.load(os.path.join(directory,
                                                      rng if rng in files else "rng/rank-00000.pt")))
    return trainer["extra"]


def _load_optimizer(model, optimizer, pgm, full, scalars, groups, source):
    """Cut each optimizer state like the parameters and hand torch's load_state_dict the result."""
    shapes = _param_shapes(model, pgm)
    local = {k: local_from_full(model, pgm, {n: v.get(n, torch.zeros(shapes[n])) for n in shapes}, source)
             for k, v in full.items() if k != "param"}
    names, state = {p: [n for n, _ in carried] for p, _, carried in _tensors(model, pgm)}, {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        sc = next((scalars[n] for n in names.get(p, []) if n in scalars), None)
        if sc is not None:                       # tensors never stepped keep no state
            state[i] = {k: v[p] for k, v in local.items()}
            state[i].update({k: torch.tensor(v, dtype=torch.float32) for k, v in sc.items()})
    sd, first = dict(state=state, param_groups=[]), 0
    for saved, g in zip(groups, optimizer.param_groups):    # (or another optimizer's: resume_group)
        ids = list(range(first, first + len(g["params"])))
        sd["param_groups"].append(dict(resume_group(g, saved), params=ids))
        first += len(g["params"])
    optimizer.load_state_dict(sd)


# ------------------------------------------------------------------------------------ export
def export_hf(directory: str, model, tokenizer_dir: Optional[str] = None, full: Optional[dict] = None,
              max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
    """A Hugging Face directory (config.json + model.safetensors, or shards of at most
    max_shard_bytes and their index) for transformers' LlamaForCausalLM.from_pretrained, with the
    tokenizer files of `tokenizer_dir` (the base model's) copied next to it; `full`: these full
    tensors instead of the model's (a merged LoRA model). Collective: every rank calls it; global
    rank 0 writes, each tensor as it is gathered (models/hf_shards.py)."""
    save_pretrained(model, directory, full, max_shard_bytes)
    if tokenizer_dir and model.pgm.global_rank == 0:
        copy_tokenizer(tokenizer_dir, directory)
    cio.agree(False, model.pgm, _device(model))  # the files exist when any rank returns
    return directory


def copy_tokenizer(src: str, directory: str) -> list:
    """Copy the tokenizer files of a Hugging Face directory (whichever exist) into `directory`."""
    copied = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
    for f in copied:
        shutil.copyfile(os.path.join(src, f), os.path.join(directory, f))
    return copied


def export_lora(cfg, model, targets, base=None) -> list:
    """A LoRA run's output, as Axolotl leaves it: PEFT's adapter directory in output_dir
    (adapter_config.json, adapter_model.safetensors), and with merge_lora <output_dir>/merged, the
    plain model W0 + (alpha / r) B A. Collective (gathers over tp, pp, and the ZeRO-3 shards for the
    merge); returns the directories written. `base`: the run's HFCheckpoint; a vocabulary it resized
    goes into the adapter file too (peft_format.py), read by rank 0 from the base, since the frozen
    rows are exactly what every rank loaded."""
    pgm = model.pgm
    adapters = full_adapters(model, pgm)
    if pgm.global_rank == 0:
        save_adapter(cfg.output_dir, adapters, adapter_config(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout,
                                                              targets, cfg.base_model),
                     base=resized_vocab(base, pgm.tp))
    cio.agree(False, pgm, _device(model))
    if not cfg.merge_lora:
        return [cfg.output_dir]
    merged_dir = os.path.join(cfg.output_dir, "merged")
    export_hf(merged_dir, model, full=merged_items(model.full_state_items(), adapters,
                                                   cfg.lora_alpha / cfg.lora_r))
    return [cfg.output_dir, merged_dir]


def resized_vocab(base, tp) -> Optional[dict]:
    """{HF name: full tensor} of the vocabulary tensors a base checkpoint resized (embed_tokens, an
    untied lm_head), as its weight source gives them; None when nothing was resized."""
    if base is None or getattr(base, "vocab_resize", None) is None:
        return None
    source, c = base.source(tp, "cpu"), base.config
    names = VOCAB_PARAMS if not c.tie_word_embeddings else VOCAB_PARAMS[:1]
    return {n: source.tp_local(n, (c.vocab_size, c.hidden_size), None) for n in names}


def merged_items(items, adapters: dict, scaling: float):
    """The merged model W0 + scaling B A one (HF name, full tensor) at a time, from the model's
    items (adapters left out): lora's merge, applied to each base weight as it is gathered."""
    for name, t in items:
        if ".lora." in name:
            continue
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        pair = {f"{module}{OURS}{x}": adapters.get(f"{module}{OURS}{x}") for x in "AB"}
        if module is not None and None not in pair.values():
            t = merge({name: t.cpu()}, pair, scaling)[name]     # (the adapters are on the host)
        yield name, t
        del t
