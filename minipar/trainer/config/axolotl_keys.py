"""Axolotl's boilerplate keys: each one honoured, noted (accepted, no effect here, said once) or
refused (with what to write instead), by one table that the docs list (docs/finetuning.md).

An Axolotl YAML carries keys that mean nothing on a CPU, or that minipar does its own way. Refusing
them as unknown makes a user edit the file 2-4 times before it runs; ignoring them silently hides
a difference. So each key has one row of KEYS:

    honoured   mapped onto minipar's keys (flash_attention: true -> attention_backend: flash), a
               field of the schema (schema.py) with the same meaning (warmup_ratio, saves_per_epoch,
               ...) or a field's alias (cosine_min_lr_ratio for min_lr_ratio)
    noted      accepted; one note line in the run's log says it has no effect here and why
    refused    one problem in the file's ONE error message, with the alternative
    foreign    keys of another tool or of work minipar does not do (deepspeed, plugins): refused with
               their own explanation instead of a misleading "did you mean" (deepspeed -> seed)

fold(data, notes, problems) runs on each source's raw mapping (keys.translate calls it), before
the keys are applied: mapped keys are rewritten, noted keys removed with their note, refused ones
appended to `problems`. An empty value (null, [], {}) of a noted or refused key is the boilerplate
of a template and is accepted without a word. Pure Python, no communication.
"""
from __future__ import annotations

import os
from typing import List

HONOURED, NOTED, REFUSED = "honoured", "noted", "refused"

# key -> (status, what minipar does with it). Keys that are TrainConfig fields are honoured there.
KEYS = {
    # the schedule and the optimizer (keys.py derives the steps once max_steps is known)
    "warmup_ratio": (HONOURED, "warmup_steps = int(warmup_ratio x max_steps), as Axolotl"),
    "warmup_steps": (HONOURED, "a float below 1 is a ratio (warmup_ratio), as Axolotl accepts"),
    "cosine_min_lr_ratio": (HONOURED, "min_lr_ratio (the cosine's floor as a fraction of learning_rate)"),
    "adam_epsilon": (HONOURED, "AdamW's eps"),
    "lr_scheduler": (HONOURED, "cosine, cosine_with_min_lr, linear, constant, constant_with_warmup "
                               "(minipar/optim.py SCHEDULES)"),
    "evals_per_epoch": (HONOURED, "eval_steps = ceil(max_steps / (evals_per_epoch x num_epochs))"),
    "saves_per_epoch": (HONOURED, "save_steps = ceil(max_steps / (saves_per_epoch x num_epochs))"),
    "save_steps": (HONOURED, "null: no periodic saves (only the final one), as 0; unless saves_per_epoch"),
    "eval_steps": (HONOURED, "null: evals_per_epoch decides, or minipar's default"),
    "auto_resume_from_checkpoints": (HONOURED, "true: resume_from_checkpoint: latest"),
    # attention: the kernel choice (context_parallel/kernel_choice.py)
    "flash_attention": (HONOURED, "true: attention_backend flash"),
    "sdp_attention": (HONOURED, "true: attention_backend auto (SDPA picks the kernel)"),
    "attn_implementation": (HONOURED, "flash_attention_2 / flash_attention_3: flash; sdpa: auto; "
                                      "eager: math"),
    "gradient_checkpointing_kwargs": (NOTED, "use_reentrant: minipar's activation checkpointing is "
                                             "always non-reentrant (torch.utils.checkpoint use_reentrant"
                                             "=False)"),
    # data
    "pretraining_dataset": (HONOURED, "local files only: each entry becomes a `datasets` entry of type "
                                      "pretrain (text_column), streamed (streaming: true): read, tokenized "
                                      "and packed as the steps need them, in buffers of "
                                      "streaming_multipack_buffer_size (or pretrain_multipack_buffer_size) "
                                      "documents, pretrain_multipack_attn honoured, max_steps required "
                                      "(minipar/trainer/data/stream.py; streaming: false prepares it once); "
                                      "it replaces `datasets`, as in Axolotl"),
    "pad_to_sequence_len": (NOTED, "minipar's batches are always sequence_len long (padded or packed)"),
    "eval_sample_packing": (NOTED, "evaluation rows are prepared as the training rows (sample_packing)"),
    "special_tokens": (HONOURED, "bos/eos/pad/unk_token and additional_special_tokens added to the "
                                 "tokenizer, the base's embedding (and untied lm_head) resized when it "
                                 "has fewer rows, the model config's ids set "
                                 "(minipar/trainer/data/special_tokens.py)"),
    "tokens": (HONOURED, "added to the tokenizer, the embedding resized as for special_tokens"),
    "added_tokens_overrides": (HONOURED, "{id: text}: the tokenizer's added tokens renamed, ids kept"),
    "resize_token_embeddings_to_32x": (HONOURED, "a resized vocabulary rounded up to a multiple of 32"),
    "mean_resizing_embeddings": (HONOURED, "true: new rows the mean of the old ones; false (Axolotl's "
                                           "default): N(0, initializer_range) (models/resize_vocab.py)"),
    "shrink_embeddings": (HONOURED, "a base vocabulary larger than the tokenizer cut to it"),
    "chat_template": (HONOURED, "tokenizer_default, tokenizer_default_fallback_<name>, jinja "
                                "(chat_template_jinja), or a name: chatml, qwen_25, llama3, mistral_v1, "
                                "mistral_v2v3, mistral_v3_tekken, gemma, gemma3, phi_3, phi_35, phi_4, "
                                "alpaca (minipar/trainer/data/chat_templates.py); saved with the tokenizer"),
    "chat_template_jinja": (HONOURED, "the template of chat_template: jinja (a Jinja string or a file)"),
    "model_type": (HONOURED, "checked against base_model's config.json architectures (AutoModelForCausalLM "
                             "or the family's class); a mismatch is refused (models/hf_classes.py)"),
    "tokenizer_type": (HONOURED, "checked against the tokenizer's class (AutoTokenizer, the family's "
                                 "tokenizer, its Fast form); a mismatch is refused"),
    "is_llama_derived_model": (NOTED, "the family comes from base_model's config.json"),
    # precision and the runtime
    "tf32": (NOTED, "minipar computes in `dtype` (float32 or bfloat16) and does not switch TF32 matmuls "
                    "on; a CPU has no TF32"),
    "strict": (NOTED, "minipar always checks every key (unknown keys are refused)"),
    "loss_watchdog_threshold": (NOTED, "no loss watchdog: a non-finite loss stops the run"),
    "loss_watchdog_patience": (NOTED, "no loss watchdog: a non-finite loss stops the run"),
    "save_only_model": (NOTED, "checkpoints keep the optimizer state so a resume is exact; the model "
                               "alone is <output_dir>/hf (export_hf)"),
    "save_safetensors": (NOTED, "checkpoints and hf/ are always safetensors"),
    "group_by_length": (NOTED, "rows are drawn in the sampler's seeded order"),
    "debug": (NOTED, "no debug mode"),
    "local_rank": (NOTED, "the rank comes from torchrun's environment"),
    "hf_use_auth_token": (NOTED, "minipar reads local directories only"),
    "hub_model_id": (NOTED, "nothing is pushed to the Hub; the model is written to <output_dir>/hf"),
    "hub_strategy": (NOTED, "nothing is pushed to the Hub"),
    "wandb_watch": (NOTED, "gradients and parameters are not logged as wandb histograms"),
    "wandb_log_model": (NOTED, "the model is not uploaded as a wandb artifact; it is written to "
                               "<output_dir>/hf"),
    "wandb_run_id": (NOTED, "the run's wandb id is wandb's own (wandb_name names it)"),
    "logging_dir": (NOTED, "TensorBoard event files go to <output_dir>/runs"),
    # refused: an option minipar has no code for
    "lr_scheduler_kwargs": (REFUSED, "use min_lr_ratio (cosine_min_lr_ratio) and warmup_steps"),
    "xformers_attention": (REFUSED, "use attention_backend (flash | efficient | math | auto)"),
    "s2_attention": (REFUSED, "no shifted-sparse attention; use attention_backend"),
    "early_stopping_patience": (REFUSED, "no early stopping; set max_steps"),
    "unfrozen_parameters": (REFUSED, "train every weight (adapter: null) or LoRA (adapter: lora)"),
}

