"""Axolotl's names for what minipar does, and the values that follow from other values.

An Axolotl YAML should load as it is. Its keys map onto minipar's with their meaning, or are
refused with the values minipar supports; none is silently ignored:

    Axolotl / accelerate                    minipar
    tensor_parallel_size, torch_compile,    tp_size, compile, dpo_beta, min_lr_ratio, ...: the
    rl_beta, cosine_min_lr_ratio, ...         schema's aliases (ALIASES); both names with
                                              different values in one source are refused
    gradient_accumulation_steps  A          global_batch_size G = micro_batch_size M x A x dp
                                            (any two imply the third; three that disagree are
                                             refused, naming all three and dp)
    num_epochs  E                           max_steps = ceil(E x samples per epoch / G)
                                            (an explicit max_steps wins, as in Axolotl; a
                                             streamed dataset needs max_steps)
    bf16: true | false | auto               dtype bfloat16 | float32 | bfloat16 where the GPU has it
    fsdp: [full_shard, auto_wrap]           minipar's ZeRO-3 over dp_shard (FSDP1's list form)
    fsdp_config: {...}                      fsdp: accelerate's names, with or without `fsdp_`:
                                            mapped (FSDP_MAPPED), accepted where they name what
                                            ZeRO-3 does (FSDP_ACCEPTED), noted (FSDP_NO_EFFECT),
                                            offload_params: true refused

translate() runs on each source's raw mapping (YAML file, command line) before pydantic sees it;
resolve() once after, with the keys the user gave; resolve_batch() and resolve_max_steps() in
run_setup once the data-parallel size and the dataset are known. Nothing here communicates.
"""
from __future__ import annotations

import math
import os
from typing import List

from minipar import cuda_env
from minipar.trainer.config.axolotl_keys import fold
from minipar.trainer.config.rl_keys import rl_problems, translate_rl
from minipar.trainer.config.schema import GROUPS

# Axolotl's (and TRL's) name of a setting -> the schema's field (its validation_alias)
ALIASES = {f.validation_alias: name for group in GROUPS for name, f in group.model_fields.items()
           if isinstance(f.validation_alias, str)}
# Axolotl's keys translate() folds itself (no field, no row of axolotl_keys.KEYS)
TRANSLATED = ("fsdp_config",)
SIZE_KEYS = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size", "pp_size", "ep_size")
FSDP_LIST_ITEMS = ("full_shard", "auto_wrap")
# fsdp_config key (without the fsdp_ prefix) -> key of minipar's fsdp mapping (the wrap class: the
# model family's decoder layer, Qwen2DecoderLayer, ..., or LlamaDecoderLayer, all minipar's one class)
FSDP_MAPPED = {"reshard_after_forward": "reshard_after_forward", "state_dict_type": "state_dict_type",
               "transformer_layer_cls_to_wrap": "wrap"}
FSDP_ACCEPTED = {"auto_wrap_policy": ("TRANSFORMER_BASED_WRAP",), "sharding_strategy": ("FULL_SHARD", 1),
                 "backward_prefetch": ("BACKWARD_PRE",)}
FSDP_NO_EFFECT = ("sync_module_states", "use_orig_params", "limit_all_gathers", "cpu_ram_efficient_loading")
FSDP_CONFIG_KEYS = (*FSDP_MAPPED, "offload_params", "activation_checkpointing", "version", *FSDP_ACCEPTED,
                    *FSDP_NO_EFFECT)


def size_keys(data: dict) -> set:
    """The schema's names of the parallel sizes a mapping (a YAML file, the overrides) sets."""
    return {ALIASES.get(k, k) for k in data} & set(SIZE_KEYS)


