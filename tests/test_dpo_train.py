"""rl: dpo through train.py (minipar/trainer/dpo_run.py): configs/dpo.yaml (full fine-tune, the
precomputed reference) and configs/dpo_lora.yaml (LoRA, the adapters-off reference) on a tiny
checkpoint with make_example's generated pairs; one process equals 2 ranks (dp_shard 2, tp 2)
within 1e-4, the metrics carry TRL's names, a resumed run equals the uninterrupted one, and bad
input is one line before any step; and a Qwen3-MoE on dp_shard 2 x ep 2 equals one process."""
import json
import os

import pytest
import torch
from harness import run_world

from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "logps/chosen", "logps/rejected")


def _make(directory):
    from minipar.trainer.checkpoint.save_load import copy_tokenizer
    from minipar.trainer.data.example_data import make_example
    from minipar.trainer.data.make_example import write_checkpoint
    from models.llama_config import LlamaConfig
    paths = make_example(directory, num_conversations=4, tokenizer_chars=30_000, num_preference=24)
    model = os.path.join(directory, "model")
    write_checkpoint(model, LlamaConfig(**TINY), seed=0, dtype=torch.float32)
    copy_tokenizer(paths["tokenizer"], model)
    return paths["preference"]


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("dpo-example"))
    pairs = run_world(_make, 1, d, timeout=120)[0]     # torch only inside a forked rank
    return dict(model=os.path.join(d, "model"), pairs=pairs)


def _argv(config, ex, out, steps=2, *extra):
    return [os.path.join(ROOT, "configs", config), "--base_model", ex["model"],
            "--datasets", f"[{{path: {ex['pairs']}, type: chat_template}}]", "--output_dir", str(out),
            "--max_steps", str(steps), "--global_batch_size", "4", "--val_set_size", "4", "--eval_steps",
            str(steps), "--eval_batches", "1", "--save_steps", "0", "--export_hf", "false",
            "--logging_steps", "1", "--learning_rate", "1e-2", "--warmup_steps", "0",
            "--progress_bar", "false", "--sequence_len", "256", "--peak_tflops", "1", "--loss_curve", "false",
            "--dp_shard_size", "1", "--tensor_parallel_size", "1", "--context_parallel_size", "1", *extra]


def _train(argv):
    torch.set_num_threads(1)
    return _train_history(Trainer(setup_run(argv)))


def _close(a, b, tol=1e-4):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys(), (ra.keys(), rb.keys())
        for k in ra:
            assert abs(ra[k] - rb[k]) <= tol * max(1.0, abs(rb[k])), (k, ra[k], rb[k])


@pytest.mark.parametrize("config,layout", [
    ("dpo.yaml", ["--dp_shard_size", "2"]),
    pytest.param("dpo_lora.yaml", ["--tensor_parallel_size", "2"], marks=pytest.mark.slow)])
