"""Axolotl's keys that are not TrainConfig fields: each honoured, noted (accepted, no effect here,
said once) or refused (with what to write instead), by one table that the docs list
(docs/finetuning.md, rendered by axolotl_docs.py).

An Axolotl YAML carries keys that mean nothing on a CPU, or that minipar does its own way. Refusing
them as unknown makes a user edit the file 2-4 times before it runs; ignoring them silently hides
a difference. So every top-level key of Axolotl's schema (tests/data/axolotl_schema_keys.txt) is a
field of schema.py or has one row of KEYS, gathered from the topics of axolotl_table.py and
axolotl_table_run.py (which say what honoured, noted, refused and `accept` mean).

fold(data, notes, problems) runs on each source's raw mapping (keys.translate calls it), before
the keys are applied: honoured keys are rewritten onto minipar's (flash_attention: true ->
attention_backend: flash, bfloat16: true -> bf16: true, eval_strategy: epoch -> evals_per_epoch: 1,
batch_size -> gradient_accumulation_steps, trl.beta -> dpo_beta), and Axolotl's values of minipar's
own keys too (ddp: true, gradient_checkpointing: offload, torch_compile: auto); noted keys are
removed with their note, refused ones appended to `problems`, where load_config raises them with
every other problem of the file as ONE error. An empty value (null, [], {}, false) of a noted or
refused key is a template's boilerplate and says nothing. Pure Python, no communication.
"""
from __future__ import annotations

import os
from typing import List

from minipar.trainer.config import axolotl_table, axolotl_table_run
from minipar.trainer.config.axolotl_table import NOTED, REFUSED

TOPICS = {**axolotl_table.TOPICS, **axolotl_table_run.TOPICS}
KEYS = {key: row for rows in TOPICS.values() for key, row in rows.items()}

# attn_implementation -> attention_backend; the approximate kernels (sage, fp8) are refused
ATTN_IMPLEMENTATIONS = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "auto",
                        "eager": "math", "flex_attention": "auto", "xformers": "auto"}
ATTN_FLAGS = {"flash_attention": "flash", "sdp_attention": "auto", "flex_attention": "auto",
              "xformers_attention": "auto", "eager_attention": "math"}
# Axolotl plugins whose kernels compute the same math as minipar's layers: noted, not refused
KERNEL_PLUGINS = ("LigerPlugin", "CutCrossEntropyPlugin")


def _empty(value) -> bool:
    return value is None or value == [] or value == {} or value is False


def silent(row, value) -> bool:
    """Whether `value` of a noted or refused key is what minipar does anyway (says nothing)."""
    if row.accept is None:
        return _empty(value)
    return value is None or any(type(value) is type(a) and value == a for a in row.accept)


def _attention(data: dict, notes: List[str], problems: List[str]) -> None:
    """flash_attention / sdp_attention / ... / attn_implementation -> attention_backend (the one key)."""
    asked = {f"{k}: true": backend for k, backend in ATTN_FLAGS.items() if data.pop(k, None)}
    impl = data.pop("attn_implementation", None)
    if impl in ("sage", "fp8"):
        problems.append(f"attn_implementation: {impl} is approximate attention (quantised); use "
                        f"attn_implementation: sdpa or flash_attention_2 (exact attention)")
    elif impl is not None and impl not in ATTN_IMPLEMENTATIONS:
        problems.append(f"attn_implementation {impl!r} is not known; use one of "
                        f"{', '.join(ATTN_IMPLEMENTATIONS)} or attention_backend")
    elif impl is not None:
        asked[f"attn_implementation: {impl}"] = ATTN_IMPLEMENTATIONS[impl]
    if not asked:
        return
    backends = set(asked.values())
    if "attention_backend" in data:
        return notes.append(f"{', '.join(asked)}: attention_backend {data['attention_backend']} is set "
                            f"and wins")
    if len(backends) > 1:
        return problems.append(f"{' and '.join(asked)} ask for different attention kernels "
                               f"({', '.join(sorted(backends))}); keep one, or set attention_backend")
    data["attention_backend"] = backends.pop()
    notes.append(f"{', '.join(asked)} -> attention_backend {data['attention_backend']}")


