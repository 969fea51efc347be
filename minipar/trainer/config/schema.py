"""The run's keys as pydantic models, in groups as Axolotl's schema has them.

Axolotl validates its YAML with pydantic (axolotl/utils/schemas/: a model per group of keys, the
config inheriting them all); TrainConfig (train_config.py) inherits these groups the same way:
DataKeys, HyperparameterKeys, ParallelKeys (accelerate's ParallelismConfig names, Axolotl's as
aliases), RunKeys, AdapterKeys. A key has Axolotl's name, type and meaning wherever minipar does
what Axolotl does; axolotl_keys.py says what each of Axolotl's other keys does here.

STRICT makes pydantic do what a config needs: extra="forbid" (an unknown key is an error, never
ignored), strict types (2.5 is no integer, 1 no boolean, "3" no number), no inf/nan; pydantic
collects every failure of a mapping, and errors.py words each as one line. A rule sits on its field:

    learning_rate: Number = Field(3e-3, gt=0)        -> learning_rate must be > 0, got -1.0
    ddp: Literal["naive", "bucketed"]                -> ddp must be naive or bucketed, got 'fast'
    tp_size: int = Field(1, ge=1, validation_alias="tensor_parallel_size")   -> both names read
    description="0: never"                           -> the hint after a refused value

Number is a float as people write it: PyYAML leaves 3e-4 (an exponent without a dot) a string, so
it is parsed here. What needs several keys (cudnn without CP, LoRA on a mixture of experts, the
data files) is check.py's.
"""
from __future__ import annotations

import typing
from typing import Annotated, List, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, create_model

from minipar.config import ATTENTION_BACKENDS, CP_IMPLS, CP_LAYOUTS, ParallelismConfig
from minipar.lr_schedule import SCHEDULES
from minipar.optim_bnb import optimizer_problem
from models.llama_config import LlamaConfig

STRICT = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, validate_by_name=True,
                    validate_by_alias=True, protected_namespaces=())


def _number(value):
    """'3e-4' -> 0.0003 (PyYAML's string for an exponent without a dot); anything else as it is."""
    try:
        return float(value.strip()) if isinstance(value, str) else value
    except ValueError:
        return value


Number = Annotated[float, BeforeValidator(_number)]


def _optimizer(name):
    problem = optimizer_problem(name)
    if problem:
        raise ValueError(problem)
    return name


def supported(values, why: str = "") -> AfterValidator:
    """An Axolotl key of which minipar does some values: another is refused naming those it does."""
    def check(value, info):
        if value is not None and value not in values:
            raise ValueError(f"{info.field_name} {value!r} is not supported; supported: {list(values)}{why}")
        return value
    return AfterValidator(check)


class Keys(BaseModel):
    model_config = STRICT


class FSDPConfig(Keys):
    """accelerate's FSDP plugin, as minipar's ZeRO-3 does it: the units and how they shard."""
    wrap: List[str] = ["LlamaDecoderLayer"]
    prefetch: int = Field(1, ge=0)
    reshard_after_forward: bool = True
    state_dict_type: Literal["SHARDED_STATE_DICT", "FULL_STATE_DICT"] = "SHARDED_STATE_DICT"
    # gradient accumulation (accelerate's GradientAccumulationPlugin.sync_each_batch): true
    # reduce-scatters every micro-batch (holds only G/N); false reduce-scatters once per step and
    # holds the unsharded gradients (G) between micro-batches (FSDP2's set_requires_gradient_sync)
    sync_each_batch: bool = True


# the `model` section's keys: LlamaConfig's fields, typed (a float read as Number), all unset unless given
ModelKeys = create_model("ModelKeys", __base__=Keys, **{
    name: (Number if t is float else Optional[Number] if t == Optional[float] else t, None)
    for name, t in typing.get_type_hints(LlamaConfig).items()})
# a run without a `model` section trains this one (configs/default.yaml's)
SMALL_MODEL = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024)


def model_section(value):
    """The `model` mapping over SMALL_MODEL -> LlamaConfig, whose own checks then run. head_dim
    follows the final sizes unless given; the KV heads too where only the heads are given (HF's
    rule: KV heads = heads), else the small model's 2 stand."""
    if isinstance(value, LlamaConfig):
        return value
    given = ModelKeys.model_validate(value).model_dump(exclude_unset=True)
    base = dict(SMALL_MODEL)
    if "num_attention_heads" in given:
        base.pop("num_key_value_heads")
    return LlamaConfig(**{**base, **given})


