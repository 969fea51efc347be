"""Issue 41, items 1, 4, 5 and 6 (part): an Axolotl file's boilerplate keys are honoured, noted or
refused, all refusals of a file in ONE message; Axolotl's defaults for a fine-tune, with the header
naming where each setting came from; the planner on Axolotl's batch keys and an HF directory; the
lr schedules by the HF Trainer's names. The configs are written for these tests in Axolotl's form.
"""
import json
import math
import os
import re

import pytest
import torch
from harness import run_program

from minipar import lr_schedule
from minipar.plan.__main__ import main as plan_main
from minipar.trainer.config import axolotl_docs, axolotl_keys
from minipar.trainer.config.rl_keys import translate_rl
from minipar.trainer.config.train_config import load_config
from minipar.trainer.data.make_example import next_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "32",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--global_batch_size", "4", "--progress_bar", "false", "--export_hf", "false"]


def _load(tmp_path, text, argv=(), name="axolotl.yaml"):
    path = tmp_path / name
    path.write_text(text)
    notes = []
    return load_config(str(path), list(argv), notes=notes), notes


def _hf_dir(tmp_path):
    """A Llama config.json (all load_config reads of base_model)."""
    d = tmp_path / "base"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=384, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False)))
    return str(d)


# ------------------------------------------------------------------ key groups, checked at load
def test_schedule_keys(tmp_path):
    cfg, notes = _load(tmp_path, "max_steps: 200\nwarmup_ratio: 0.1\nlr_scheduler: constant_with_warmup\n"
                                 "adam_epsilon: 1.0e-6\ncosine_min_lr_ratio: 0.05\n")
    assert (cfg.warmup_steps, cfg.lr_scheduler, cfg.adam_epsilon, cfg.min_lr_ratio) == \
        (20, "constant_with_warmup", 1e-6, 0.05)
    assert "warmup_steps = int(warmup_ratio 0.1 x max_steps 200) = 20" in notes
    cfg, _ = _load(tmp_path, "max_steps: 50\nwarmup_steps: 0.1\n")     # a float below 1 is a ratio
    assert (cfg.warmup_ratio, cfg.warmup_steps) == (0.1, 5)
    for kind in ("linear", "constant", "cosine_with_min_lr"):
        assert _load(tmp_path, f"lr_scheduler: {kind}\n")[0].lr_scheduler == kind


def test_per_epoch_and_save_keys(tmp_path):
    cfg, notes = _load(tmp_path, "max_steps: 100\nnum_epochs: 2\nevals_per_epoch: 4\nsaves_per_epoch: 1\n"
                                 "save_steps:\n", name="a.yaml")
    assert cfg.max_steps == 100          # max_steps wins over num_epochs, as in Axolotl
    assert (cfg.eval_steps, cfg.save_steps) == (13, 50), notes
    cfg, _ = _load(tmp_path, "save_steps:\nsave_only_model: true\n")
    assert cfg.save_steps == 0           # null: no periodic saves
    cfg, _ = _load(tmp_path, "auto_resume_from_checkpoints: true\n")
    assert cfg.resume_from_checkpoint == "latest"


def test_attention_keys(tmp_path):
    for text, backend in [("flash_attention: true\n", "flash"), ("sdp_attention: true\n", "auto"),
                          ("attn_implementation: eager\n", "math"),
                          ("attn_implementation: flash_attention_2\nflash_attention: true\n", "flash"),
                          ("flash_attention: false\n", "auto")]:
        assert _load(tmp_path, text)[0].attention_backend == backend, text
    cfg, notes = _load(tmp_path, "flash_attention: true\nattention_backend: math\n")
    assert cfg.attention_backend == "math"
    assert any("attention_backend math is set and wins" in n for n in notes)
    with pytest.raises(ValueError, match="ask for different attention kernels"):
        _load(tmp_path, "flash_attention: true\nattn_implementation: eager\n")