def _pretraining(data: dict, notes: List[str], problems: List[str]) -> None:
    """pretraining_dataset (a path, or a list of {path, text_column, split, name, data_files, ds_type,
    type: pretrain}) -> `datasets` entries of type pretrain, streamed (streaming: true, unless the file
    says streaming: false); Hub names are refused. Axolotl's other pretraining keys fold here too:
    pretrain_multipack_buffer_size (its older name of streaming_multipack_buffer_size), and
    pretraining_sample_concatenation (whole documents concatenated into rows, attention across them:
    packed rows without document ids here)."""
    if data.get("pretrain_multipack_buffer_size") is not None:
        size = data.pop("pretrain_multipack_buffer_size")
        if data.get("streaming_multipack_buffer_size") not in (None, size):
            problems.append(f"pretrain_multipack_buffer_size: {size} and streaming_multipack_buffer_size: "
                            f"{data['streaming_multipack_buffer_size']} disagree; keep "
                            f"streaming_multipack_buffer_size")
        data["streaming_multipack_buffer_size"] = size
    data.pop("pretrain_multipack_buffer_size", None)
    concatenate = data.pop("pretraining_sample_concatenation", None)
    value = data.pop("pretraining_dataset", None)
    if concatenate and _empty(value):
        notes.append("pretraining_sample_concatenation applies to pretraining_dataset only (as in Axolotl)")
    elif concatenate and data.get("sample_packing"):
        notes.append("pretraining_sample_concatenation has no effect with sample_packing (as in Axolotl)")
    elif concatenate:                 # Axolotl's concatenation: whole documents side by side in a row
        data["sample_packing"] = True
        data.setdefault("pretrain_multipack_attn", False)
        notes.append("pretraining_sample_concatenation: true -> sample_packing: true with "
                     "pretrain_multipack_attn: false (whole documents share a row, attention across them)")
    if _empty(value):
        return
    entries = []
    for item in value if isinstance(value, list) else [value]:
        item = dict(path=item) if isinstance(item, str) else dict(item) if isinstance(item, dict) else None
        if item is None or not item.get("path") or not os.path.exists(str(item["path"])):
            where = item.get("path") if item else value
            return problems.append(f"pretraining_dataset: streamed pretraining data from {where!r} is not "
                                   f"read: no such local file or folder (Hub names are not fetched); give "
                                   f"a local path, e.g. pretraining_dataset: [{{path: FILE.jsonl, "
                                   f"text_column: text}}]")
        if item.pop("type", None) not in (None, "pretrain"):
            return problems.append("pretraining_dataset: only type pretrain (plain text) is read")
        if item.pop("skip", None):
            return problems.append("pretraining_dataset: skip is not supported; cut the rows from the file")
        item.pop("trust_remote_code", None)
        entries.append(dict(item, type="pretrain"))
    if data.get("datasets"):
        notes.append("pretraining_dataset replaces `datasets` (as in Axolotl): the `datasets` entries are "
                     "not read")
    data["datasets"] = entries
    data.setdefault("streaming", True)


def _set(data: dict, key: str, value, said: str, problems: List[str]) -> None:
    """data[key] = value for the Axolotl key `said`, unless the file gives key another value."""
    if data.get(key) is not None and data[key] != value:
        problems.append(f"{said} contradicts {key}: {data[key]!r}; set one of them")
    else:
        data[key] = value


def _precision(data: dict, notes: List[str], problems: List[str]) -> None:
    """bfloat16: true (Axolotl's bf16 weights without AMP) -> bf16: true; float32: true -> bf16:
    false where bf16 is not set (bf16 wins in Axolotl's resolve_dtype)."""
    if data.pop("bfloat16", None):
        if data.get("bf16") is False:
            problems.append("bfloat16: true contradicts bf16: false; set one of them")
        else:
            data["bf16"] = True
            notes.append("bfloat16: true -> bf16: true (dtype bfloat16; minipar keeps float32 master "
                         "weights and optimizer states)")
    if data.pop("float32", None):
        if data.get("bf16") is None:
            data["bf16"] = False
        elif data["bf16"] is not False:
            notes.append(f"float32: true has no effect beside bf16: {data['bf16']} (bf16 wins, as in "
                         f"Axolotl)")