class DataKeys(Keys):
    seed: int = 42
    dataset: str = "data/shakespeare.txt"       # a text file, read as bytes (when `datasets` is empty)
    val_fraction: Number = 0.05                # of `dataset`, held out for the eval loss
    # fine-tuning data (data/datasets.py, packing.py): `datasets` replaces `dataset`
    tokenizer_config: Optional[str] = None      # a HF tokenizer directory; default base_model, else bytes
    # Axolotl's tokenizer keys (data/special_tokens.py, data/chat_templates.py, models/resize_vocab.py):
    # tokens added and the base's embedding resized for them; the chat template by name
    special_tokens: Optional[dict] = None       # {bos_token, eos_token, pad_token, unk_token: text}
    tokens: Optional[List[str]] = None          # plain tokens added
    added_tokens_overrides: Optional[dict] = None   # {id: text}: added tokens renamed
    resize_token_embeddings_to_32x: bool = False
    mean_resizing_embeddings: bool = False      # new rows: the old rows' mean, else N(0, initializer_range)
    shrink_embeddings: bool = False
    chat_template: Optional[str] = None         # tokenizer_default | chatml | llama3 | ... | jinja
    chat_template_jinja: Optional[str] = None
    # checked against base_model's config.json and the tokenizer's class (models/hf_classes.py)
    model_type: Optional[str] = None            # AutoModelForCausalLM, LlamaForCausalLM, ...
    tokenizer_type: Optional[str] = None        # AutoTokenizer, LlamaTokenizerFast, ...
    datasets: List[dict] = []                   # [{path, type: completion | chat_template, field}]
    train_on_inputs: bool = False               # false: labels only on assistant turns of chat rows
    sample_packing: bool = False                # whole examples packed into sequence_len, kept apart
    val_set_size: Number = Field(0.0, ge=0, description="a fraction below 1, or a count")
    dataset_prepared_path: Optional[str] = None  # tokenized rows saved, loaded; None: <output_dir>/prepared
    # Axolotl's streamed pretraining (data/stream.py): `datasets` of type pretrain read, tokenized and
    # packed as the steps need them (pretraining_dataset sets it); buffers of this many documents
    streaming: bool = False
    streaming_multipack_buffer_size: int = Field(10_000, ge=1)
    pretrain_multipack_attn: bool = True        # a streamed packed row's documents attend only to themselves
    sequence_len: int = Field(128, ge=1)
    # a Hugging Face directory: the model config comes from its config.json, the weights from its
    # safetensors, each rank reading only its slices (models/hf_checkpoint.py)
    base_model: Optional[str] = None


class HyperparameterKeys(Keys):
    # samples per optimizer step = micro_batch_size x gradient_accumulation_steps x dp (keys.py)
    global_batch_size: Optional[int] = Field(16, ge=1)
    micro_batch_size: Optional[int] = Field(None, ge=1)      # per dp rank per forward
    gradient_accumulation_steps: Optional[int] = Field(None, ge=1)
    max_steps: Optional[int] = Field(300, ge=1)
    num_epochs: Optional[Number] = Field(None, gt=0)         # max_steps from the dataset (max_steps wins)
    # AdamW and its schedule; a fine-tune (base_model) takes Axolotl's values for what the file
    # leaves out (keys.AXOLOTL_DEFAULTS)
    learning_rate: Number = Field(3e-3, gt=0)
    min_lr_ratio: Number = Field(0.1, ge=0, le=1, validation_alias="cosine_min_lr_ratio",
                                 description="the final rate as a fraction of learning_rate")
    warmup_steps: Optional[int] = Field(20, ge=0, description="0: no warmup")   # None: from warmup_ratio
    warmup_ratio: Optional[Number] = Field(None, ge=0, lt=1, description="a fraction of max_steps")
    weight_decay: Number = Field(0.1, ge=0, description="0: no decay")
    adam_beta1: Number = Field(0.9, ge=0, lt=1)
    adam_beta2: Number = Field(0.95, ge=0, lt=1)
    adam_epsilon: Number = Field(1e-8, gt=0)
    max_grad_norm: Optional[Number] = Field(1.0, ge=0, description="0 or null: no clipping")
    lr_scheduler: Annotated[str, supported(SCHEDULES, " (minipar/lr_schedule.py: warmup over warmup_steps, "
                                                      "then cosine or linear down to min_lr_ratio x "
                                                      "learning_rate, or constant)")] = "cosine"
    # adamw_torch, adamw_torch_fused, or bitsandbytes' 8-bit and paged ones where it is installed
    # (minipar/optim_bnb.py; refused saying what to install or write instead where it is not)
    optimizer: Annotated[str, AfterValidator(_optimizer)] = "adamw_torch"
    dtype: Literal["float32", "bfloat16"] = "float32"   # bfloat16: compute in bf16, fp32 master weights
    bf16: Optional[Union[bool, str]] = Field(None, description="true, false or auto")   # Axolotl's (keys.py)
    # true (each layer keeps its input, runs again in backward), false, or selective: torchtitan's
    # selective_ac_option op (keep matmul and attention outputs) or n (every n-th layer in full)
    gradient_checkpointing: Union[bool, str] = Field(False, description="true, false or selective")
    selective_ac_option: Union[str, int] = Field("op", description="op or an integer n >= 1")
    # torch.compile of each decoder layer (minipar/regional_compile.py; docs/compile.md)
    compile: bool = Field(False, validation_alias="torch_compile")
    compile_backend: str = Field("inductor", validation_alias="torch_compile_backend")
    compile_mode: Optional[str] = Field(None, validation_alias="torch_compile_mode")