def translate(data: dict, unknown: list, notes: List[str], problems: List[str]) -> dict:
    """A copy of one source's mapping in the schema's names: Axolotl's boilerplate folded
    (axolotl_keys.py), rl: ipo (rl_keys.py), aliases renamed (tensor_parallel_size -> tp_size; a null
    one is unset, as in Axolotl), and `fsdp_config` (and the list form of `fsdp`) folded into
    minipar's `fsdp` mapping. Unknown fsdp_config keys are appended to `unknown`, refusals to
    `problems` (raised with every other problem of the file at once)."""
    data = translate_rl(fold(dict(data), notes, problems), problems)
    for alias, name in ALIASES.items():
        value = data.pop(alias, None)
        if value is None:
            continue
        if data.get(name) is not None and data[name] != value:
            problems.append(f"{alias}: {value!r} contradicts {name}: {data[name]!r} (two names of one "
                            f"setting, Axolotl's and minipar's); set one of them")
        data[name] = value
    fsdp = data.get("fsdp")
    if isinstance(fsdp, (list, str)):
        items = fsdp.split() if isinstance(fsdp, str) else fsdp
        bad = [i for i in items if i not in FSDP_LIST_ITEMS]
        if "offload" in bad:
            problems.append("fsdp: offload (CPU offload of parameters) is not supported: minipar keeps "
                            "parameters on the device; remove `offload`")
        elif bad:
            problems.append(f"fsdp: {bad} not supported; minipar's ZeRO-3 is {list(FSDP_LIST_ITEMS)} (use "
                            f"fsdp_config.reshard_after_forward: false for SHARD_GRAD_OP, dp_replicate_size "
                            f"for HYBRID_SHARD, dp_shard_size: 1 for none)")
        data.pop("fsdp")
        fsdp = None
    config = data.pop("fsdp_config", None)
    if config is None:
        return data
    if not isinstance(config, dict):
        problems.append(f"fsdp_config must be a mapping of accelerate's FSDP settings, got {config!r}")
        return data
    merged = dict(fsdp) if isinstance(fsdp, dict) else {}
    ignored = []
    for raw_key, value in config.items():
        key = raw_key[len("fsdp_"):] if raw_key.startswith("fsdp_") else raw_key
        if key in FSDP_MAPPED:
            if key == "transformer_layer_cls_to_wrap" and isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            merged[FSDP_MAPPED[key]] = value
        elif key == "offload_params":
            if value not in (False, None):
                problems.append(f"fsdp_config.{raw_key}: {value!r} (CPU offload of parameters) "
                                f"is not supported: minipar keeps parameters and optimizer states "
                                f"on the device; set it to false")
        elif key == "activation_checkpointing":
            if "gradient_checkpointing" in data and data["gradient_checkpointing"] != value:
                problems.append(f"fsdp_config.{raw_key}: {value!r} contradicts gradient_checkpointing: "
                                f"{data['gradient_checkpointing']!r}; set one of them")
            data["gradient_checkpointing"] = value
        elif key == "version":
            data.setdefault("fsdp_version", value)
        elif key in FSDP_ACCEPTED:
            if value not in FSDP_ACCEPTED[key]:
                problems.append(f"fsdp_config.{raw_key}: {value!r} is not supported; minipar's ZeRO-3 does "
                                f"{FSDP_ACCEPTED[key][0]} (for other sharding use dp_replicate_size / "
                                f"dp_shard_size and fsdp_config.reshard_after_forward)")
        elif key in FSDP_NO_EFFECT:
            ignored.append(raw_key)
        else:
            unknown.append((raw_key, list(FSDP_CONFIG_KEYS), "fsdp_config."))
    if ignored:
        notes.append(f"fsdp_config: {', '.join(ignored)} have no effect in minipar "
                     f"(every rank draws the same weights, the optimizer steps the flat shards, "
                     f"the prefetch depth bounds the gathers)")
    data["fsdp"] = merged
    return data


# a fine-tune (base_model set): what Axolotl (through the HF Trainer's TrainingArguments) uses for a
# setting its file leaves out (axolotl/utils/schemas/training.py: weight_decay 0.0, optimizer
# adamw_torch_fused, lr_scheduler cosine, cosine_min_lr_ratio None = down to 0; adam_* None = HF's
# 0.9 / 0.999 / 1e-8; max_grad_norm None = HF's 1.0; core/builders/base.py: warmup
# min(int(0.03 x steps), 100), 1 -> 2). Axolotl requires learning_rate; HF's default is 5e-5.
AXOLOTL_DEFAULTS = dict(learning_rate=5e-5, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
                        adam_epsilon=1e-8, max_grad_norm=1.0, optimizer="adamw_torch_fused",
                        lr_scheduler="cosine", min_lr_ratio=0.0, warmup_steps=None)
OPTIMIZER_KEYS = tuple(AXOLOTL_DEFAULTS)