def _strategies(data: dict, problems: List[str]) -> None:
    """eval_strategy / evaluation_strategy / save_strategy: steps | epoch | no (HF's names)."""
    for key, steps, per_epoch in (("evaluation_strategy", "eval_steps", "evals_per_epoch"),
                                  ("eval_strategy", "eval_steps", "evals_per_epoch"),
                                  ("save_strategy", "save_steps", "saves_per_epoch")):
        value = data.pop(key, None)
        value = "no" if value is False else value     # YAML reads a bare `no` as false
        if value in (None, "steps"):
            continue
        if value == "epoch":
            _set(data, per_epoch, 1, f"{key}: epoch", problems)
        elif value == "no":
            _set(data, steps, 0, f"{key}: no", problems)
        elif value == "best" and key == "save_strategy":
            problems.append("save_strategy: best keeps the checkpoint of the best eval metric, which "
                            "minipar does not track; use save_strategy: steps with save_steps")
        else:
            problems.append(f"{key} {value!r} is not known; use steps, epoch or no")


def _renamed(data: dict, notes: List[str], problems: List[str]) -> None:
    """Axolotl's other spellings of minipar's keys: type_of_model, sequence_parallel_degree,
    base_model_config (base_model's own), batch_size (per rank), trl.beta."""
    for key, field in (("type_of_model", "model_type"), ("sequence_parallel_degree", "cp_size")):
        value = data.pop(key, None)
        if value is not None:
            if field == "cp_size" and data.get("context_parallel_size") is not None:
                field = "context_parallel_size"
            _set(data, field, value, f"{key}: {value!r}", problems)
    config = data.pop("base_model_config", None)
    if config and os.path.normpath(str(config)) != os.path.normpath(str(data.get("base_model"))):
        problems.append(f"base_model_config {config!r} is not base_model {data.get('base_model')!r}: "
                        f"minipar reads base_model's config.json; copy {config}'s config.json there, or "
                        f"remove base_model_config")
    batch = data.pop("batch_size", None)
    if batch is not None:
        micro = data.get("micro_batch_size")
        if not isinstance(micro, int) or not isinstance(batch, int) or batch % micro:
            problems.append(f"batch_size {batch!r} needs micro_batch_size beside it, a divisor of it "
                            f"(gradient_accumulation_steps = batch_size / micro_batch_size, as Axolotl); "
                            f"or give micro_batch_size and gradient_accumulation_steps instead")
        else:
            _set(data, "gradient_accumulation_steps", batch // micro, f"batch_size: {batch}", problems)
    trl = data.pop("trl", None)
    if trl is not None and not isinstance(trl, dict):
        return problems.append(f"trl must be a mapping (TRL's settings), got {trl!r}")
    if trl and trl.get("beta") is not None:
        key = "rl_beta" if data.get("rl_beta") is not None else "dpo_beta"
        _set(data, key, trl["beta"], f"trl.beta: {trl['beta']!r}", problems)
    grpo = [k for k, v in (trl or {}).items() if k != "beta" and v is not None]
    if grpo:
        notes.append(f"trl: {', '.join(grpo)} have no effect here: options of rl: grpo, which minipar "
                     f"refuses (trl.beta is DPO's beta)")


def _profiler(data: dict, notes: List[str], problems: List[str]) -> None:
    """profiler_steps N from profiler_steps_start S (0-based, as the HF Trainer counts) -> profile_steps
    [S + 1, S + N], minipar's steps counting from 1."""
    n, start = data.pop("profiler_steps", None), data.pop("profiler_steps_start", None) or 0
    if not n:
        return
    if not isinstance(n, int) or not isinstance(start, int) or n < 1 or start < 0:
        return problems.append(f"profiler_steps {n!r} from profiler_steps_start {start!r}: give whole "
                               f"numbers, N >= 1 steps from a start >= 0")
    _set(data, "profile_steps", [start + 1, start + n], f"profiler_steps: {n}", problems)
    notes.append(f"profiler_steps {n} -> profile_steps [{start + 1}, {start + n}]: a torch.profiler trace "
                 f"(<output_dir>/traces), no CUDA memory snapshot")


def _values(data: dict, notes: List[str], problems: List[str]) -> None:
    """Axolotl's values of keys minipar has with other values: ddp: true|false (Axolotl's switch),
    gradient_checkpointing: offload, torch_compile: auto, lora_target_modules: all-linear or a
    regex string, eval_steps / save_steps as a fraction of the run."""
    if isinstance(data.get("ddp"), bool):
        notes.append(f"ddp: {str(data.pop('ddp')).lower()} has no effect here: data parallelism follows the "
                     f"world (ddp: naive | bucketed picks its gradient all-reduce)")
    if data.get("gradient_checkpointing") in ("offload", "offload_disk"):
        notes.append(f"gradient_checkpointing: {data['gradient_checkpointing']} -> true (the checkpointed "
                     f"inputs stay on the device: the same result, more device memory)")
        data["gradient_checkpointing"] = True
    if data.get("torch_compile") == "auto":    # Axolotl's auto: compile from torch 2.5.1 on
        import torch
        data["torch_compile"] = torch.__version__ >= "2.5.1"     # TorchVersion compares as a version
        notes.append(f"torch_compile: auto -> {str(data['torch_compile']).lower()} (torch "
                     f"{torch.__version__}, as Axolotl)")
    targets = data.get("lora_target_modules")
    if targets == "all-linear":
        data.pop("lora_target_modules")
        _set(data, "lora_target_linear", True, "lora_target_modules: all-linear", problems)
    elif isinstance(targets, str):
        problems.append(f"lora_target_modules {targets!r}: a string is a regex over module names in PEFT, "
                        f"which minipar does not match; give a list of projections, e.g. [q_proj, v_proj], "
                        f"or lora_target_linear: true")
    for key, per_epoch in (("eval_steps", "evals_per_epoch"), ("save_steps", "saves_per_epoch")):
        value = data.get(key)
        if isinstance(value, float) and 0 < value < 1:
            data.pop(key)
            problems.append(f"{key}: {value} (a fraction of the run's steps, as the HF Trainer reads it) is "
                            f"not supported; give a number of steps, or {per_epoch}")


def _plugins(data: dict, notes: List[str], problems: List[str]) -> None:
    value = data.pop("plugins", None)
    if _empty(value):
        return
    names = value if isinstance(value, list) else [value]
    others = [p for p in names if str(p).rsplit(".", 1)[-1] not in KERNEL_PLUGINS]
    if others:
        problems.append(f"plugins: {others} are Axolotl's code, not run here; remove them (the kernel "
                        f"plugins {', '.join(KERNEL_PLUGINS)} may stay: the same math)")
    if len(others) < len(names):
        notes.append(f"plugins: {[p for p in names if p not in others]} have no effect here: their GPU "
                     f"kernels compute the same math as minipar's layers")


def fold(data: dict, notes: List[str], problems: List[str]) -> dict:
    """A copy of one source's mapping with Axolotl's keys folded into minipar's: honoured keys
    rewritten, noted keys removed (one note each), refused keys in `problems` (one line each)."""
    data = dict(data)
    _attention(data, notes, problems)
    _pretraining(data, notes, problems)
    _precision(data, notes, problems)
    _strategies(data, problems)
    _renamed(data, notes, problems)
    _profiler(data, notes, problems)
    _plugins(data, notes, problems)
    _values(data, notes, problems)
    warmup = data.get("warmup_steps")
    if isinstance(warmup, float) and 0 < warmup < 1:   # Axolotl reads warmup_steps: 0.1 as a ratio
        data.pop("warmup_steps")
        if data.get("warmup_ratio") is not None:
            problems.append(f"warmup_steps: {warmup} (a ratio) and warmup_ratio: {data['warmup_ratio']} "
                            f"both set the warmup; keep one")
        else:
            data["warmup_ratio"] = warmup
    if data.get("warmup_ratio") is not None and data.get("warmup_steps") is not None:
        problems.append(f"warmup_steps: {data['warmup_steps']} and warmup_ratio: {data['warmup_ratio']} "
                        f"both set the warmup (Axolotl refuses both too); keep one")
    if "save_steps" in data and data["save_steps"] is None:  # null: unset (saves_per_epoch decides),
        data.pop("save_steps")                              # else no periodic saves
        if data.get("saves_per_epoch") is None:
            data["save_steps"] = 0
    if "eval_steps" in data and data["eval_steps"] is None:  # null: unset (evals_per_epoch or the default)
        data.pop("eval_steps")
    if data.pop("auto_resume_from_checkpoints", None) and data.get("resume_from_checkpoint") is None:
        data["resume_from_checkpoint"] = "latest"
    for key in [k for k in data if k in KEYS and KEYS[k].status in (NOTED, REFUSED)]:
        value, row = data.pop(key), KEYS[key]
        if silent(row, value):
            continue
        if row.status == NOTED:
            notes.append(f"{key}: {value!r} has no effect here: {row.why}")
        else:
            problems.append(f"{key}: {row.why}")
    return data