class ParallelKeys(Keys):
    # accelerate's ParallelismConfig names (minipar/config.py), Axolotl's as aliases; dp_shard_size
    # None takes the remainder of the world
    dp_replicate_size: int = Field(1, ge=1)
    dp_shard_size: Optional[int] = None
    cp_size: int = Field(1, ge=1, validation_alias="context_parallel_size")
    tp_size: int = Field(1, ge=1, validation_alias="tensor_parallel_size")
    sequence_parallel: bool = False
    pp_size: int = Field(1, ge=1, validation_alias="pipeline_parallel_size")   # the outermost dimension
    pipeline_schedule: str = "1f1b"       # afab | 1f1b | interleaved_1f1b | zb_h1 | zbv
    pipeline_virtual_stages: Optional[int] = Field(None, ge=1)   # chunks per rank; None: 2 if interleaved
    pipeline_layers: Optional[List[int]] = None                  # layers per (virtual) stage; None: even
    # each stage steps alone and starts the next step at once (the loss, norm and stop flag summed
    # in the background, logged a step late; clipping checked a step late: post_validate.py)
    pipeline_overlap_steps: bool = False
    ddp_timeout: Number = Field(1800, gt=0, description="seconds a collective waits for a stuck peer")
    # the ladder's rungs (docs/ladder.md): the gradient all-reduce when nothing is sharded; TP's async
    # input-gradient overlap; CP's sequence split; how attention crosses the cp ranks (USP: Ulysses in
    # groups of cp_ulysses_size, the ring across them: context_parallel/ulysses.py)
    ddp: Literal["naive", "bucketed"] = "bucketed"
    tp_async_overlap: bool = False
    cp_layout: Literal[CP_LAYOUTS] = "zigzag"
    cp_impl: Literal[CP_IMPLS] = "ring"
    cp_ulysses_size: Optional[int] = Field(None, ge=1, description="a divisor of context_parallel_size")
    # the attention kernel (context_parallel/kernel_choice.py; a forced one is refused where it cannot run)
    attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    # each MoE layer's experts over this many ranks borrowed from dp_shard x cp (expert_parallel/)
    ep_size: int = Field(1, ge=1, validation_alias="expert_parallel_size")
    # an MoE's expert capacity: null is dropless; c keeps ceil(c x tokens x top_k / experts) per
    # expert and forward, drops (and counts) the rest (models/moe.py)
    moe_capacity_factor: Optional[Number] = None
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)   # also Axolotl's fsdp_config (keys.py)
    fsdp_version: Annotated[Optional[int], supported((1, 2), " (both mean minipar's ZeRO-3 over "
                                                             "dp_shard_size)")] = None

    def parallelism(self) -> ParallelismConfig:
        """The grid's config (minipar/config.py), where the sizes leave the file's names: one name per
        size from here on. Unresolved: dp_shard_size None takes the remainder in resolve(world)
        (trainer/run_layout.py)."""
        return ParallelismConfig(dp_replicate_size=self.dp_replicate_size, dp_shard_size=self.dp_shard_size,
                                 cp_size=self.cp_size, tp_size=self.tp_size, pp_size=self.pp_size,
                                 ep_size=self.ep_size, sequence_parallel=self.sequence_parallel,
                                 tp_async_overlap=self.tp_async_overlap, cp_layout=self.cp_layout,
                                 cp_impl=self.cp_impl, cp_ulysses_size=self.cp_ulysses_size,
                                 attention_backend=self.attention_backend)


