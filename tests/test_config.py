"""ParallelismConfig (minipar/config.py) and the training config's keys
(minipar/training/config/train_config.py): sizes, the remainder rule, model checks, accelerate's
size variables, command-line values."""

import pytest

from minipar import ParallelismConfig
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
    from minipar.training.config.train_config import load_config
    from minipar.training.run_setup import DEFAULT_CONFIG, _sizes_from_env
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "4")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    cfg, notes = load_config(DEFAULT_CONFIG, ["--context_parallel_size", "1"]), []
    assert _sizes_from_env(cfg, DEFAULT_CONFIG, True, {"context_parallel_size"}, notes) \
        == {"tensor_parallel_size"}
    assert (cfg.tensor_parallel_size, cfg.context_parallel_size) == (4, 1) and "ignored" in notes[0]
    path = tmp_path / "c.yaml"
    path.write_text("tensor_parallel_size: 2\n")
    cfg, notes = load_config(str(path)), []
    assert _sizes_from_env(cfg, str(path), False, set(), notes) == {"context_parallel_size"}
    assert (cfg.tensor_parallel_size, cfg.context_parallel_size) == (2, 2)
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "two")
    with pytest.raises(ValueError, match="PARALLELISM_CONFIG_TP_SIZE"):
        _sizes_from_env(load_config(str(path)), str(path), False, set(), [])


def test_command_line_numbers_without_a_dot():
    """YAML 1.1 reads 1e-3 as a string; the README's `--learning_rate 1e-3` means a number."""
    from minipar.training.config.train_config import load_config
    assert load_config(None, ["--learning_rate", "1e-3", "--min_lr_ratio", "5E-2"]).learning_rate == 1e-3
