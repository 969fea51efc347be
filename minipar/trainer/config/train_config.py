"""The training program's settings: a YAML file (Axolotl-style keys) plus `--key value` overrides.

    python train.py                                   configs/default.yaml
    python train.py configs/fsdp.yaml --max_steps 20 --model.hidden_size 64 --fsdp.prefetch 2

Every key has a typed default below; keys that are not among them are ONE error that lists all
of them, each with the nearest valid key ("did you mean 'learning_rate'?"). Values from the
command line are parsed as YAML scalars (20, true, null, [a, b]) and checked against the key's
type (values.py): a float key takes 3e-4, 1E-3 and 2e-5 as people write them (PyYAML
reads an exponent without a dot as a string, so float keys parse strings themselves); an int key
refuses 2.5 and "3e-4"; a bool key takes only true/false. Axolotl's names (tensor_parallel_size,
gradient_accumulation_steps, num_epochs, bf16, fsdp_config, ...) are mapped onto these keys by
keys.py, so the code knows one name per size (tp_size, as minipar/config.py's ParallelismConfig);
then every value is checked at once, all wrong ones in one error (check.py). A YAML syntax error (a tab, an
unclosed bracket) is one line naming the file, line and column (config_files.py). Nothing here
touches torch.distributed, so a bad config fails on every rank before the first collective.
cfg.parallelism() hands the sizes on as the grid's ParallelismConfig (config.py, then mesh.py).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import List, Optional, Union

import yaml

from minipar.compose import LoRA, Recipe
from minipar.config import ParallelismConfig
from minipar.config_files import read_yaml, yaml_value
from minipar.trainer.config import keys as config_keys
from minipar.trainer.config.axolotl_keys import KEYS as AXOLOTL_KEYS

# every value check at once, before anything is written (check.py); YAML errors in one line
from minipar.trainer.config.check import check

# typed values and the applying of a mapping, with one error for every unknown key (values.py)
from minipar.trainer.config.values import _apply, unknown_keys_error
from minipar.trainer.data.special_tokens import key_problems as tokenizer_key_problems
from models.hf_checkpoint import read_config
from models.hf_classes import class_problems
from models.llama_config import LlamaConfig

# the checkout's root (minipar/trainer/ is two levels below it): configs/ and data/ live there
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@dataclass
class FSDPConfig:
    """Mirrors accelerate's FSDP plugin: what ZeRO-3 wraps as units and how."""
    wrap: List[str] = field(default_factory=lambda: ["LlamaDecoderLayer"])
    prefetch: int = 1
    reshard_after_forward: bool = True
    state_dict_type: str = "SHARDED_STATE_DICT"      # or FULL_STATE_DICT
    # gradient accumulation (accelerate's GradientAccumulationPlugin.sync_each_batch): true
    # reduce-scatters every micro-batch (holds only G/N); false reduce-scatters once per step and
    # holds the unsharded gradients (G) between micro-batches (FSDP2's set_requires_gradient_sync)
    sync_each_batch: bool = True


