"""The checks of a loaded config that need more than one key, or a file: every problem at once.

schema.py types each key and its range; here is the rest: a value against another (attention_backend
cudnn with context parallelism, fsdp.wrap against the model family, LoRA on a mixture of experts),
the data files (missing, a directory, empty), a starting LoRA adapter against the model, the
reporting keys' packages. All run before anything is written: a value refused later is refused
after run_setup has created output_dir and taken its lock, which a refused run would leave behind.

check() raises these with what load_config met before (refusals, wrong types, unknown keys) as ONE
error (errors.one_error), which train.py prints as one line, exit 2:

    ValueError: 3 config values are wrong: learning_rate must be > 0, got -1.0; max_grad_norm
    must be >= 0 (0 or null: no clipping), got -1.0; dataset file 'data' is a directory, not a
    file; set `dataset` to a text file (the bundled corpus is data/shakespeare.txt)

What needs the world, the tokenizer or the data (the batch against dp, the model against tp, the
rows of a file) is run_setup's. Pure Python, no collective: every rank refuses alike.
"""
from __future__ import annotations

import importlib.util
from typing import List, Sequence

from minipar.lora import adapter_shapes, add_lora, check_adapter, check_targets
from minipar.pipeline_parallel import check_schedule, chunks_per_rank, split_layers
from minipar.regional_compile import check_compile
from minipar.trainer.config.errors import one_error
from minipar.trainer.data.batches import DATASET_IS, check_data_file
from minipar.trainer.data.datasets import check_entries
from minipar.trainer.data.preference import check_pair_entries
from minipar.trainer.data.sources import check_source
from minipar.trainer.data.stream import stream_problems
from models.activation_checkpoint import check_option
from models.hf_config import DECODER_LAYERS
from models.llama import LlamaForCausalLM


def check(cfg, earlier: Sequence = (), unknown: Sequence[tuple] = ()) -> None:
    """Every check across keys that needs no world; raises once, with the problems load_config met
    before (`earlier`: strings or errors) and its unknown keys ((key, valid keys, prefix))."""
    problems: List[Exception] = [e if isinstance(e, Exception) else ValueError(e) for e in earlier]

    def bad(message: str) -> None:
        problems.append(ValueError(message))

    # Axolotl's transformer_layer_cls_to_wrap: the model family's decoder-layer class (Qwen2DecoderLayer,
    # ...), or minipar's own LlamaDecoderLayer, which every family's layer is here
    kind = cfg.model.model_type
    accepted = list(dict.fromkeys([DECODER_LAYERS.get(kind, "LlamaDecoderLayer"), "LlamaDecoderLayer"]))
    if not cfg.fsdp.wrap or any(c not in accepted for c in cfg.fsdp.wrap):
        bad(f"fsdp.wrap: only [{', '.join(accepted)}] units are known (the decoder layer of model_type "
            f"{kind!r}), got {cfg.fsdp.wrap}")
    if cfg.attention_backend == "cudnn" and (cfg.cp_size > 1 or cfg.sample_packing):
        bad("attention_backend cudnn runs only through SDPA at context_parallel_size 1 without "
            "sample_packing (ring attention, Ulysses and packed documents merge blocks by their "
            "log-sum-exp): use auto, flash, efficient or math")
    if cfg.model.vocab_size < 256 and not (cfg.tokenizer_config or cfg.base_model):
        bad(f"model.vocab_size={cfg.model.vocab_size} is smaller than the byte tokenizer's 256")
    if not cfg.datasets and (cfg.sample_packing or cfg.val_set_size):
        bad(f"sample_packing={cfg.sample_packing} and val_set_size={cfg.val_set_size} apply to the "
            f"examples of `datasets`, which is empty: the text file `dataset` is cut into full "
            f"windows already (its split is val_fraction); set `datasets`, or drop these keys")
    moe = cfg.model.num_local_experts > 0
    if cfg.pipeline_overlap_steps:
        why = ([f"pipeline_parallel_size={cfg.pp_size} (there are no stages to overlap; "
                f"set pipeline_parallel_size >= 2)"] if cfg.pp_size < 2 else []) + \
              (["a mixture-of-experts model (its routing metrics are summed over the stages every step; "
                "drop pipeline_overlap_steps)"] if moe else [])
        if why:
            bad("pipeline_overlap_steps: true does not apply with " + " and ".join(why))
    if cfg.moe_capacity_factor is not None and not (moe and cfg.moe_capacity_factor > 0):
        bad(f"moe_capacity_factor={cfg.moe_capacity_factor}: a capacity factor is > 0 and applies to a "
            f"mixture of experts (model_type mixtral or qwen3_moe); null is dropless")
    problems += _data_files(cfg)
    problems += [ValueError(m) for m in stream_problems(cfg)]   # streaming: pretrain only, val a count
    problems += [ValueError(m) for m in _lora(cfg)]
    problems += [ValueError(p) for p in _reporting(cfg)]
    if cfg.gradient_checkpointing not in (False, True):
        problem = check_option(cfg.gradient_checkpointing, cfg.selective_ac_option)
        if problem:
            bad(problem)
    # the backend and mode here; what depends on the sizes a world resolves to, in run_setup.py
    problem = check_compile(cfg.compile is True, cfg.compile_backend, cfg.compile_mode)
    if problem:
        bad(problem)
    one_error(list(unknown), problems)


