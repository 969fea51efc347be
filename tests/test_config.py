"""ParallelismConfig (minipar/config.py) and the training config's keys
(minipar/trainer/config/train_config.py): sizes, the remainder rule, model checks, accelerate's
size variables, command-line values."""

import dataclasses
import os

import pytest

from minipar import ParallelismConfig
from minipar.trainer.config.train_config import REPO_ROOT as REPO
from minipar.trainer.config.train_config import load_config
from models.llama_config import LlamaConfig


def test_unset_dp_shard_takes_remainder():
    cfg = ParallelismConfig(cp_size=2, tp_size=2).resolve(16)
    assert (cfg.dp_replicate_size, cfg.dp_shard_size, cfg.cp_size, cfg.tp_size) == (1, 4, 2, 2)
    assert cfg.total_size == 16


def test_product_must_match_world():
    with pytest.raises(ValueError) as info:
        ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, cp_size=1, tp_size=2).resolve(16)
    msg = str(info.value)
    assert "multiply to 8" in msg and "world size is 16" in msg and "dp_shard_size=2" in msg


def test_remainder_that_does_not_divide():
    with pytest.raises(ValueError, match="does not divide 6"):
        ParallelismConfig(tp_size=4).resolve(6)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_sizes_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="tp_size"):
        ParallelismConfig(tp_size=bad)


def test_env_variables(monkeypatch):
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    cfg = ParallelismConfig.from_env().resolve(8)
    assert (cfg.dp_shard_size, cfg.cp_size, cfg.tp_size) == (2, 2, 2)
    assert ParallelismConfig.from_env(tp_size=4).resolve(8).tp_size == 4
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_TP_SIZE"):
        ParallelismConfig.from_env()


def _model(**kw):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    base.update(kw)
    return LlamaConfig(**base)


def test_model_checks_name_the_value_to_change():
    ParallelismConfig(tp_size=2, cp_size=2).resolve(4).validate_model(_model(), sequence_len=64)
    cfg = ParallelismConfig(tp_size=4).resolve(4)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp_size=4"):
        cfg.validate_model(_model())
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tp_size=4"):
        cfg.validate_model(_model(hidden_size=96, num_attention_heads=6, num_key_value_heads=6))
    with pytest.raises(ValueError, match="vocab_size=258 is not divisible by tp_size=4: "
                                         "pad vocab_size to 260"):
        cfg.validate_model(_model(vocab_size=258, num_key_value_heads=4))
    with pytest.raises(ValueError, match="sequence length 60 is not divisible by 2 \\* cp_size = 8"
                                         ".*56 or 64"):
        ParallelismConfig(cp_size=4).resolve(4).validate_model(_model(), sequence_len=60)


def test_accelerate_size_variables_fill_the_sizes_not_set(monkeypatch, tmp_path):
    """PARALLELISM_CONFIG_*_SIZE: the command line wins, then the variables, then the config file's
    unset keys; the implicit default layout gives way to them as to command-line sizes."""
    from minipar.trainer.config.train_config import load_config
    from minipar.trainer.run_layout import _sizes_from_env
    from minipar.trainer.run_setup import DEFAULT_CONFIG
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    cfg, notes = load_config(DEFAULT_CONFIG, ["--context_parallel_size", "1"]), []
    assert _sizes_from_env(cfg, DEFAULT_CONFIG, True, {"cp_size"}, notes) == {"tp_size"}
    assert (cfg.tp_size, cfg.cp_size) == (4, 1) and "ignored" in notes[0]
    path = tmp_path / "c.yaml"
    path.write_text("tensor_parallel_size: 2\n")
    cfg, notes = load_config(str(path)), []
    assert _sizes_from_env(cfg, str(path), False, set(), notes) == {"cp_size"}
    assert (cfg.tp_size, cfg.cp_size) == (2, 2)
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_TP_SIZE"):
        _sizes_from_env(load_config(str(path)), str(path), False, set(), [])


def test_command_line_numbers_without_a_dot():
    """YAML 1.1 reads 1e-3 as a string; the README's `--learning_rate 1e-3` means a number."""
    from minipar.trainer.config.train_config import load_config
    assert load_config(None, ["--learning_rate", "1e-3", "--min_lr_ratio", "5E-2"]).learning_rate == 1e-3


def test_the_default_model_is_what_train_config_says():
    """Issue 20, item 7: TrainConfig's default model has 2 KV heads; a config without a `model:`
    block trained 4/4 heads while configs/default.yaml trained 4/2. Now both are 4/2, and giving
    the heads alone keeps HF's rule (KV heads = heads)."""
    bare = load_config(None, [])
    assert (bare.model.num_attention_heads, bare.model.num_key_value_heads) == (4, 2)
    default = load_config(os.path.join(REPO, "configs", "default.yaml"), [])
    assert dataclasses.asdict(bare.model) == dataclasses.asdict(default.model)
    heads = load_config(None, ["--model.num_attention_heads", "8"])
    assert (heads.model.num_attention_heads, heads.model.num_key_value_heads) == (8, 8)


def test_pipeline_settings_that_fail_together_are_one_error(tmp_path):
    """Issue 20, item 7: too few layers for the stages AND too few micro-batches for 1F1B are
    reported together, in one ValueError, as unknown keys are."""
    from minipar.trainer.config.check import check_pipeline
    cfg = load_config(None, ["--model.num_hidden_layers", "2", "--pipeline_schedule", "1f1b"])
    with pytest.raises(ValueError) as err:
        check_pipeline(cfg, 4, 1)
    msg = str(err.value)
    assert "num_hidden_layers=2" in msg and "at least 4 micro-batches" in msg, msg


def test_one_name_per_size_inside_axolotls_at_the_boundary(tmp_path):
    """Issue 38: the code knows tp_size, cp_size, pp_size, ep_size (ParallelismConfig's names);
    Axolotl's tensor_parallel_size, ... are accepted in a YAML file and on the command line, and
    both names of one size with different values are one clear error."""
    path = tmp_path / "c.yaml"
    path.write_text("tensor_parallel_size: 2\ncontext_parallel_size: 2\npipeline_parallel_size: 2\n"
                    "expert_parallel_size: 1\n")
    cfg = load_config(str(path))
    assert (cfg.tp_size, cfg.cp_size, cfg.pp_size, cfg.ep_size) == (2, 2, 2, 1)
    assert not hasattr(cfg, "tensor_parallel_size")
    pconf = cfg.parallelism()
    assert (pconf.tp_size, pconf.cp_size, pconf.pp_size, pconf.ep_size) == (2, 2, 2, 1)
    assert load_config(None, ["--tensor_parallel_size", "4"]).tp_size == 4
    assert load_config(None, ["--tp_size", "4", "--tensor_parallel_size", "4"]).tp_size == 4
    assert load_config(str(path), ["--tp_size", "4"]).tp_size == 4          # the command line wins
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 contradicts tp_size: 4"):
        load_config(None, ["--tp_size", "4", "--tensor_parallel_size", "2"])
    path.write_text("context_parallel_size: 2\ncp_size: 1\n")
    with pytest.raises(ValueError, match="context_parallel_size: 2 contradicts cp_size: 1"):
        load_config(str(path))
    with pytest.raises(ValueError, match="Did you mean 'tensor_parallel_size'"):
        load_config(None, ["--tensor_paralel_size", "2"])
