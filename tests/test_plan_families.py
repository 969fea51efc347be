"""The planner on what the families add, against real runs: Qwen2's q/k/v biases, a sliding window
that binds (Mistral's; Qwen2's on some layers), Gemma 2's capped attention under cp, and a base
model's vocabulary resized by the tokens a config adds.

Each run is one optimizer step of train.py's Trainer on forked gloo ranks, held as
tests/test_plan.py holds every config (`_check`): persistent state, gathered ZeRO-3 bytes and the comm
ledger EXACTLY (a bias is a parameter, its gradient and its AdamW moments, inside its layer's ZeRO-3
unit or DDP's buckets; a masked layer under cp all-gathers K/V over the whole cp group and
reduce-scatters dK/dV instead of its ring hops or all-to-alls), activations EXACTLY at three
sequence lengths (a masked layer keeps the whole sequence's K/V and the mask SDPA makes of the
boolean one; a capped one its explicit scores). The resized vocabulary is read from the
config FILE as the planner program reads it (minipar/trainer/prediction.py's read_train_config), and
must be the trainer's own. The time model and MFU of a window, and the parameter counts, are held
without ranks below.
"""
import dataclasses
import json

import pytest
from harness import run_world
from test_hf_load import _corpus, _tiny_tokenizer, make_checkpoint
from test_plan import _check, _check_world, _measure_all

from minipar.plan import Batch, Cluster, Layout, Options, plan
from minipar.plan.__main__ import main as plan_main
from minipar.plan.inputs import ModelShape
from minipar.trainer.prediction import from_train_config, read_train_config
from models.flops import step_flops
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

WINDOW = ["--model.model_type", "mistral", "--model.sliding_window", "16"]     # binds at 32, 64, 128
GEMMA2 = ["--model.model_type", "gemma2", "--model.head_dim", "16", "--model.attn_logit_softcapping", "50",
          "--model.query_pre_attn_scalar", "16"]
GEMMA3 = ["--model.model_type", "gemma3_text", "--model.head_dim", "16", "--model.query_pre_attn_scalar",
          "16", "--model.rope_local_base_freq", "10000", "--model.sliding_window", "16",
          "--model.layer_types", "[sliding_attention, full_attention]"]
# what a family adds to a layer's parameters
PARAMETER_RUNS = [
    # Qwen2's biases: in ZeRO-3's units over dp_shard 2, split over tp 2 with SP
    ("fsdp_tp.yaml", ["--sequence_parallel", "true", "--model.model_type", "qwen2"]),
    # ... in DDP's buckets under bf16 autocast
    ("ddp.yaml", ["--dp_replicate_size", "2", "--tensor_parallel_size", "2", "--dtype", "bfloat16",
                  "--model.model_type", "qwen2"]),
    # o_proj's and down_proj's (attention_bias, mlp_bias), replicated over tp, whose gradients SP sums
    # over tp like a norm's
    ("fsdp_tp.yaml", ["--sequence_parallel", "true", "--model.attention_bias", "true",
                      "--model.mlp_bias", "true"]),
    # Qwen3's q / k norms: their activations, and their gradients summed over tp
    ("fsdp_tp.yaml", ["--sequence_parallel", "true", "--model.model_type", "qwen3"]),
]
# what a family changes in a layer's attention
ATTENTION_RUNS = [
    # Mistral's window binding under cp 2 (ring): every layer all-gathers K/V, again when recomputed
    ("fsdp.yaml", ["--dp_shard_size", "2", "--context_parallel_size", "2", "--gradient_checkpointing", "true",
                   *WINDOW]),
    # Qwen2 windowed from layer 1 on, under Ulysses over cp 4: layer 0 its all-to-alls, layer 1 the gather
    ("cp_ulysses.yaml", ["--model.model_type", "qwen2", "--model.use_sliding_window", "true",
                         "--model.sliding_window", "16", "--model.max_window_layers", "1"]),
    # Gemma 2's capped logits under cp 2 x tp 2 in bf16: explicit scores, K/V all-gathered
    ("cp_tp.yaml", ["--dtype", "bfloat16", *GEMMA2]),
    # Gemma 3: local layers windowed (binding), a global one causal, its q / k norms, two RoPE tables
    ("fsdp.yaml", ["--dp_shard_size", "2", "--context_parallel_size", "2", *GEMMA3]),
]