def resolve(cfg, given, notes: List[str], problems: List[str]) -> None:
    """Axolotl's keys once every source is applied; `given` holds the top-level keys the user set
    (a set, or a dict key -> "file" | "flag" naming where each came from). Problems are appended
    to `problems`, raised by load_config with every other problem of the file."""
    origin = given if isinstance(given, dict) else dict.fromkeys(given, "file")
    if cfg.bf16 not in (None, True, False, "auto"):
        problems.append(f"bf16 must be true, false or auto, got {cfg.bf16!r}")
    elif cfg.bf16 in (True, False):
        want = "bfloat16" if cfg.bf16 else "float32"
        if "dtype" in given and cfg.dtype != want:
            problems.append(f"bf16: {str(cfg.bf16).lower()} contradicts dtype: {cfg.dtype}; set one of them "
                            f"(dtype: {want}, or remove bf16)")
        cfg.dtype = want
    elif cfg.bf16 == "auto" and "dtype" not in given:
        import torch
        if torch.cuda.is_available() and cfg.tp_async_overlap and (cfg.tp_size or 1) > 1:
            # asking the device starts CUDA, and CUDA_DEVICE_MAX_CONNECTIONS counts only before that
            cuda_env.settle(os.environ, tp_async_overlap=True, cuda_started=torch.cuda.is_initialized(),
                            torch_version=torch.__version__)
        cfg.dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
        notes.append(f"bf16: auto -> dtype {cfg.dtype}"
                     + ("" if cfg.dtype == "bfloat16" else " (no GPU with bfloat16 here)"))
    if cfg.warmup_ratio is not None and "warmup_steps" not in given:
        cfg.warmup_steps = None          # derived from the ratio once max_steps is known
    if cfg.base_model:                   # a fine-tune: Axolotl's values for what the file leaves out
        for key, value in AXOLOTL_DEFAULTS.items():
            if key not in given and not (key == "warmup_steps" and cfg.warmup_ratio is not None):
                setattr(cfg, key, value)
                origin[key] = "Axolotl default"
    for per_epoch, steps in (("evals_per_epoch", "eval_steps"), ("saves_per_epoch", "save_steps")):
        if getattr(cfg, per_epoch) is not None and steps in given:
            problems.append(f"{per_epoch}: {getattr(cfg, per_epoch)} and {steps}: {getattr(cfg, steps)} both "
                            f"set how often; keep one (Axolotl refuses both too)")
    # the derived sizes: None until run_setup knows the dp size and the dataset
    if cfg.gradient_accumulation_steps is not None and "global_batch_size" not in given:
        cfg.global_batch_size = None
    if cfg.num_epochs is not None and "max_steps" not in given:
        cfg.max_steps = None
    if cfg.dataset_prepared_path and not cfg.datasets:   # Axolotl configs carry it; said, not refused
        notes.append(f"dataset_prepared_path {cfg.dataset_prepared_path!r} has no effect without `datasets`: "
                     f"the text file `dataset` is read as bytes at each start")
    problems.extend(rl_problems(cfg))     # rl: dpo and its keys (rl_keys.py)
    if cfg.streaming and (cfg.max_steps is None or "max_steps" not in given):   # as Axolotl: no epoch length
        problems.append("max_steps is required with a streamed dataset (pretraining_dataset, or "
                        "streaming: true): its length is not known before training, so num_epochs cannot "
                        "give the steps; set max_steps (or streaming: false to prepare it once)")
    elif cfg.max_steps is None and cfg.num_epochs is None:
        problems.append("max_steps is null: set max_steps, or num_epochs to derive it from the dataset size")
    if cfg.base_model:
        said = ", ".join(f"{k} {_fmt(getattr(cfg, k)) if getattr(cfg, k) is not None else '(derived)'} "
                         f"({origin.get(k, 'minipar default')})" for k in OPTIMIZER_KEYS)
        notes.append(f"a fine-tune of base_model: {said}")
    resolve_schedule(cfg, notes)