def test_config_one_process_equals_two_ranks(tmp_path, example, config, layout):
    one = run_world(_train, 1, _argv(config, example, tmp_path / "one"), timeout=120)[0]
    two = run_world(_train, 2, _argv(config, example, tmp_path / "two", 2, *layout), timeout=120)
    assert abs(one[0]["loss"] - 0.6931471805599453) < 1e-5     # the reference is the start: ln 2
    assert set(KEYS) <= set(one[-1]) and "eval_rewards/accuracies" in one[-1] and "val_loss" in one[-1]
    _close(two[0], one)
    _close(two[1], one)
    rows = [json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl")]
    assert "rewards/margins" in rows[0] and "eval_rewards/margins" in rows[-1]


def test_dpo_lora_one_process(tmp_path, example):
    """configs/dpo_lora.yaml's fast twin: the adapters-off reference is the start (B = 0): ln 2."""
    one = run_world(_train, 1, _argv("dpo_lora.yaml", example, tmp_path / "one"), timeout=120)[0]
    assert abs(one[0]["loss"] - 0.6931471805599453) < 1e-5 and one[0]["rewards/margins"] == 0.0
    assert "eval_rewards/accuracies" in one[-1] and one[-1]["loss"] != one[0]["loss"]


def test_frozen_copy_reference_one_process(tmp_path, example):
    """The next test's fast twin: precompute_ref_log_probs: false builds the frozen copy (nothing is
    precomputed); the reference is the start: ln 2, then it learns."""
    got = run_world(_train_frozen, 1, _argv("dpo.yaml", example, tmp_path / "one", 2,
                                            "--precompute_ref_log_probs", "false",
                                            "--save_final_checkpoint", "false"), timeout=120)[0]
    history, (reference, sharded, data_ref) = got
    assert reference == "frozen" and not sharded and data_ref is None
    assert abs(history[0]["loss"] - 0.6931471805599453) < 1e-5 and history[0]["rewards/margins"] == 0.0
    assert history[-1]["loss"] != history[0]["loss"] and "eval_rewards/accuracies" in history[-1]


@pytest.mark.slow
def test_frozen_copy_reference_equals_precomputed(tmp_path, example):
    """precompute_ref_log_probs: false on a full fine-tune builds the frozen copy (TRL's default
    ref_model), ZeRO-3 sharded like the policy on dp_shard 2: its steps and evaluation equal one
    process's precomputed reference."""
    one = run_world(_train, 1, _argv("dpo.yaml", example, tmp_path / "one"), timeout=120)[0]
    two = run_world(_train_frozen, 2, _argv("dpo.yaml", example, tmp_path / "two", 2, "--dp_shard_size", "2",
                                            "--precompute_ref_log_probs", "false"), timeout=120)
    for history, (reference, sharded, data_ref) in two:
        assert reference == "frozen" and sharded and data_ref is None     # nothing was precomputed
        assert abs(history[0]["loss"] - 0.6931471805599453) < 1e-5
        _close(history, one)


def _train_cached(argv):
    """(history, the reference came from the cache, the cache's path, the paths of changed inputs,
    what a damaged entry loads)."""
    import copy
    import warnings

    from minipar.trainer.data import reference_cache as rc
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    run, cfg = trainer.dpo, trainer.cfg
    splits = [run.data.train, run.data.val]
    others = []
    for key, value in (("dpo_loss_type", "ipo"), ("global_batch_size", 8), ("seed", 1)):
        changed = copy.copy(cfg)
        setattr(changed, key, value)
        inputs = rc.cache_inputs(changed, trainer.pgm.config, trainer.run.base_model, splits, "cpu")
        others.append(rc.cache_path(changed, inputs))
    if trainer.pgm.global_rank == 0:                      # the one rank that reads the cache
        damaged = os.path.join(os.path.dirname(argv[argv.index("--output_dir") + 1]), "damaged.pt")
        with open(damaged, "wb") as f:
            f.write(b"not a torch file")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = rc.load(damaged, run.cache_inputs, [s.num_rows for s in splits])
        assert loaded is None and "is not usable" in str(caught[-1].message)
    return _train_history(trainer), run.from_cache, run.cache_file, others


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_precomputed_reference_is_cached_with_the_prepared_data(tmp_path, example, ranks):
    """The first run computes the reference and caches it under dataset_prepared_path/reference/; a
    rerun with the same inputs (another output_dir) loads it and trains the same (on 2 ranks: rank 0
    reads, then broadcasts); another loss type, batch or seed is another key; a damaged entry is not
    used."""
    cache = str(tmp_path / "cache")
    runs = [run_world(_train_cached, ranks, _argv("dpo.yaml", example, tmp_path / out, 1, "--dp_shard_size",
                                                  str(ranks), "--dataset_prepared_path", cache,
                                                  "--save_final_checkpoint", "false"), timeout=120)
            for out in ("a", "b")]
    first, again = runs[0][0], runs[1][0]
    assert first[1] is False and all(r[1] is True for r in runs[1])
    assert first[2] == again[2] and os.path.dirname(first[2]) == os.path.join(cache, "reference")
    assert os.listdir(os.path.join(cache, "reference")) == [os.path.basename(first[2])]
    assert all(r[0] == first[0] for r in runs[1])                  # the same numbers, exactly
    assert len({first[2], *first[3]}) == 4                         # each change: another key


def _train_frozen(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    run = trainer.dpo
    held = (run.reference, run.dpo.ref_model.sharded, getattr(run.data.train, "ref_logps", None))
    return _train_history(trainer), held


def _train_history(trainer):
    history = trainer.train()
    return [{k: r[k] for k in r if k in KEYS or k.startswith("eval_") or k == "val_loss"} for r in history]


@pytest.mark.slow
@pytest.mark.parametrize("config,frozen", [("dpo.yaml", []), ("dpo_lora.yaml", []),
                                           ("dpo.yaml", ["--precompute_ref_log_probs", "false"])])
def test_resume_equals_uninterrupted(tmp_path, example, config, frozen):
    """The precomputed reference is recomputed at the start of the resumed run from the starting
    weights (the frozen copy rebuilt from them): the resumed steps equal the uninterrupted run's."""
    const = ["--lr_scheduler", "constant", *frozen]   # the same rate whatever max_steps the first run had
    full = run_world(_train, 1, _argv(config, example, tmp_path / "full", 4, *const), timeout=120)[0]
    first = _argv(config, example, tmp_path / "cut", 4, "--save_steps", "2", *const)
    run_world(_train, 1, first + ["--max_steps", "2", "--save_final_checkpoint", "true"], timeout=120)
    rest = run_world(_train, 1, first + ["--resume_from_checkpoint", "latest"], timeout=120)[0]
    _close(rest[-2:], full[-2:], 1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp_shard_size", "2", "--gradient_accumulation_steps", "2",
                                     "--global_batch_size", "4", "--micro_batch_size", "null"],
                                    ["--context_parallel_size", "2"],
                                    ["--pipeline_parallel_size", "2", "--micro_batch_size", "2"]])