def _reporting(cfg) -> List[str]:
    """profile_steps against max_steps, and the optional loggers: their packages must be importable
    here, on every rank, not found missing at the first step (after the groups exist)."""
    out = []
    ps = cfg.profile_steps
    if ps is not None:
        if len(ps) != 2 or not 1 <= ps[0] <= ps[1]:
            out.append(f"profile_steps must be [first, last] steps to trace, 1 <= first <= last (e.g. "
                       f"[3, 4]), got {ps}")
        elif cfg.max_steps is not None and ps[1] > cfg.max_steps:
            out.append(f"profile_steps {ps} ends after max_steps {cfg.max_steps}: trace steps up to "
                       f"{cfg.max_steps}")
    if cfg.use_tensorboard and importlib.util.find_spec("tensorboard") is None:
        out.append("use_tensorboard: true needs the tensorboard package, which is not installed: "
                   "pip install -e '.[tensorboard]' (make installs it), or set use_tensorboard: false")
    if cfg.wandb_project and cfg.wandb_mode != "disabled" and importlib.util.find_spec("wandb") is None:
        out.append(f"wandb_project {cfg.wandb_project!r} needs the wandb package, which is not installed: "
                   f"pip install wandb, or remove wandb_project (or set wandb_mode: disabled)")
    return out


def _data_files(cfg) -> List[Exception]:
    """The problems of `dataset` and each `datasets` path: missing, a directory, or empty."""
    out: List[Exception] = []
    checks = [lambda: check_data_file(cfg.dataset, "dataset file", DATASET_IS)]
    if cfg.datasets:
        try:
            entries = (check_pair_entries if cfg.rl else check_entries)(cfg.datasets)   # rl: pairs
            checks += [(lambda e=e: check_source(e)) for e in entries]
        except ValueError as err:           # the list itself is malformed: its paths cannot be read
            out.append(err)
    for run in checks:
        try:
            run()
        except (ValueError, FileNotFoundError) as err:
            out.append(err)
    return out


def _lora(cfg) -> List[str]:
    """The problems of Axolotl's LoRA keys (minipar/lora/), including an adapter directory that
    disagrees with the model: its header is read, and a meta-device model gives the shapes."""
    out: List[str] = []
    quantised = [k for k in ("load_in_4bit", "load_in_8bit") if getattr(cfg, k)]
    if cfg.adapter == "qlora" or quantised:
        said = [f"adapter: {cfg.adapter}"] if cfg.adapter == "qlora" else []
        said += [f"{k}: true" for k in quantised]
        out.append(f"{', '.join(said)}: quantised bases (QLoRA, bitsandbytes' 4/8-bit weights) need GPU "
                   f"kernels minipar does not have; use adapter: lora on a bf16 or fp32 base")
        return out
    if cfg.adapter is None:
        given = [k for k in ("lora_model_dir", "merge_lora") if getattr(cfg, k)]
        if given:
            out.append(f"{', '.join(given)} set without adapter: lora; add adapter: lora, or remove them")
        return out
    if cfg.adapter != "lora":
        return [f"adapter must be lora (or null: train every weight), got {cfg.adapter!r}"]
    if isinstance(cfg.lora_r, bool) or cfg.lora_r < 1:
        out.append(f"lora_r must be an integer >= 1 (the adapters' rank), got {cfg.lora_r}")
    if cfg.lora_modules_to_save:
        out.append(f"lora_modules_to_save {cfg.lora_modules_to_save} is not supported (full trainable "
                   f"copies of those modules); remove it")
    if cfg.tp_async_overlap:
        out.append("tp_async_overlap with adapter: lora: the overlapped column-parallel backward computes "
                   "no adapter; set tp_async_overlap: false")
    if cfg.fsdp.state_dict_type != "SHARDED_STATE_DICT":
        out.append(f"fsdp.state_dict_type {cfg.fsdp.state_dict_type} with adapter: lora: a LoRA checkpoint "
                   f"holds the adapters only, saved as SHARDED_STATE_DICT; remove the key")
    try:
        targets = check_targets(cfg.lora_target_modules, cfg.lora_target_linear,
                                LlamaForCausalLM.lora_targets_of(cfg.model),
                                LlamaForCausalLM.lora_target_modules)
    except ValueError as err:
        return out + [str(err)]
    fused = [t for t in targets if t in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
    if cfg.model.model_type == "phi3" and fused:
        out.append(f"adapter: lora on {fused} of a phi3 model: transformers' Phi-3 fuses them (qkv_proj, "
                   f"gate_up_proj) where minipar keeps them apart, so PEFT could not load the adapter; "
                   f"use lora_target_modules: [o_proj, down_proj], or a full fine-tune")
    if cfg.lora_model_dir and not out:
        model = LlamaForCausalLM(cfg.model, device="meta")
        add_lora(model, targets, cfg.lora_r, cfg.lora_alpha, device="meta")
        try:
            bad = check_adapter(cfg.lora_model_dir, adapter_shapes(model), cfg.lora_r, cfg.lora_alpha)
        except (OSError, ValueError) as err:
            bad = [str(err)]
        if bad:
            out.append(f"lora_model_dir {cfg.lora_model_dir!r} does not fit this model: " + "; ".join(bad))
    return out


def check_pipeline(cfg, pp: int, num_micro: int) -> None:
    """Every pipeline setting that can fail on this world (the schedule against the micro-batch
    count, the layer split; tied embeddings are summed across stages, tied_ends.py), as ONE
    ValueError naming all that do; run_setup's, once the world size and the micro-batch count are
    known. No communication."""
    v = chunks_per_rank(cfg.pipeline_schedule, cfg.pipeline_virtual_stages)
    problems = []
    for one in (lambda: check_schedule(cfg.pipeline_schedule, pp, num_micro, v),
                lambda: split_layers(cfg.model.num_hidden_layers, pp * v, cfg.pipeline_layers)):
        try:
            one()
        except ValueError as err:
            problems.append(str(err))
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        raise ValueError(f"{len(problems)} pipeline settings are wrong: " + "; ".join(problems))