def test_noted_keys_one_note_each(tmp_path):
    text = ("tf32: true\nstrict: false\nloss_watchdog_threshold: 5.0\nloss_watchdog_patience: 3\n"
            "gradient_checkpointing_kwargs:\n  use_reentrant: false\nspecial_tokens:\n  pad_token: <pad>\n"
            "wandb_watch: gradients\nwandb_log_model: checkpoint\nwandb_project:\nwandb_entity:\n"
            "eval_sample_packing: false\npad_to_sequence_len: true\nmodel_type: AutoModelForCausalLM\n"
            "tokenizer_type: AutoTokenizer\nchat_template: tokenizer_default\nsave_only_model: true\n")
    cfg, notes = _load(tmp_path, text)
    for key in ("tf32", "loss_watchdog_threshold", "loss_watchdog_patience", "gradient_checkpointing_kwargs",
                "special_tokens", "wandb_watch", "wandb_log_model", "pad_to_sequence_len", "model_type",
                "tokenizer_type", "save_only_model"):
        said = [n for n in notes if n.startswith(f"{key}: ")]
        assert len(said) == 1 and "has no effect here" in said[0], (key, notes)
    assert not any(n.startswith("strict") for n in notes)   # false: the template's boilerplate, no word
    assert cfg.wandb_project is None


def test_every_refusal_of_a_file_in_one_message(tmp_path):
    text = ("deepspeed: deepspeed_configs/zero3_bf16.json\npretraining_dataset: some/hub-name\n"
            "fsdp_config:\n  fsdp_offload_params: true\nsave_steps:\nwarmup_steps: 0.1\n"
            "lr_scheduler: polynomial\noptimizer: adamw_apex_fused\nchat_template: command_a_rag\n"
            "learnig_rate: 1.0e-5\nmax_steps: 10\nlearning_rate: -1\n")
    with pytest.raises(ValueError) as info:
        _load(tmp_path, text)
    msg = str(info.value)
    assert msg.startswith("unknown config key 'learnig_rate'. Did you mean 'learning_rate'?"), msg
    for part in ["deepspeed: DeepSpeed is not used", "pretraining_dataset: streamed pretraining data",
                 "fsdp_offload_params: True (CPU offload", "lr_scheduler 'polynomial' is not supported",
                 "optimizer 'adamw_apex_fused' is not supported", "write optimizer: adamw_torch_fused",
                 "chat_template: command_a_rag is not available", "learning_rate must be > 0"]:
        assert part in msg, (part, msg)
    assert "save_steps" not in msg.split("Valid keys")[0] and "warmup_steps:" not in msg   # both accepted
    assert "'seed'" not in msg and "Did you mean 'learning_rate'?" not in msg.split("deepspeed")[1]


def test_8bit_and_paged_optimizers_need_bitsandbytes_else_refused_in_the_one_message(tmp_path, monkeypatch):
    """bitsandbytes' optimizers (minipar/optim_bnb.py): accepted where it is installed; where it is
    not, each is refused in the file's one message, with what to install and the line to write
    instead. (Hidden by find_spec here: the config is read only, nothing steps.)"""
    import importlib.util
    text, real = "optimizer: paged_adamw_32bit\nlr_scheduler: polynomial\n", importlib.util.find_spec
    for installed in (False, True):
        def find_spec(name, *args, installed=installed):
            if name == "bitsandbytes":
                return object() if installed else None
            return real(name, *args)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        with pytest.raises(ValueError) as info:
            _load(tmp_path, text)
        msg = str(info.value)
        assert msg.startswith("lr_scheduler 'polynomial'" if installed else "2 config values are wrong"), msg
        said = ("optimizer 'paged_adamw_32bit' is not supported: it needs bitsandbytes (not installed "
                "here): pip install bitsandbytes (or pip install -e .[bnb]), or write optimizer: "
                "adamw_torch_fused")
        assert (said in msg) != installed, msg
        for name in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "ademamix_8bit"):
            if installed:
                assert _load(tmp_path, f"optimizer: {name}\n")[0].optimizer == name
            else:
                with pytest.raises(ValueError, match=f"optimizer '{name}' is not supported: it needs "
                                                     f"bitsandbytes .*write optimizer: adamw_torch_fused"):
                    _load(tmp_path, f"optimizer: {name}\n")
    assert _load(tmp_path, "optimizer: adamw_torch\n")[0].optimizer == "adamw_torch"
    for name, says in (("paged_adamw", "Did you mean 'paged_adamw_8bit'?"),
                       ("adamw_torch_8bit", "it is torchao's, which minipar does not use; for 8-bit states "
                                            "write optimizer: adamw_bnb_8bit")):
        with pytest.raises(ValueError, match=re.escape(says)):
            _load(tmp_path, f"optimizer: {name}\n")