# keys of another tool or of work minipar does not do: refused with their own explanation
FOREIGN = {
    "deepspeed": "DeepSpeed is not used: minipar's ZeRO-3 is fsdp_version: 2 with dp_shard_size "
                 "(ZeRO-1/2: dp_replicate_size, ZeRO-3: dp_shard_size); remove `deepspeed`",
    "plugins": "Axolotl's plugins (liger, cut cross-entropy, ...) are Axolotl's code; remove `plugins`",
    "fp16": "fp16 mixed precision is not supported: use bf16: true (or dtype: float32)",
    "gptq": "GPTQ-quantised bases need GPU kernels minipar does not have; use a bf16 or fp32 base",
    "peft_use_dora": "DoRA is not supported; use adapter: lora",
    "relora_steps": "ReLoRA is not supported; use adapter: lora",
}

# attn_implementation -> attention_backend
ATTN_IMPLEMENTATIONS = {"flash_attention_2": "flash", "flash_attention_3": "flash", "sdpa": "auto",
                        "eager": "math", "flex_attention": "auto"}


def _empty(value) -> bool:
    return value is None or value == [] or value == {} or value is False


def _attention(data: dict, notes: List[str], problems: List[str]) -> None:
    """flash_attention / sdp_attention / attn_implementation -> attention_backend (the one key)."""
    asked = {}
    if data.pop("flash_attention", None):
        asked["flash_attention: true"] = "flash"
    if data.pop("sdp_attention", None):
        asked["sdp_attention: true"] = "auto"
    impl = data.pop("attn_implementation", None)
    if impl is not None:
        if impl not in ATTN_IMPLEMENTATIONS:
            problems.append(f"attn_implementation {impl!r} is not known; use one of "
                            f"{', '.join(ATTN_IMPLEMENTATIONS)} or attention_backend")
        else:
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


def fold(data: dict, notes: List[str], problems: List[str]) -> dict:
    """A copy of one source's mapping with Axolotl's boilerplate folded into minipar's keys: mapped
    keys rewritten, noted keys removed (one note each), refused and foreign keys in `problems`."""
    data = dict(data)
    _attention(data, notes, problems)
    _pretraining(data, notes, problems)
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
    for key in [k for k in data if k in FOREIGN]:
        value = data.pop(key)
        if not _empty(value):
            problems.append(f"{key}: {FOREIGN[key]}")
    for key in [k for k in data if k in KEYS and KEYS[k][0] in (NOTED, REFUSED)]:
        value = data.pop(key)
        status, why = KEYS[key]
        if _empty(value):
            continue
        if status == NOTED:
            notes.append(f"{key}: {value!r} has no effect here: {why}")
        else:
            problems.append(f"{key} is not supported: {why}")
    return data


def table() -> List[tuple]:
    """(key, status, what minipar does) rows, the foreign keys as refused: for the docs."""
    return [(k, s, w) for k, (s, w) in KEYS.items()] + [(k, REFUSED, w) for k, w in FOREIGN.items()]