def _fmt(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def resolve_schedule(cfg, notes: List[str]) -> None:
    """The steps that follow from max_steps once it is known (at load, or after resolve_max_steps):
    warmup_steps from warmup_ratio (or Axolotl's default for a fine-tune), eval_steps and save_steps
    from evals_per_epoch and saves_per_epoch. Idempotent; nothing while max_steps is unknown."""
    S = cfg.max_steps
    if S is None:
        return
    if cfg.warmup_steps is None:
        if cfg.warmup_ratio is not None:
            cfg.warmup_steps = max(int(cfg.warmup_ratio * S), 0)
            how = f"int(warmup_ratio {cfg.warmup_ratio:g} x max_steps {S})"
        else:                             # Axolotl's default warmup for a fine-tune
            cfg.warmup_steps = min(int(0.03 * S), 100)
            how = f"Axolotl's default min(int(0.03 x max_steps {S}), 100)"
        cfg.warmup_steps = 2 if cfg.warmup_steps == 1 else cfg.warmup_steps   # Axolotl's 1 -> 2
        notes.append(f"warmup_steps = {how} = {cfg.warmup_steps}")
    epochs = cfg.num_epochs or 1.0        # steps per epoch: max_steps / num_epochs (Axolotl's default 1)
    for per_epoch, steps in (("evals_per_epoch", "eval_steps"), ("saves_per_epoch", "save_steps")):
        n = getattr(cfg, per_epoch)
        if n is not None and n >= 1:
            value = max(1, math.ceil(S / (n * epochs)))
            if getattr(cfg, steps) != value:
                setattr(cfg, steps, value)
                notes.append(f"{per_epoch} {n:g}: {steps} = ceil(max_steps {S} / ({n:g} x num_epochs "
                             f"{epochs:g})) = {value}")


def resolve_batch(cfg, dp: int) -> int:
    """Fill in global_batch_size, micro_batch_size and gradient_accumulation_steps from the ones
    given and the data-parallel size; return the number of micro-batches per step. Refuses
    values that cannot hold together, naming them all."""
    G, M, A = cfg.global_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps
    named = f"global_batch_size={G}, micro_batch_size={M}, gradient_accumulation_steps={A}"
    if G is None:
        if M is None:
            raise ValueError(f"{named}: set micro_batch_size (samples per forward per rank) so that "
                             f"global_batch_size = micro_batch_size x gradient_accumulation_steps "
                             f"x dp ({dp})")
        G = M * (A or 1) * dp
    elif M is None and A is None:
        if G % dp:
            raise ValueError(f"global_batch_size {G} is not divisible by the data-parallel size "
                             f"dp_replicate x dp_shard = {dp}; use a multiple of {dp}")
        M, A = G // dp, 1
    elif M is None:
        if G % (A * dp):
            raise ValueError(f"{named}: global_batch_size is not divisible by gradient_accumulation_steps "
                             f"x dp = {A} x {dp} = {A * dp}; change one of them")
        M = G // (A * dp)
    elif A is None:
        if G % (M * dp):
            raise ValueError(f"global_batch_size {G} is not a multiple of micro_batch_size {M} x "
                             f"data-parallel size {dp} = {M * dp}; use a global_batch_size that is a "
                             f"multiple of {M * dp}, or change micro_batch_size")
        A = G // (M * dp)
    elif G != M * A * dp:
        raise ValueError(f"{named} contradict each other: micro_batch_size x gradient_accumulation_steps x "
                         f"dp = {M} x {A} x {dp} = {M * A * dp}, not {G}; give two of the three and the "
                         f"third follows (null derives it, e.g. --global_batch_size null)")
    cfg.global_batch_size, cfg.micro_batch_size, cfg.gradient_accumulation_steps = G, M, A
    return A


def resolve_max_steps(cfg, samples_per_epoch: int, notes: List[str]) -> None:
    """max_steps from num_epochs: ceil(num_epochs x samples per epoch / global batch)."""
    if cfg.num_epochs is None:
        return
    if cfg.max_steps is not None:
        notes.append(f"max_steps {cfg.max_steps} given: num_epochs {cfg.num_epochs:g} is not used "
                     f"(max_steps wins, as in Axolotl; max_steps: null trains by epochs)")
        return
    cfg.max_steps = max(1, math.ceil(cfg.num_epochs * samples_per_epoch / cfg.global_batch_size))
    notes.append(f"num_epochs {cfg.num_epochs:g}: max_steps = ceil({cfg.num_epochs:g} x {samples_per_epoch} "
                 f"samples per epoch / global batch {cfg.global_batch_size}) = {cfg.max_steps}")
    resolve_schedule(cfg, notes)