def test_did_you_mean_does_not_mislead():
    with pytest.raises(ValueError) as info:
        load_config(None, ["--deepspeed_config", "x", "--pretraining_datasets", "y"])
    msg = str(info.value)          # pretraining_dataset is a key now (honoured): the hint names it
    assert "Did you mean 'seed'" not in msg and "Did you mean 'learning_rate'" not in msg, msg
    with pytest.raises(ValueError, match="Did you mean 'flash_attention'"):
        load_config(None, ["--flash_attn", "true"])


def test_table_lists_every_key_once():
    rows = axolotl_docs.table()
    keys = [k for k, _, _ in rows]
    assert len(keys) == len(set(keys)) and {"tf32", "deepspeed", "warmup_ratio"} <= set(keys)
    assert {s for _, s, _ in rows} == {"honoured", "noted", "refused"}


# ------------------------------------------------------------------ item 4: Axolotl's defaults
def test_fine_tune_takes_axolotls_defaults_and_says_where_from(tmp_path):
    base = _hf_dir(tmp_path)
    cfg, notes = _load(tmp_path, f"base_model: {base}\nlearning_rate: 2.0e-5\nmax_steps: 100\n",
                       ["--adam_beta1", "0.8"])
    assert (cfg.weight_decay, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_epsilon, cfg.min_lr_ratio,
            cfg.lr_scheduler, cfg.optimizer, cfg.max_grad_norm, cfg.learning_rate) == \
        (0.0, 0.8, 0.999, 1e-8, 0.0, "cosine", "adamw_torch_fused", 1.0, 2e-5)
    assert cfg.warmup_steps == 3                           # min(int(0.03 x 100), 100)
    header = [n for n in notes if n.startswith("a fine-tune of base_model")]
    assert len(header) == 1, notes
    for part in ["learning_rate 2e-05 (file)", "adam_beta1 0.8 (flag)", "adam_beta2 0.999 (Axolotl default)",
                 "weight_decay 0 (Axolotl default)", "warmup_steps (derived) (Axolotl default)"]:
        assert part in header[0], (part, header[0])
    cfg, _ = _load(tmp_path, f"base_model: {base}\nmax_steps: 40\n")
    assert cfg.warmup_steps == 2                           # int(1.2) = 1 -> 2, as Axolotl
    # the default pretraining run keeps its settings
    cfg = load_config(None, [])
    assert (cfg.learning_rate, cfg.weight_decay, cfg.adam_beta2, cfg.warmup_steps, cfg.min_lr_ratio,
            cfg.optimizer) == (3e-3, 0.1, 0.95, 20, 0.1, "adamw_torch")


# ------------------------------------------------------------------ the schedules
def test_schedules_are_callable_objects_that_resume():
    kinds = {"linear": [0.5, 1.0, 1.0, 0.5, 0.0], "constant": [1.0] * 5,
             "constant_with_warmup": [0.5, 1.0, 1.0, 1.0, 1.0]}
    for kind, want in kinds.items():
        f = lr_schedule.make_schedule(kind, 2, 4, 0.0)
        assert [round(f(s), 6) for s in range(5)] == want, kind
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = lr_schedule.build_scheduler(opt, 2, 10, 0.0, kind="linear")
    for _ in range(4):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    again = lr_schedule.build_scheduler(opt2, 2, 10, 0.0, kind="linear")
    again.load_state_dict(state)
    assert again.get_last_lr() == sched.get_last_lr()
    note = lr_schedule.adopt_schedule(again, 2, 20, 0.0, kind="linear")
    assert "max_steps 10 -> 20" in note and math.isclose(opt2.param_groups[0]["lr"], 1 - 2 / 18)