@dataclass
class TrainConfig:
    seed: int = 42
    dataset: str = "data/shakespeare.txt"
    val_fraction: float = 0.05
    # fine-tuning data, Axolotl's keys (trainer/datasets.py, packing.py); `datasets` replaces `dataset`
    tokenizer_config: Optional[str] = None   # a HF tokenizer directory; default base_model, else bytes
    # Axolotl's tokenizer keys (data/special_tokens.py, data/chat_templates.py, models/resize_vocab.py):
    # tokens added and the base's embedding resized for them; the chat template by name
    special_tokens: Optional[dict] = None     # {bos_token, eos_token, pad_token, unk_token: text}
    tokens: Optional[List[str]] = None        # plain tokens added
    added_tokens_overrides: Optional[dict] = None   # {id: text}: added tokens renamed
    resize_token_embeddings_to_32x: bool = False
    mean_resizing_embeddings: bool = False    # new rows: the old rows' mean, else N(0, initializer_range)
    shrink_embeddings: bool = False
    chat_template: Optional[str] = None       # tokenizer_default | chatml | llama3 | ... | jinja
    chat_template_jinja: Optional[str] = None
    # checked against base_model's config.json (models/hf_classes.py)
    model_type: Optional[str] = None          # AutoModelForCausalLM, LlamaForCausalLM, ...
    tokenizer_type: Optional[str] = None      # AutoTokenizer, LlamaTokenizerFast, ...
    datasets: List[dict] = field(default_factory=list)   # [{path, type: completion | chat_template, field}]
    train_on_inputs: bool = False         # false: labels only on assistant turns of chat rows
    sample_packing: bool = False          # whole examples packed into sequence_len, attention kept apart
    val_set_size: float = 0.0             # held out of `datasets`: a fraction, or (>= 1) a count
    # tokenized rows saved, then loaded; None: <output_dir>/prepared
    dataset_prepared_path: Optional[str] = None
    sequence_len: int = 128
    global_batch_size: Optional[int] = 16  # samples per optimizer step, over all data-parallel ranks
    micro_batch_size: Optional[int] = None  # per dp rank per forward; None = no accumulation
    gradient_accumulation_steps: Optional[int] = None  # Axolotl's: global = micro x accumulation x dp
    max_steps: Optional[int] = 300
    num_epochs: Optional[float] = None    # Axolotl's: max_steps from the dataset size (max_steps wins)
    learning_rate: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: Optional[int] = 20      # None: from warmup_ratio, or Axolotl's default for a fine-tune
    warmup_ratio: Optional[float] = None  # Axolotl's: warmup_steps = int(ratio x max_steps) (keys.py)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    max_grad_norm: Optional[float] = 1.0  # None or 0 turns clipping off
    dtype: str = "float32"                # or bfloat16: compute in bf16, fp32 master weights
    # Axolotl's: true = dtype bfloat16; auto = bf16 where the GPU has it
    bf16: Optional[Union[bool, str]] = None
    # linear warmup, then cosine to min_lr_ratio; or linear, constant, constant_with_warmup,
    # cosine_with_min_lr (minipar/optim.py SCHEDULES). A fine-tune (base_model) takes Axolotl's
    # defaults for every optimizer and schedule key its file leaves out (keys.AXOLOTL_DEFAULTS)
    lr_scheduler: str = "cosine"
    optimizer: str = "adamw_torch"        # or adamw_torch_fused (torch's fused AdamW kernel)
    # true (full: each layer keeps its input, runs again in backward), false, or selective
    # (models/activation_checkpoint.py), torchtitan's selective_ac_option: op (keep the matmul and
    # attention outputs, recompute the rest) or an integer n (every n-th layer fully checkpointed)
    gradient_checkpointing: Union[bool, str] = False
    selective_ac_option: Union[str, int] = "op"
    # torch.compile of each decoder layer (minipar/regional_compile.py; docs/compile.md), Axolotl's
    # [torch_compile], [torch_compile_backend] (inductor, aot_eager, eager), [torch_compile_mode]
    compile: bool = False
    compile_backend: str = "inductor"
    compile_mode: Optional[str] = None
    # the parallel sizes, accelerate's names (ParallelismConfig's, minipar/config.py); a YAML file or
    # the command line may write Axolotl's [in brackets], which keys.py maps onto these;
    # dp_shard_size None = the remainder of the world
    dp_replicate_size: int = 1
    dp_shard_size: Optional[int] = None
    cp_size: int = 1                      # [context_parallel_size]
    tp_size: int = 1                      # [tensor_parallel_size]
    sequence_parallel: bool = False
    # pipeline parallelism, the outermost dimension [pipeline_parallel_size] (minipar/pipeline_parallel/)
    pp_size: int = 1
    pipeline_schedule: str = "1f1b"       # afab | 1f1b | interleaved_1f1b | zb_h1 | zbv
    pipeline_virtual_stages: Optional[int] = None   # model chunks per rank; None: 2 if interleaved, else 1
    pipeline_layers: Optional[List[int]] = None     # layers per (virtual) stage; None: the even split
    # true: each stage steps its own optimizer and starts the next step at once (no collective over
    # the stages at a step's end; the loss, grad norm and stop flag are summed in the background and
    # logged a step late), so zbv's fill hides in the last step's drain; with max_grad_norm each
    # update is checked a step late and redone clipped where clipping was due (post_validate.py)
    pipeline_overlap_steps: bool = False
    ddp_timeout: int = 1800               # seconds a collective waits for a stuck peer (Axolotl's name)
    # the ladder's rungs (docs/ladder.md): naive | bucketed gradient all-reduce when nothing is
    # sharded; TP's async input-gradient overlap; CP's sequence split (zigzag | contiguous)
    ddp: str = "bucketed"
    tp_async_overlap: bool = False
    cp_layout: str = "zigzag"
    # how attention crosses the cp ranks: ring | ulysses | usp (Ulysses in groups of
    # cp_ulysses_size consecutive cp ranks, the ring across them); context_parallel/ulysses.py
    cp_impl: str = "ring"
    cp_ulysses_size: Optional[int] = None
    # the attention kernel: auto | flash | cudnn | efficient | math (context_parallel/kernel_choice.py;
    # a forced one is refused where it cannot run; each run prints which kernel each path used)
    attention_backend: str = "auto"
    # expert parallelism [expert_parallel_size]: each MoE layer's experts split over this many
    # ranks borrowed from dp_shard x cp (no extra ranks); expert_parallel/dispatch.py
    ep_size: int = 1
    # an MoE's expert capacity: null is dropless; c keeps ceil(c * tokens * top_k / experts) copies
    # per expert and forward, drops the rest (models/moe.py) and counts them in metrics.jsonl
    moe_capacity_factor: Optional[float] = None
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    fsdp_version: Optional[int] = None    # Axolotl's; 1 or 2: both are minipar's ZeRO-3 over dp_shard
    output_dir: str = "out/default"
    metrics_file: Optional[str] = None    # default: <output_dir>/metrics.jsonl
    logging_steps: int = 10
    eval_steps: int = 50
    eval_batches: int = 4
    eval_prompts: Optional[List[str]] = None   # greedy generations logged at each eval (eval_samples.py)
    save_steps: int = 0                   # 0 (or null) = only at the end (when save_final_checkpoint)
    # Axolotl's: eval_steps / save_steps = ceil(max_steps / (n x num_epochs)) once max_steps is known
    evals_per_epoch: Optional[int] = None
    saves_per_epoch: Optional[int] = None
    save_final_checkpoint: bool = True
    save_total_limit: Optional[int] = 2
    # write checkpoints in a background thread: training stalls only for the copy of the state to
    # host memory (torchtitan's checkpoint.async_mode; trainer/checkpoint/async_save.py)
    async_save: bool = False
    resume_from_checkpoint: Optional[str] = None   # a path, or "latest"
    export_hf: bool = True                # write <output_dir>/hf at the end
    progress_bar: bool = True
    # what a run reports besides metrics.jsonl (trainer/throughput.py, profiling.py, run_loggers.py):
    peak_tflops: Optional[float] = None   # per device, for mfu; None: the GPU's (a table), a CPU's measured
    profile_steps: Optional[List[int]] = None   # [a, b]: a torch.profiler trace of steps a..b per rank
    use_tensorboard: bool = False         # Axolotl's: event files under <output_dir>/runs
    wandb_project: Optional[str] = None   # Axolotl's wandb_* keys: log to Weights & Biases (rank 0)
    wandb_entity: Optional[str] = None
    wandb_name: Optional[str] = None
    wandb_mode: Optional[str] = None      # online | offline | disabled (None: wandb's own default)
    # a Hugging Face directory (Axolotl's key): the model config comes from its config.json and the
    # weights from its safetensors, each rank reading only its slices (models/hf_checkpoint.py)
    base_model: Optional[str] = None
    # LoRA, Axolotl's keys (minipar/lora/): adapters on a frozen base; null trains every weight
    adapter: Optional[str] = None         # lora (qlora is refused: it needs 4-bit GPU kernels)
    lora_r: int = 8
    lora_alpha: float = 16
    lora_dropout: float = 0.0
    lora_target_modules: Optional[List[str]] = None   # some of the model's projections (q_proj, ...)
    lora_target_linear: bool = False      # true: every projection of a decoder layer
    lora_model_dir: Optional[str] = None  # a PEFT adapter directory to start from
    lora_modules_to_save: Optional[List[str]] = None  # refused: full copies of other modules
    merge_lora: bool = False              # also write <output_dir>/merged: W0 + (alpha/r) B A
    load_in_4bit: bool = False            # refused (quantised bases need GPU kernels)
    load_in_8bit: bool = False
    # preference training, Axolotl's and TRL's keys (config/rl_keys.py, docs/dpo.md): `datasets` rows
    # of prompt / chosen / rejected; global_batch_size and micro_batch_size count PAIRS, as TRL's do
    rl: Optional[str] = None              # dpo (Axolotl's rl: ipo is dpo with dpo_loss_type ipo)
    dpo_beta: float = 0.1                 # [rl_beta] TRL's beta: the KL penalty's weight
    dpo_loss_type: str = "sigmoid"        # sigmoid (Rafailov et al.) | ipo (Azar et al.)
    # TRL's: the reference's log-probs computed in one pass before training. null: true for a full
    # fine-tune, false with adapter: lora (the reference is then the base with the adapters off)
    precompute_ref_log_probs: Optional[bool] = None
    model: LlamaConfig = field(default_factory=lambda: LlamaConfig(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024))

    @property
    def metrics_path(self) -> str:
        return self.metrics_file or os.path.join(self.output_dir, "metrics.jsonl")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def recipe(self):
        """How the composition applies the techniques (minipar/compose.py), from this config."""
        lora = LoRA(self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_target_modules,
                    self.lora_target_linear, self.lora_model_dir) if self.adapter == "lora" else None
        return Recipe(dtype=self.dtype, seed=self.seed, lora=lora,
                      gradient_checkpointing=self.gradient_checkpointing,
                      selective_ac_option=self.selective_ac_option, pipeline_schedule=self.pipeline_schedule,
                      pipeline_virtual_stages=self.pipeline_virtual_stages,
                      pipeline_layers=self.pipeline_layers, zero3_prefetch=self.fsdp.prefetch,
                      reshard_after_forward=self.fsdp.reshard_after_forward,
                      sync_each_batch=self.fsdp.sync_each_batch, ddp=self.ddp, compile=self.compile,
                      compile_backend=self.compile_backend, compile_mode=self.compile_mode)

    def parallelism(self) -> ParallelismConfig:
        """The grid's config (minipar/config.py): the sizes and the options of the parallel dimensions,
        unresolved (dp_shard_size None takes the remainder when resolve(world) is called)."""
        return ParallelismConfig(dp_replicate_size=self.dp_replicate_size, dp_shard_size=self.dp_shard_size,
                                 cp_size=self.cp_size, tp_size=self.tp_size, pp_size=self.pp_size,
                                 ep_size=self.ep_size, sequence_parallel=self.sequence_parallel,
                                 tp_async_overlap=self.tp_async_overlap, cp_layout=self.cp_layout,
                                 cp_impl=self.cp_impl, cp_ulysses_size=self.cp_ulysses_size,
                                 attention_backend=self.attention_backend)