def test_more_layouts(tmp_path, example, layout):
    one = run_world(_train, 1, _argv("dpo.yaml", example, tmp_path / "one"), timeout=120)[0]
    two = run_world(_train, 2, _argv("dpo.yaml", example, tmp_path / "two", 2, *layout), timeout=120)
    _close(two[0], one)


def _refused(argv):
    try:
        setup_run(argv)
    except ValueError as err:
        return str(err)
    return None


def test_bad_input_is_one_line_before_any_step(tmp_path, example):
    pairs = tmp_path / "bad.jsonl"
    pairs.write_text(json.dumps(dict(prompt="a", chosen="b")) + "\n")
    plain = f"[{{path: {pairs}}}]"
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps(dict(prompt="x " * 600, chosen="b", rejected="c")) + "\n")
    cases = {
        "kto": (["--rl", "kto"], "rl: 'kto' is not supported; supported: ['dpo']"),
        "no rejected": (["--datasets", plain], "needs `rejected`"),
        "long prompt": (["--datasets", f"[{{path: {long_prompt}}}]"], "leaves no room for a response"),
        "beta": (["--rl_beta", "0"], "dpo_beta (rl_beta) must be > 0"),
        "smoothing": (["--dpo_loss_type", "robust", "--dpo_label_smoothing", "0.5"],
                      "dpo_label_smoothing must lie in [0, 0.5) (a pair's label flipped with this chance), "
                      "got 0.5"),
        "hinge smoothed": (["--dpo_loss_type", "hinge", "--dpo_label_smoothing", "0.1"],
                           "dpo_label_smoothing 0.1 with dpo_loss_type hinge: the hinge loss takes no label"),
    }
    argvs = {name: _argv("dpo.yaml", example, tmp_path / name.replace(" ", "_"), 3, *extra)
             for name, (extra, _) in cases.items()}
    got = run_world(lambda: {name: _refused(a) for name, a in argvs.items()}, 1, timeout=60)[0]
    for name, (_, want) in cases.items():
        assert got[name] is not None and want in got[name], (name, got[name])
        assert not os.path.exists(tmp_path / name.replace(" ", "_"))        # refused before any write


def _planned(argv):
    """(rows per step, then per layout (dp_shard 2; pp 2 by plan_pipeline) the plan's time and memory
    with the config's reference and without any)."""
    import dataclasses

    from minipar.plan import Cluster, Layout, Pipeline, plan, plan_pipeline
    from minipar.plan.reference_cost import forward_seconds
    from minipar.trainer.config.train_config import load_config
    from minipar.trainer.prediction import from_train_config
    cfg = load_config(argv[0], argv[1:], [])
    model, sizes, batch, opts = from_train_config(cfg)
    cluster, out = Cluster(peak_tflops=100.0), [batch.global_batch_size]
    pp_batch = dataclasses.replace(batch, micro_batch_size=4)                      # 2 micro-batches
    for run in (lambda o: plan(model, Layout(1, 2, 1, 1), batch, o, cluster),
                lambda o: plan_pipeline(model, Layout(1, 1, 1, 1), Pipeline(pp=2), pp_batch, o, cluster)):
        with_ref, without = run(opts), run(dataclasses.replace(opts, dpo_reference=""))
        out.append((with_ref["time"], without["time"], with_ref["memory"], without["memory"],
                    [s["memory"] for s in with_ref.get("stages", [])]))
    # under pp: the whole model's forward of the step's micro-batches, one after the other
    out.append(forward_seconds(model, Layout(1, 1, 1, 1), pp_batch, opts, cluster, out[-1][0]))
    return out


