"""The training program's settings: a YAML file (Axolotl's keys) plus `--key value` overrides.

    python train.py                                   configs/default.yaml
    python train.py configs/fsdp.yaml --max_steps 20 --model.hidden_size 64 --fsdp.prefetch 2

TrainConfig is a pydantic model made of schema.py's key groups. load_config reads it in four steps
and raises every problem of all four as ONE error at the end (a file is fixed in one edit):

    1. each source (the file, then the command line as YAML scalars: 20, true, null, [a, b]) in
       the schema's names (keys.translate); the command line wins key by key, also inside the
       nested `model` and `fsdp` mappings
    2. pydantic validates the merge: every unknown key, wrong type and value out of range at once
       (errors.py words them); the keys that failed are dropped (their defaults stand) so that
       the steps after see a whole config
    3. what follows from other keys (keys.resolve: bf16, Axolotl's defaults for a fine-tune);
       base_model's config.json as the model
    4. the checks across keys and the data files (check.py)

A YAML syntax error is one line naming the file, line and column (config_files.py). Nothing here
touches torch.distributed: a bad config fails on every rank before the first collective.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Annotated, List, Optional

import yaml
from pydantic import BaseModel, BeforeValidator, Field, ValidationError

from minipar.config_files import read_yaml, yaml_value
from minipar.recipe import LoRA, Recipe
from minipar.trainer.config import keys as config_keys
from minipar.trainer.config import schema
from minipar.trainer.config.axolotl_keys import KEYS as AXOLOTL_KEYS
from minipar.trainer.config.axolotl_table import HONOURED
from minipar.trainer.config.check import check
from minipar.trainer.config.errors import one_error, problems_of
from minipar.trainer.data.special_tokens import key_problems as tokenizer_key_problems
from models.hf_checkpoint import read_config
from models.hf_classes import class_problems
from models.llama_config import LlamaConfig

# the checkout's root (minipar/trainer/ is two levels below it): configs/ and data/ live there
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class TrainConfig(schema.AdapterKeys, schema.RunKeys, schema.ParallelKeys, schema.HyperparameterKeys,
                  schema.DataKeys):
    """Every key of a run (schema.py has them in groups, with their types, defaults and ranges)."""
    model: Annotated[LlamaConfig, BeforeValidator(schema.model_section)] = Field(
        default_factory=lambda: LlamaConfig(**schema.SMALL_MODEL))

    @property
    def metrics_path(self) -> str:
        return self.metrics_file or os.path.join(self.output_dir, "metrics.jsonl")

    def to_dict(self) -> dict:
        return self.model_dump()

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



# the model of each mapping a config holds, for errors.py; Axolotl's keys that fold() and
# translate() honour count as valid names in the "did you mean" hints, its noted and refused keys
# as hints only where no valid name is close
SECTIONS = {"": TrainConfig, "model": schema.ModelKeys, "fsdp": schema.FSDPConfig}
MORE_NAMES = (*config_keys.TRANSLATED, *(k for k, row in AXOLOTL_KEYS.items() if row.status == HONOURED))
HINT_NAMES = tuple(k for k, row in AXOLOTL_KEYS.items() if row.status != HONOURED)


def _example(key: str) -> str:
    """A value to show in 'needs a value' messages: true for a bool key, the default otherwise."""
    obj = TrainConfig()
    for part in key.split("."):
        obj = getattr(obj, config_keys.ALIASES.get(part, part), None)
    if isinstance(obj, bool):
        return "true"
    if obj is None or isinstance(obj, BaseModel) or dataclasses.is_dataclass(obj):
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


def _typed(sources: list, notes: list, unknown: list, problems: list):
    """Steps 1-2: (the config of every key that validated, {key: "file" | "flag"} of the keys
    given, the merged mapping); unknown keys and wrong values are appended to the lists."""
    merged, given = {}, {}
    for origin, data in sources:
        for key, value in config_keys.translate(data, unknown, notes, problems).items():
            if key in SECTIONS and isinstance(value, dict) and isinstance(merged.get(key), dict):
                value = {**merged[key], **value}
            merged[key], given[key] = value, origin
    renamed = {config_keys.ALIASES[k]: k for _, data in sources for k in data if k in config_keys.ALIASES}
    try:
        return TrainConfig.model_validate(merged), given, merged
    except ValidationError as err:       # said at the end; the steps after see the keys that passed
        more, lines = problems_of(err, merged, SECTIONS, renamed, MORE_NAMES, HINT_NAMES)
        unknown += more
        problems += lines
        failed = {e["loc"][0] for e in err.errors()}
        return TrainConfig.model_validate({k: v for k, v in merged.items() if k not in failed}), given, merged


def validate_keys(*mappings: dict) -> TrainConfig:
    """Steps 1-2 alone: the keys and their types, for a config whose files do not exist yet (a
    command that reads what an earlier one writes: tests/test_docs.py)."""
    unknown, problems = [], []
    cfg = _typed([("file", m) for m in mappings], [], unknown, problems)[0]
    one_error(unknown, problems)
    return cfg


def load_config(path: Optional[str] = None, argv: Optional[List[str]] = None,
                notes: Optional[List[str]] = None) -> TrainConfig:
    """The checked config of a YAML file plus `--key value` overrides; `notes` (if given) collects
    what was derived or mapped (bf16: auto, Axolotl's no-op keys) for the run's log."""
    notes = [] if notes is None else notes
    sources, unknown, problems = [], [], []
    if path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"config file {path} not found")
        data = read_yaml(path) or {}      # a tab or a syntax error: file, line and column
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a mapping of config keys")
        sources.append(("file", data))
    if argv:
        sources.append(("flag", parse_overrides(argv)))
    cfg, given, merged = _typed(sources, notes, unknown, problems)
    config_keys.resolve(cfg, given, notes, problems)
    if cfg.base_model:
        try:
            cfg.model = _base_model_config(cfg, set(merged["model"]) if isinstance(merged.get("model"), dict)
                                           else set())
        except (ValueError, OSError) as err:    # said with the file's other problems
            problems.append(err)
    cfg.model.moe_capacity_factor = cfg.moe_capacity_factor   # a training option, not config.json's
    problems.extend(tokenizer_key_problems(cfg, notes) + class_problems(cfg, notes))   # tokens, model_type
    if not os.path.isabs(cfg.dataset) and not os.path.exists(cfg.dataset) \
            and os.path.exists(os.path.join(REPO_ROOT, cfg.dataset)):
        cfg.dataset = os.path.join(REPO_ROOT, cfg.dataset)   # the bundled corpus, from any directory
    check(cfg, problems, unknown)
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