# ------------------------------------------------------------------ item 5: the planner
def test_planner_reads_axolotls_batch_keys_and_an_hf_directory(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("micro_batch_size: 2\ngradient_accumulation_steps: 4\nmax_steps: 10\n"
                    "tensor_parallel_size: 2\ndp_shard_size: 2\n")
    assert plan_main([str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "16 x 128 tokens" in json.dumps(out) or out
    assert plan_main([str(path)]) == 0
    assert "batch: 16 x 128 tokens per step, micro-batch 2 row(s) x 4 step(s)" in capsys.readouterr().out
    assert plan_main(["--model", _hf_dir(tmp_path), "--world", "2", "--tp", "2"]) == 0
    assert "layout: dp_replicate 1 x dp_shard 1 x cp 1 x tp 2" in capsys.readouterr().out


# ------------------------------------------------------------------ item 6: small traps
def test_make_example_hint_names_the_directory_written():
    assert next_command("out/example", "finetune.yaml", "out/example") == \
        "torchrun --nproc-per-node 8 train.py configs/finetune.yaml"
    hint = next_command("/tmp/mine", "finetune.yaml", "out/example")
    assert "--base_model /tmp/mine/model" in hint and "path: /tmp/mine/chat.jsonl" in hint


# ------------------------------------------------------------------ one 2-step run, one process
def test_axolotl_boilerplate_trains_two_steps(tmp_path):
    cfg = tmp_path / "axolotl.yaml"
    cfg.write_text("max_steps: 2\nwarmup_ratio: 0.5\nlr_scheduler: linear\nadam_epsilon: 1.0e-7\n"
                   "flash_attention: true\ntf32: false\nstrict: false\nsaves_per_epoch: 1\n"
                   "evals_per_epoch: 1\nspecial_tokens:\nwandb_watch:\nexpert_parallel_size: 1\n"
                   "gradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  use_reentrant: false\n"
                   "logging_steps: 1\n")
    out = tmp_path / "out"
    proc = run_program("train.py", [str(cfg), *TINY, "--output_dir", str(out), "--save_final_checkpoint",
                                     "false"], cwd=ROOT, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl") if '"loss"' in x]
    steps = [r for r in rows if "lr" in r]
    assert [r["step"] for r in steps] == [1, 2], rows
    assert all(math.isfinite(r["loss"]) for r in steps) and steps[0]["lr"] == pytest.approx(1.5e-3)
    assert "gradient_checkpointing_kwargs" in proc.stdout + proc.stderr


def test_the_schema_agrees_with_the_table():
    """Issue 41, item 0: the table stays the source of what each Axolotl key does, and the pydantic
    schema agrees with it: an honoured key is a field or alias of TrainConfig or folded onto one
    (flash_attention -> attention_backend); a noted or refused one is no field, and fold takes it."""
    from minipar.trainer.config.errors import names
    from minipar.trainer.config.train_config import TrainConfig
    fields = set(names(TrainConfig))
    for key, status, _ in axolotl_docs.table():
        folded = axolotl_keys.fold({key: None}, [], []) == {}
        if status == "honoured":
            assert key in fields or folded, key
        else:
            assert key not in fields and folded, (key, status)


# ------------------------------------------------------------------ every key of Axolotl's schema
SCHEMA_KEYS = os.path.join(ROOT, "tests", "data", "axolotl_schema_keys.txt")
ALTERNATIVE = ("use ", "set ", "remove", "write ", "give ", "train ", "shorten", "edit ", "copy ", "save ",
               "leave ", "keep ", "add ")


def _schema_keys():
    lines = open(SCHEMA_KEYS).read().splitlines()
    header = [x for x in lines if x.startswith("#")]
    assert any(re.search(r"commit [0-9a-f]{40}", x) for x in header), header   # where it was read
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def test_every_key_of_axolotls_schema_has_a_status():
    """Issue 41, item 1: each top-level key of Axolotl's config schema is a field (or alias) of
    TrainConfig, a key keys.translate folds, or a row of the table; a key added to the data file
    without a status fails here, naming it."""
    from minipar.trainer.config.errors import names
    from minipar.trainer.config.keys import TRANSLATED
    from minipar.trainer.config.train_config import TrainConfig
    keys = _schema_keys()
    assert len(keys) > 350 and len(keys) == len(set(keys))
    known = set(names(TrainConfig)) | set(TRANSLATED) | set(axolotl_keys.KEYS)
    assert [k for k in keys if k not in known] == []
    statuses = [axolotl_keys.KEYS[k].status if k in axolotl_keys.KEYS else "field" for k in keys]
    assert {s: statuses.count(s) for s in set(statuses)}.keys() == {"field", "honoured", "noted", "refused"}


def test_every_refusal_names_an_alternative_and_every_row_a_reason():
    for key, status, why in axolotl_docs.table():
        assert len(why) > 15, key
        if status == "refused":
            assert any(verb in why for verb in ALTERNATIVE), (key, why)


def test_noted_keys_validate_with_one_note_each(tmp_path):
    text = ("liger_rope: true\nliger_fused_linear_cross_entropy: true\nplugins:\n"
            "  - axolotl.integrations.liger.LigerPlugin\ncut_cross_entropy: true\nunsloth_lora_mlp: true\n"
            "chunked_cross_entropy: true\nmlflow_tracking_uri: http://localhost:5000\nuse_mlflow: true\n"
            "comet_project_name: x\nhub_model_id: me/model\npush_dataset_to_hub: me/data\n"
            "dataloader_num_workers: 4\ndataloader_pin_memory: true\ntiled_mlp: true\n"
            "sample_packing_bin_size: 200\ntorch_empty_cache_steps: 10\nddp_find_unused_parameters: false\n"
            "include_tkps: true\nadam_beta3: 0.99\n")
    cfg, notes = _load(tmp_path, text)
    for key in ("liger_rope", "liger_fused_linear_cross_entropy", "cut_cross_entropy", "unsloth_lora_mlp",
                "chunked_cross_entropy", "mlflow_tracking_uri", "use_mlflow", "comet_project_name",
                "hub_model_id", "push_dataset_to_hub", "dataloader_num_workers", "dataloader_pin_memory",
                "tiled_mlp", "sample_packing_bin_size", "torch_empty_cache_steps", "adam_beta3"):
        said = [n for n in notes if n.startswith(f"{key}: ")]
        assert len(said) == 1 and "has no effect here" in said[0], (key, notes)
    assert any(n.startswith("plugins: ['axolotl.integrations.liger.LigerPlugin'] have no effect")
               for n in notes)
    for quiet in ("include_tkps", "ddp_find_unused_parameters"):      # Axolotl's default / false: no word
        assert not any(n.startswith(quiet) for n in notes), (quiet, notes)
    assert cfg.max_steps == 300


def test_refused_keys_come_in_one_message_each_with_its_alternative(tmp_path):
    text = ("neftune_noise_alpha: 5\npeft_use_rslora: true\nshuffle_merged_datasets: false\n"
            "load_best_model_at_end: true\nfp8: true\nsage_attention: true\n"
            "test_datasets:\n  - path: x.jsonl\n"
            "plugins:\n  - axolotl.integrations.spectrum.SpectrumPlugin\nsave_strategy: best\n"
            "rope_scaling:\n  type: linear\nlearnig_rate: 1.0e-5\n")
    with pytest.raises(ValueError) as info:
        _load(tmp_path, text)
    msg = str(info.value)
    assert msg.startswith("unknown config key 'learnig_rate'. Did you mean 'learning_rate'? And 10 config "
                          "values are wrong: "), msg
    for part in ["neftune_noise_alpha: NEFTune's noise on the embeddings is not added; remove it",
                 "peft_use_rslora: rsLoRA scales by alpha / sqrt(r); for the same update use adapter: lora "
                 "with lora_alpha = alpha x sqrt(lora_r)",
                 "shuffle_merged_datasets: rows are always drawn in a seeded order",
                 "load_best_model_at_end: the final weights are the last step's; remove it",
                 "fp8: FP8 training is not supported: use bf16: true",
                 "sage_attention: SageAttention quantises Q and K", "use attn_implementation: sdpa",
                 "test_datasets: separate evaluation datasets are not read; use val_set_size",
                 "plugins: ['axolotl.integrations.spectrum.SpectrumPlugin'] are Axolotl's code",
                 "save_strategy: best keeps the checkpoint of the best eval metric",
                 "rope_scaling: removed from Axolotl too; set rope_scaling in base_model's config.json"]:
        assert part in msg, (part, msg)


def test_empty_and_default_values_of_noted_and_refused_keys_say_nothing(tmp_path):
    """A template's boilerplate (`key:` with nothing, false, []) of any noted or refused key, and a
    refused key written with what minipar does anyway (shuffle_merged_datasets: true), pass
    without a word; the other value of the same key is refused."""
    for key, row in axolotl_keys.KEYS.items():
        if row.status != "honoured":
            notes, problems = [], []
            assert axolotl_keys.fold({key: None}, notes, problems) == {} and notes == problems == [], key
    text = "".join(f"{k}:\n" for k in ("neftune_noise_alpha", "fp8", "mlflow_run_name", "deepspeed",
                                        "peft_use_dora", "test_datasets", "liger_rope", "hub_model_id"))
    text += ("shuffle_merged_datasets: true\npretrain_multipack_attn: true\ntokenizer_use_fast: true\n"
             "peft_init_lora_weights: true\ndpo_label_smoothing: 0.0\ncurriculum_sampling: false\n")
    cfg, notes = _load(tmp_path, text)
    assert cfg is not None and not [n for n in notes if "has no effect" in n], notes
    for key in ("shuffle_merged_datasets", "tokenizer_use_fast"):   # (pretrain_multipack_attn: honoured)
        with pytest.raises(ValueError, match=f"^{key}: "):
            _load(tmp_path, f"{key}: false\n")


def test_honoured_spellings_fold_onto_minipars_keys(tmp_path):
    cases = [("bfloat16: true\n", dict(dtype="bfloat16")), ("float32: true\nbf16:\n", dict(dtype="float32")),
             ("eval_strategy: epoch\nsave_strategy: 'no'\nmax_steps: 40\n",
              dict(evals_per_epoch=1, eval_steps=40, save_steps=0)),
             ("evaluation_strategy: 'no'\n", dict(eval_steps=0)),
             ("save_strategy: no\nsave_steps:\n", dict(save_steps=0)),       # YAML's bare no: false
             ("batch_size: 8\nmicro_batch_size: 2\n", dict(gradient_accumulation_steps=4)),
             ("sequence_parallel_degree: 2\n", dict(cp_size=2)),
             ("profiler_steps: 3\nprofiler_steps_start: 2\n", dict(profile_steps=[3, 5])),
             ("xformers_attention: true\n", dict(attention_backend="auto")),
             ("eager_attention: true\n", dict(attention_backend="math")),
             ("type_of_model: AutoModelForCausalLM\n", dict(model_type="AutoModelForCausalLM")),
             ("trl:\n  beta: 0.2\n  use_vllm: false\n", dict(dpo_beta=0.2)),
             # Axolotl's values of minipar's own keys
             ("ddp: true\n", dict(ddp="bucketed")),
             ("gradient_checkpointing: offload\n", dict(gradient_checkpointing=True)),
             ("lora_target_modules: all-linear\n", dict(lora_target_linear=True, lora_target_modules=None)),
             ("torch_compile: auto\n", dict(compile=torch.__version__ >= "2.5.1"))]
    for text, want in cases:
        cfg, notes = _load(tmp_path, text)
        assert {k: getattr(cfg, k) for k in want} == want, (text, notes)
    # Axolotl's list of one loss (dpo_loss_type needs rl: dpo and its pairs: the translation alone)
    assert translate_rl({"dpo_loss_type": ["ipo"]}, []) == {"dpo_loss_type": "ipo"}
    for text, part in [("batch_size: 7\nmicro_batch_size: 2\n", "batch_size 7 needs micro_batch_size"),
                       ("bfloat16: true\nbf16: false\n", "bfloat16: true contradicts bf16: false"),
                       ("eval_strategy: epoch\nevals_per_epoch: 2\n", "eval_strategy: epoch contradicts"),
                       ("sequence_parallel_degree: 2\ncontext_parallel_size: 4\n", "contradicts"),
                       ("dpo_loss_type: [sigmoid, ipo]\n", "one loss is trained"),
                       ("eval_steps: 0.1\n", "eval_steps: 0.1 (a fraction of the run's steps"),
                       ("lora_target_modules: '.*proj'\n", "a string is a regex over module names"),
                       ("base_model_config: /elsewhere\n",
                        "base_model_config '/elsewhere' is not base_model")]:
        with pytest.raises(ValueError, match=re.escape(part)):
            _load(tmp_path, text)


def test_did_you_mean_draws_from_the_schema_then_the_table():
    """A typo's hint is a field or honoured key where one is close (flash_attn -> flash_attention,
    not the noted flash_attn_d512), else a noted or refused key of the table; the valid keys listed
    are minipar's and the honoured ones, not the ~300 noted and refused."""
    cases = [("--flash_attn", "flash_attention"), ("--wandb_wach", "wandb_watch"),
             ("--neftune_noise_alph", "neftune_noise_alpha"),
             ("--sequence_paralel_degree", "sequence_parallel_degree"),
             ("--learnig_rate", "learning_rate"), ("--mlflow_run_nam", "mlflow_run_name")]
    for flag, hint in cases:
        with pytest.raises(ValueError) as info:
            load_config(None, [flag, "1"])
        msg = str(info.value)
        assert f"Did you mean '{hint}'?" in msg, (flag, msg[:300])
        listed = msg.split("Valid keys: ", 1)[1].split(", ")
        assert "learning_rate" in listed and "bfloat16" in listed and "mlflow_run_name" not in listed


def test_docs_list_the_table_as_generated():
    page = open(os.path.join(ROOT, "docs", "finetuning.md")).read()
    block = page.split("<!-- generated: axolotl_docs.doc_table() -->\n", 1)[1].split(
        "\n<!-- end of generated table -->", 1)[0]
    assert block == axolotl_docs.doc_table(), (
        "docs/finetuning.md's keys table is stale: paste the output of python -c 'from "
        "minipar.trainer.config.axolotl_docs import doc_table; print(doc_table())' between its markers")


@pytest.mark.slow
def test_a_file_of_noted_and_honoured_keys_trains_two_steps(tmp_path):
    """Item 1 end to end: Axolotl's spellings and no-op keys written as an Axolotl user has them
    train 2 steps on one process, each no-op said once in the log. Slow (a whole run of train.py,
    forked: tests/harness.py run_program); its fast twins load the same keys:
    test_noted_keys_validate_with_one_note_each, test_honoured_spellings_fold_onto_minipars_keys."""
    cfg = tmp_path / "axolotl.yaml"
    cfg.write_text("max_steps: 2\nmicro_batch_size: 2\nbatch_size: 4\nxformers_attention: true\n"
                   "eval_strategy: 'no'\nsave_strategy: 'no'\nplugins:\n"
                   "  - axolotl.integrations.liger.LigerPlugin\nliger_rms_norm: true\n"
                   "liger_glu_activation: true\n"
                   "use_mlflow: true\nmlflow_run_name: r\ndataloader_num_workers: 2\nddp: true\n"
                   "chunked_cross_entropy: true\ninclude_tkps: true\nneftune_noise_alpha:\nfp8: false\n"
                   "logging_steps: 1\n")
    out = tmp_path / "out"
    i = TINY.index("--global_batch_size")
    argv = TINY[:i] + TINY[i + 2:]           # the batch comes from batch_size and micro_batch_size
    proc = run_program("train.py", [str(cfg), *argv, "--output_dir", str(out), "--save_final_checkpoint",
                                     "false"], cwd=ROOT, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in open(out / "metrics.jsonl") if '"loss"' in x and '"lr"' in x]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), rows
    log = proc.stdout + proc.stderr
    for said in ("liger_rms_norm: True has no effect", "use_mlflow: True has no effect",
                 "dataloader_num_workers: 2 has no effect", "ddp: true has no effect", "plugins: ['axolotl"):
        assert said in log, (said, log[-3000:])
    assert "neftune_noise_alpha" not in log and "fp8" not in log