def _example(key: str) -> str:
    """A value to show in 'needs a value' messages: true for a bool key, the default otherwise."""
    obj = TrainConfig()
    for part in key.split("."):
        obj = getattr(obj, part, None)
    if isinstance(obj, bool):
        return "true"
    if obj is None or dataclasses.is_dataclass(obj):
        return "VALUE"
    return yaml.safe_dump(obj, default_flow_style=True).strip().removesuffix("...").strip()


def parse_overrides(argv: List[str]) -> dict:
    """['--max_steps', '20', '--model.hidden_size', '64']
    -> {'max_steps': 20, 'model': {'hidden_size': 64}}"""
    out: dict = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"expected --key value, got {arg!r}")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"--{key} needs a value "
                                 f"(for example --{key} {_example(key.replace('-', '_'))})")
            value = argv[i + 1]
            i += 1
        key = key.replace("-", "_") if "." not in key else key
        parsed = yaml_value(value, key) if value != "" else None
        target = out
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = parsed
        i += 1
    return out


def load_config(path: Optional[str] = None, argv: Optional[List[str]] = None,
                notes: Optional[List[str]] = None) -> TrainConfig:
    """The checked config of a YAML file plus `--key value` overrides; `notes` (if given) collects
    what was derived or mapped (bf16: auto, Axolotl's no-op keys) for the run's log."""
    notes = [] if notes is None else notes
    cfg = TrainConfig()
    explicit_model_keys, given, unknown, sources, problems = set(), {}, [], [], []
    if path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"config file {path} not found")
        data = read_yaml(path) or {}      # a tab or a syntax error: file, line and column
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a mapping of config keys")
        sources.append(("file", data))
    if argv:
        sources.append(("flag", parse_overrides(argv)))
    # every problem of the file and the flags is collected, then raised as ONE error (refusals,
    # wrong types, unknown keys, wrong values), so a file is fixed in one edit, not one run each
    for origin, data in sources:
        data = config_keys.translate(data, unknown, notes, problems)   # Axolotl's names and boilerplate
        given.update(dict.fromkeys(data, origin))
        _apply(cfg, data, unknown=unknown, problems=problems)
        explicit_model_keys |= set(data.get("model") or {}) if isinstance(data.get("model"), dict) else set()
    config_keys.resolve(cfg, given, notes, problems)
    # derived model fields follow the final sizes unless set explicitly: head_dim always
    # (hidden_size / num_attention_heads); the KV heads only where the heads were given, as HF's
    # rule (kv heads = heads) has it; otherwise the default model's own 2 KV heads stand
    model = dataclasses.asdict(cfg.model)
    derived = ["head_dim"]
    if "num_attention_heads" in explicit_model_keys:
        derived.append("num_key_value_heads")
    for key in derived:
        if key not in explicit_model_keys:
            model.pop(key)
    cfg.model = LlamaConfig(**model)
    if cfg.base_model:
        try:
            cfg.model = _base_model_config(cfg, explicit_model_keys)
        except (ValueError, OSError) as err:    # said with the file's other problems
            problems.append(err)
    cfg.model.moe_capacity_factor = cfg.moe_capacity_factor   # a training option, not config.json's
    problems.extend(tokenizer_key_problems(cfg, notes) + class_problems(cfg, notes))   # tokens, model_type
    root = REPO_ROOT
    if not os.path.isabs(cfg.dataset) and not os.path.exists(cfg.dataset) \
            and os.path.exists(os.path.join(root, cfg.dataset)):
        cfg.dataset = os.path.join(root, cfg.dataset)   # the bundled corpus, from any directory
    # Axolotl's fsdp_config and mapped keys count as valid names in the did-you-mean hints
    unknown = [(k, v + ["fsdp_config", *config_keys.SIZE_NAMES, *config_keys.COMPILE_NAMES, *AXOLOTL_KEYS]
                if not p else v, p)
               for k, v, p in unknown]
    check(cfg, earlier=problems, unknown=unknown_keys_error(unknown) if unknown else None)
    return cfg


# model.* keys a run may set over base_model's config.json: how it trains, not the weights' shape
TRAINING_MODEL_KEYS = {"router_aux_loss_coef"}


def _base_model_config(cfg: TrainConfig, explicit: set) -> LlamaConfig:
    """base_model's config.json is the model: a `model.*` key that says otherwise is refused, but
    for TRAINING_MODEL_KEYS, which the run's config sets."""
    model = read_config(cfg.base_model)
    for key in TRAINING_MODEL_KEYS & explicit:   # not the shape: the run may choose it
        setattr(model, key, getattr(cfg.model, key))
    clash = {k: getattr(cfg.model, k) for k in sorted(explicit) if getattr(cfg.model, k) != getattr(model, k)}
    if clash:
        got = ", ".join(f"model.{k}={v!r} (config.json: {getattr(model, k)!r})" for k, v in clash.items())
        raise ValueError(f"base_model {cfg.base_model!r} fixes the model shape, "
                         f"but the config also sets {got}: "
                         f"remove the model section (configs/finetune.yaml has none)")
    return model