class RunKeys(Keys):
    output_dir: str = "out/default"
    metrics_file: Optional[str] = None    # default: <output_dir>/metrics.jsonl
    logging_steps: int = Field(10, ge=1)
    eval_steps: int = Field(50, ge=0, description="0: never")
    eval_batches: int = Field(4, ge=1)
    eval_prompts: Optional[List[str]] = None   # greedy generations logged at each eval (eval_samples.py)
    save_steps: int = Field(0, ge=0, description="0: only at the end")
    # Axolotl's: eval_steps / save_steps = ceil(max_steps / (n x num_epochs)) once max_steps is known
    evals_per_epoch: Optional[int] = Field(None, ge=1)
    saves_per_epoch: Optional[int] = Field(None, ge=1)
    save_final_checkpoint: bool = True
    save_total_limit: Optional[int] = Field(2, ge=0, description="0 or null: keep every checkpoint; "
                                                                  "N: keep the newest N")
    # checkpoints written by a background thread: a step stalls only for the copy to host memory
    async_save: bool = False
    resume_from_checkpoint: Optional[str] = None   # a path, or "latest"
    export_hf: bool = True                # write <output_dir>/hf at the end
    loss_curve: bool = True               # draw <output_dir>/loss_curve.png at the end (matplotlib)
    progress_bar: bool = True
    # what a run reports besides metrics.jsonl (throughput.py, profiling.py, run_loggers.py)
    peak_tflops: Optional[Number] = Field(None, gt=0, description="dense TFLOP/s of one device")
    profile_steps: Optional[List[int]] = None   # [a, b]: a torch.profiler trace of steps a..b per rank
    use_tensorboard: bool = False         # event files under <output_dir>/runs
    wandb_project: Optional[str] = None   # Weights & Biases, from rank 0
    wandb_entity: Optional[str] = None
    wandb_name: Optional[str] = None
    wandb_mode: Optional[Literal["online", "offline", "disabled"]] = None   # None: wandb's own


class AdapterKeys(Keys):
    # LoRA (minipar/lora/): adapters on a frozen base; null trains every weight (check.py refuses
    # qlora and 4/8-bit bases: they need GPU kernels)
    adapter: Optional[str] = None
    lora_r: int = 8                       # the adapters' rank (checked with adapter: lora, check.py)
    lora_alpha: Number = Field(16, gt=0, description="the update is scaled by lora_alpha / lora_r")
    lora_dropout: Number = Field(0.0, ge=0, lt=1)
    lora_target_modules: Optional[List[str]] = None   # some of the model's projections (q_proj, ...)
    lora_target_linear: bool = False      # true: every projection of a decoder layer
    lora_model_dir: Optional[str] = None  # a PEFT adapter directory to start from
    lora_modules_to_save: Optional[List[str]] = None  # refused: full copies of other modules
    merge_lora: bool = False              # also write <output_dir>/merged: W0 + (alpha/r) B A
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    # preference training, Axolotl's and TRL's keys (rl_keys.py, docs/dpo.md): `datasets` rows of
    # prompt / chosen / rejected; global_batch_size and micro_batch_size count pairs
    rl: Optional[str] = None              # dpo (rl: ipo is dpo with dpo_loss_type ipo)
    dpo_beta: Number = Field(0.1, gt=0, validation_alias="rl_beta")   # TRL's beta: the KL penalty's weight
    # Rafailov et al. (cDPO with label smoothing) | Chowdhury et al. 2024 | SLiC | Azar et al.
    dpo_loss_type: Literal["sigmoid", "robust", "hinge", "ipo"] = "sigmoid"
    # TRL's label_smoothing: the chance a pair's label is flipped (sigmoid and robust, rl_keys.py)
    dpo_label_smoothing: Number = Field(0.0, ge=0, lt=0.5,
                                        description="a pair's label flipped with this chance")
    # the reference's log-probs in one pass before training; null: true for a full fine-tune, false
    # with adapter: lora (the reference is then the base with the adapters off)
    precompute_ref_log_probs: Optional[bool] = None


GROUPS = (DataKeys, HyperparameterKeys, ParallelKeys, RunKeys, AdapterKeys)