@pytest.mark.parametrize("runs", [PARAMETER_RUNS, ATTENTION_RUNS], ids=["parameters", "attention"])
def test_plan_matches_family_runs_on_4_ranks(tmp_path, runs):
    """State, ledger and activations exactly."""
    _check_world(4, runs, tmp_path)


# ------------------------------------------------------------------ the vocabulary a config resizes
def _write_base(directory):
    """A transformers Llama whose vocabulary is exactly its tokenizer's, so added tokens resize it."""
    n = len(_tiny_tokenizer(str(directory)))
    make_checkpoint(directory, vocab_size=n)
    _tiny_tokenizer(str(directory))               # make_checkpoint writes one only for vocab 384
    return n


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(directory, vocabulary) of one such base model for the module."""
    directory = tmp_path_factory.mktemp("base")
    return directory, run_world(_write_base, 1, directory, timeout=60)[0]


def test_plan_reads_the_resized_vocabulary(tmp_path, base):
    """special_tokens and tokens added to base_model's tokenizer resize its embedding and lm_head
    (models/resize_vocab.py); the planner reads the config file to the same vocabulary as the run
    and holds the run exactly (dp_shard 2 x tp 2: the vocabulary's rows in ZeRO-3's root and
    embedding units and the loss's softmax)."""
    base, old = base
    config = tmp_path / "resize.yaml"
    config.write_text(f"base_model: {base}\nspecial_tokens:\n  pad_token: \"<pad>\"\n"
                      f"tokens: [\"<|im_start|>\", \"<|im_end|>\"]\nresize_token_embeddings_to_32x: true\n"
                      f"dataset: {_corpus()}\ndatasets: []\nsample_packing: false\nval_set_size: 0\n"
                      f"dp_shard_size: 2\ntensor_parallel_size: 2\n")
    flags = ["--sequence_len", "32", "--global_batch_size", "8", "--max_steps", "2", "--warmup_steps", "1",
             "--eval_steps", "0", "--progress_bar", "false", "--save_steps", "0",
             "--save_final_checkpoint", "false", "--export_hf", "false",
             "--output_dir", str(tmp_path / "out")]
    # the planner's reading first: it loads the tokenizer here, so that the forked ranks inherit
    # transformers' lazily imported modules instead of each importing them again (no torch op runs)
    notes = []
    planned = from_train_config(read_train_config(str(config), flags, notes))[0]
    per_rank = run_world(_measure_all, 4, [[str(config), *flags]], timeout=300)
    r0 = per_rank[0][0]
    ran = from_train_config(r0["cfg"])[0]
    assert ran.vocab_size == -(-(old + 3) // 32) * 32 > old and planned == ran, (old, ran, notes)
    assert any("vocabulary" in n for n in notes), notes
    _check(r0, [r[0] for r in per_rank])


def test_plan_program_prints_the_resized_vocabulary(tmp_path, capsys, base):
    """python -m minipar.plan on such a file plans the resized model and says so on stderr; a base
    directory without a tokenizer (a config.json to plan with) keeps config.json's size, with a note;
    one whose file adds tokens is refused by the run's own error."""
    base, old = base
    config = tmp_path / "resize.yaml"
    config.write_text(f"base_model: {base}\ntokens: [\"<|im_start|>\"]\n"
                      f"resize_token_embeddings_to_32x: true\ndp_shard_size: 4\n")
    assert plan_main([str(config), "--json"]) == 0
    out = capsys.readouterr()
    vocab = -(-(old + 1) // 32) * 32
    assert f"vocabulary {old} -> {vocab}" in out.err
    shape = dataclasses.replace(ModelShape.from_dict(json.load(open(base / "config.json"))), vocab_size=vocab)
    assert json.loads(out.out)["params"] == shape.num_params()
    bare = tmp_path / "bare"                   # config.json alone
    bare.mkdir()
    (bare / "config.json").write_text((base / "config.json").read_text())
    config.write_text(f"base_model: {bare}\ndp_shard_size: 4\n")
    assert plan_main([str(config), "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["params"] == shape.num_params() - (vocab - old) * 2 * 64
    assert "was not read" in out.err
    config.write_text(f"base_model: {bare}\ntokens: [\"<|im_start|>\"]\ndp_shard_size: 4\n")
    assert plan_main([str(config)]) == 2


# ------------------------------------------------------------------ the planner alone (no ranks)
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)
FAMILY_CONFIGS = {
    "qwen2": dict(SHAPE, model_type="qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2),
    "mistral": dict(SHAPE, model_type="mistral", sliding_window=64),
    "llama-biases": dict(SHAPE, model_type="llama", attention_bias=True, mlp_bias=True),
    "gemma2": dict(SHAPE, model_type="gemma2", head_dim=16, sliding_window=64),
}


def _parameters(d):
    return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig.from_dict(d), device="meta").parameters())


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_the_planner_reads_biases_and_windows_as_the_trainer(name):
    """config.json through ModelShape.from_dict: each layer's window as LlamaConfig.attention_window
    gives it, the biases in the parameter count (the built model's)."""
    d = FAMILY_CONFIGS[name]
    shape, c = ModelShape.from_dict(d), LlamaConfig.from_dict(d)
    assert [shape.attention_window(i) for i in range(4)] == [c.attention_window(i) for i in range(4)]
    assert (shape.qkv_bias, shape.o_bias, shape.mlp_bias) == (c.qkv_bias, c.attention_bias, c.mlp_bias)
    assert shape.num_params() == run_world(_parameters, 1, d, timeout=60)[0]


def test_a_window_in_flops_time_and_memory():
    """At 4096 tokens a window of 64 binds: MFU's model FLOPs count at most W keys a query (W -
    W^2 / 2s on average, causal), while minipar's masked kernel computes every score of its rows
    (twice a causal layer's attention time) and keeps an (s, s) mask; at 64 tokens it does not
    bind, and nothing changes. Qwen2's window on half the layers is half of each."""
    batch, opts, cluster, lay = Batch(8, 1, 4096), Options(), Cluster(), Layout(dp_shard=8)
    plain = ModelShape.from_dict(dict(SHAPE, model_type="mistral", sliding_window=None))
    windowed = ModelShape.from_dict(FAMILY_CONFIGS["mistral"])
    half = ModelShape.from_dict(FAMILY_CONFIGS["qwen2"])
    s, W, H, D, L = 4096, 64, 4, 16, 4
    f_plain, f_win, f_half = (step_flops(m, 8, s) for m in (plain, windowed, half))
    tokens = 8 * s
    assert f_plain.attention_causal == pytest.approx(12 * L * H * D * s / 2 * tokens)
    assert f_win.attention_causal == pytest.approx(12 * L * H * D * (W - W * W / (2 * s)) * tokens)
    assert f_win.attention_full == pytest.approx(12 * L * H * D * W * tokens)
    assert f_half.attention_causal == pytest.approx((f_plain.attention_causal + f_win.attention_causal) / 2)
    p_plain, p_win, p_half = (plan(m, lay, batch, opts, cluster) for m in (plain, windowed, half))
    assert p_win["time"]["attention_s"] == pytest.approx(2 * p_plain["time"]["attention_s"])
    assert p_half["time"]["attention_s"] == pytest.approx(1.5 * p_plain["time"]["attention_s"])
    assert p_win["time"]["mfu"] < p_plain["time"]["mfu"]         # fewer model FLOPs, more time
    act = lambda p: p["memory"]["activations"]["per_layer"]      # noqa: E731
    assert act(p_win) - act(p_plain) == 2 * s * s + 2 * (2 * 2 - 2 * 4) * s * D   # mask; K/V not repeated
    short = Batch(8, 1, 64)
    assert plan(windowed, lay, short, opts, cluster)["time"] == plan(plain, lay, short, opts, cluster)["time"]


def test_capped_attention_is_priced_as_explicit_scores():
    """Gemma 2's capped layers: two batched GEMMs per row and head, and the elementwise passes over
    the (b, H, s, S) scores; under cp the K/V all-gather and dK/dV reduce-scatter are exposed whole."""
    g2 = ModelShape.from_dict(FAMILY_CONFIGS["gemma2"])
    g3 = ModelShape.from_dict(dict(FAMILY_CONFIGS["gemma2"], model_type="gemma3_text"))   # no cap
    batch, opts, cluster = Batch(8, 1, 2048), Options(), Cluster()
    capped, plain = (plan(m, Layout(dp_shard=4, cp=2), batch, opts, cluster) for m in (g2, g3))
    assert capped["time"]["attention_s"] > plain["time"]["attention_s"]
    assert capped["time"]["memory_bound_s"] > plain["time"]["memory_bound_s"]
    assert set(capped["comm"]["cp"]["ops"]) == {"all_gather", "reduce_scatter"}
    assert capped["time"]["cp_exposed_s"] == pytest.approx(capped["comm"]["cp"]["seconds"])