def test_planner_counts_the_reference(tmp_path, example):
    """rows = 2 per pair; LoRA's reference and the frozen copy add one forward per micro-batch to the
    step's time (about a third of its compute; under pp the micro-batches pipelined: at pp 2 and 2
    micro-batches 3 half-model forwards where one after the other took 4, plus their sends), the
    precomputed one nothing per step and a pass before training (under pp 8 batches pipelined:
    (8 + 1) / 8 half-model forwards per batch); the frozen copy's weights (fp32, sharded like the
    policy's) sit in the persistent memory of every phase and stage."""
    argv = _argv("dpo_lora.yaml", example, tmp_path / "l")
    rows, (lora, plain, *_), (lora_pp, plain_pp, *_), whole = run_world(_planned, 1, argv, timeout=60)[0]
    assert rows == 8
    assert lora["step_s"] == pytest.approx(plain["step_s"] + lora["reference_s"])
    assert 0.05 * plain["compute_s"] < lora["reference_s"] < 0.5 * plain["compute_s"]
    assert lora_pp["step_s"] == pytest.approx(plain_pp["step_s"] + lora_pp["reference_s"])
    # 3/4 of the forwards one after the other, + 3 sends (~7 % each here): below the former price,
    # the whole forward + its 2 sends
    assert 0.75 * whole < lora_pp["reference_s"] < whole
    argv = _argv("dpo.yaml", example, tmp_path / "p")
    _, (pre, plain, *_), (pre_pp, plain_pp, *_), whole = run_world(_planned, 1, argv, timeout=60)[0]
    assert pre["step_s"] == pytest.approx(plain["step_s"]) and pre["reference_pass_s_per_batch"] > 0
    assert pre_pp["step_s"] == pytest.approx(plain_pp["step_s"])
    assert 9 / 16 * whole < pre_pp["reference_pass_s_per_batch"] < 0.75 * whole
    argv = _argv("dpo.yaml", example, tmp_path / "f", 2, "--precompute_ref_log_probs", "false")
    _, (frozen, plain, mem, mem0, _), (frozen_pp, plain_pp, _, _, stages), _ = run_world(_planned, 1, argv,
                                                                                         timeout=60)[0]
    assert frozen["reference_s"] == pytest.approx(lora["reference_s"])
    assert frozen["step_s"] == pytest.approx(plain["step_s"] + frozen["reference_s"])
    assert frozen_pp["step_s"] == pytest.approx(plain_pp["step_s"] + frozen_pp["reference_s"])
    assert frozen["reference_gather_bytes"] > 0                   # its own ZeRO-3 gathers
    assert mem["reference"] == 4 * mem["param_elements"] == mem0["params"]   # dp_shard 2: its shard
    assert mem["total"] == mem0["total"] + mem["reference"]
    assert all(st["reference"] == 4 * st["param_elements"] > 0 for st in stages)


# Qwen3-MoE shaped (4 experts, top 2, every layer sparse): the tokenizer of the dense example
MOE = dict(TINY, model_type="qwen3_moe", num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           router_aux_loss_coef=0.05)


def _make_moe(directory, tokenizer_from):
    from minipar.trainer.checkpoint.save_load import copy_tokenizer
    from minipar.trainer.data.make_example import write_checkpoint
    from models.llama_config import LlamaConfig
    write_checkpoint(directory, LlamaConfig(**MOE), seed=0, dtype=torch.float32)
    copy_tokenizer(tokenizer_from, directory)


def test_moe_on_ep2_equals_one_process(tmp_path, example):
    """rl: dpo on a mixture of experts through train.py: dp_shard 2 with the experts split over ep 2
    (each rank holds 2 of the 4) equals one process running the same two micro-batches one after the
    other (the router's aux loss is per micro-batch, added as TRL adds it: coef x aux), within 1e-4,
    training and evaluation; at step 0 the loss is ln 2 plus that aux term, not ln 2 alone."""
    moe = str(tmp_path / "moe")
    run_world(_make_moe, 1, moe, example["model"], timeout=120)
    ex = dict(example, model=moe)
    micro = ["--micro_batch_size", "2", "--global_batch_size", "4"]
    one = run_world(_train, 1, _argv("dpo.yaml", ex, tmp_path / "one", 2, *micro,
                                     "--gradient_accumulation_steps", "2"), timeout=180)[0]
    two = run_world(_train, 2, _argv("dpo.yaml", ex, tmp_path / "two", 2, *micro, "--dp_shard_size", "2",
                                     "--expert_parallel_size", "2"), timeout=180)
    assert one[0]["loss"] > 0.6931471805599453 + 1e-6                  # ln 2 + coef x aux
    assert set(KEYS) <= set(one[-1]) and "eval_rewards/accuracies" in one[-1]
    _close(two[0], one)
    _close(two[1], one)
