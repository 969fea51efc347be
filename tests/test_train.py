"""train.py end to end: every layout of configs/ has the loss curve of one process."""
import glob
import json
import os
import signal

import pytest
import torch
from harness import RankError, run_world

from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tiny test model: every code path, a fraction of the default's cost
TINY = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "32",
        "--global_batch_size", "8", "--max_steps", "20", "--warmup_steps", "5", "--eval_steps", "10",
        "--eval_batches", "1", "--logging_steps", "100", "--progress_bar", "false", "--save_steps", "0",
        "--save_final_checkpoint", "false", "--export_hf", "false"]


def _train(argv):
    torch.set_num_threads(1)
    history = Trainer(setup_run(argv)).train()
    return [(r["step"], r["loss"], r.get("val_loss"), r["grad_norm"]) for r in history]


def _argv(config, out, *extra, report=False):
    # report=False: MFU's peak given, so that no rank measures its CPU's (six 1024 x 1024 matmuls, 0.1 s
    # of CPU a rank), and no loss-curve PNG (0.2 s on rank 0): what no test here but the metrics one reads
    quiet = [] if report else ["--peak_tflops", "1", "--loss_curve", "false"]
    return [os.path.join(ROOT, "configs", config), *TINY, *quiet, "--output_dir", str(out),
            "--dataset", os.path.join(ROOT, "data", "shakespeare.txt"), *extra]


def _world_of(config):
    import yaml
    with open(os.path.join(ROOT, "configs", config)) as f:
        d = yaml.safe_load(f)
    n = 1
    for k in ("dp_replicate_size", "dp_shard_size", "context_parallel_size", "tensor_parallel_size",
              "pipeline_parallel_size"):
        n *= d.get(k) or 1
    return n


# one single-process run per option set, shared by every test that compares a layout with it
# (the curve does not depend on where the run writes; computing it once saves ~20 s of the suite)
_REFERENCE_CURVES = {}


def _single(tmp_path, *extra):
    # the reference: one process, every size 1 (the config's sizes fall back on a world of one)
    # (forked, so that this test process never holds a default group)
    if extra not in _REFERENCE_CURVES:
        _REFERENCE_CURVES[extra] = run_world(
            _train, 1, _argv("ddp.yaml", tmp_path / "single", "--dp_replicate_size", "1", *extra),
            timeout=300)[0]
    return _REFERENCE_CURVES[extra]


# The curves' length: the default suite's twins run 10 steps (the evaluation at step 10 among them),
# `make test-slow` the same layouts for TINY's full 20
STEPS = [pytest.param(10, id="10-steps"), pytest.param(20, id="20-steps", marks=pytest.mark.slow)]


def _steps(n):
    return ["--max_steps", str(n)]


def _assert_same_curve(ref, got, steps, rel=1e-4):
    assert len(got) == len(ref) == steps
    for (s, a, va, ga), (_, b, vb, gb) in zip(ref, got):
        assert abs(a - b) <= rel * abs(a), f"step {s}: loss {b} vs single-process {a}"
        assert abs(ga - gb) <= rel * abs(ga), f"step {s}: grad_norm {gb} vs {ga}"
        if va is not None:
            assert vb is not None and abs(va - vb) <= rel * abs(va), f"step {s}: val_loss {vb} vs {va}"


def _pipelined(path):
    import yaml
    with open(path) as f:
        return (yaml.safe_load(f).get("pipeline_parallel_size") or 1) > 1


# the pipeline layouts need more layers than TINY's 2: tests/test_pipeline.py runs them; the
# mixture of experts is another model than the reference's: tests/test_moe_train.py runs moe.yaml;
# lora.yaml (a base_model run, like finetune.yaml) is tests/test_lora_hf.py's; dpo.yaml and
# dpo_lora.yaml (base_model runs on make_example's preference set) tests/test_dpo_train.py's
CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                 if not p.endswith(("default.yaml", "finetune.yaml", "lora.yaml", "moe.yaml", "dpo.yaml"))
                 and not _pipelined(p))


# configs/cp_ulysses.yaml and cp_usp.yaml: 20 steps here (slow); their 10 steps are tests/test_cp_impls.py's
# cases cp4-ulysses and cp4-usp2 (the same files, and the count of their all-to-alls)
IN_CP_IMPLS = ("cp_ulysses.yaml", "cp_usp.yaml")


@pytest.mark.parametrize("config, steps", [
    pytest.param(c, n, id=f"{c}-{n}-steps", marks=pytest.mark.slow if n == 20 else ())
    for c in CONFIGS for n in ((20,) if c in IN_CP_IMPLS else (10, 20))])
def test_config_matches_single_process(tmp_path, config, steps):
    ref = _single(tmp_path, *_steps(steps))
    world = _world_of(config)
    results = run_world(_train, world, _argv(config, tmp_path / "run", *_steps(steps)), timeout=600)
    for got in results:                     # every rank saw the same loss
        _assert_same_curve(ref, got, steps)
    assert ref[-1][1] < ref[0][1]           # and it learns
    assert not os.path.exists(tmp_path / "run" / "loss_curve.png")   # loss_curve: false (metrics test: true)


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("world,extra", [
    (2, ["--tensor_parallel_size", "2"]),                                   # TP alone
    (2, ["--tensor_parallel_size", "2", "--sequence_parallel", "true"]),    # TP + sequence parallelism
    (2, ["--context_parallel_size", "2"]),                                  # CP alone (DDP over cp)
    (4, ["--context_parallel_size", "2", "--dp_shard_size", "2"]),          # CP + ZeRO-3 over dp_shard x cp
    (4, ["--context_parallel_size", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true"]),
    (2, ["--dp_shard_size", "2", "--micro_batch_size", "2", "--fsdp.sync_each_batch", "false"]),
], ids=["tp2", "tp2-sp", "cp2", "cp2-shard2", "cp2-tp2-sp", "shard2-accumulate-no-sync"])
def test_more_layouts_match_single_process(tmp_path, world, extra, steps):
    ref = _single(tmp_path, *_steps(steps))
    got = run_world(_train, world, _argv("ddp.yaml", tmp_path / "run", "--dp_replicate_size", "1", *extra,
                                         *_steps(steps)), timeout=300)
    for g in got:
        _assert_same_curve(ref, g, steps)


CLIP, ACCUMULATE, CHECKPOINT = (["--max_grad_norm", "0.05"],         # clipping active on every step
                                ["--micro_batch_size", "1"],           # gradient accumulation
                                ["--gradient_checkpointing", "true"])  # activation checkpointing


# the fast twin: the three options at once (any one of them wrong changes the curve) on HSDP x TP for
# 10 steps; the slow tests run it for 20, each option alone, so that a failure names the option, and all
# on dp_shard x cp x tp
OPTIONS = dict(zip(["all-three", "clipping", "accumulation", "checkpointing"],
                   [CLIP + ACCUMULATE + CHECKPOINT, CLIP, ACCUMULATE, CHECKPOINT]))
LAYOUTS_4D = {"hsdp_tp": ("hsdp_tp.yaml", []), "shard_cp_tp": ("cp_tp.yaml", ["--dp_shard_size", "2"])}


@pytest.mark.parametrize("option, layout, steps", [
    pytest.param("all-three", "hsdp_tp", 10, id="all-three-hsdp_tp-10-steps"),
    *[pytest.param(option, layout, 20, id=f"{option}-{layout}", marks=pytest.mark.slow)
      for layout in LAYOUTS_4D for option in OPTIONS]])
def test_options_match_single_process_on_4d_layouts(tmp_path, option, layout, steps):
    extra, (config, sizes) = OPTIONS[option], LAYOUTS_4D[layout]
    ref = _single(tmp_path, *extra, *_steps(steps))
    if "--max_grad_norm" in extra:
        assert all(g > 0.05 for _, _, _, g in ref)       # the clip really engages
    argv = _argv(config, tmp_path / "run", *sizes, *extra, *_steps(steps))
    for g in run_world(_train, 8, argv, timeout=600):
        _assert_same_curve(ref, g, steps)   # every rank


def test_single_process_run_writes_metrics_and_plot(tmp_path):
    hist = run_world(_train, 1, _argv("default.yaml", tmp_path / "d", report=True), timeout=300)[0]
    lines = [json.loads(x) for x in open(tmp_path / "d" / "metrics.jsonl")]
    assert [x["step"] for x in lines] == list(range(1, 21))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"} <= set(lines[0])
    assert "val_loss" in lines[9] and "val_loss" in lines[19]
    assert os.path.exists(tmp_path / "d" / "loss_curve.png")
    assert hist[-1][1] < hist[0][1]


@pytest.mark.parametrize("argv,message", [
    (["--learning_rat", "0.1"], "Did you mean 'learning_rate'"),
    (["--model.hidden_siz", "64"], "Did you mean 'model.hidden_size'"),
    (["--dataset", "/nonexistent/file.txt"], "dataset file"),
    (["--tensor_parallel_size", "3"], "to world size 1"),
    (["--context_parallel_size", "1", "--tensor_parallel_size", "1", "--dp_shard_size", "1",
      "--unknown_thing", "1"], "unknown config key 'unknown_thing'"),
])
def test_bad_input_is_a_clear_error(tmp_path, argv, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        setup_run([os.path.join(ROOT, "configs", "default.yaml"), *argv, "--output_dir", str(tmp_path)])


def _bad_world(argv):
    try:
        setup_run(argv)
    except ValueError as err:
        return str(err)
    return "no error"


def test_world_that_does_not_fit_fails_on_every_rank(tmp_path):
    # 6 ranks cannot hold cp 2 x tp 2: every rank raises the same error before any collective
    out = run_world(_bad_world, 6,
                    [os.path.join(ROOT, "configs", "default.yaml"), "--output_dir", str(tmp_path)],
                    timeout=60)
    assert all("world size 6" in o and "tp_size=2" in o for o in out), out[0]
    out = run_world(_bad_world, 2, _argv("ddp.yaml", tmp_path, "--dp_replicate_size", "2",
                                         "--context_parallel_size", "1", "--sequence_len", "30",
                                         "--model.num_attention_heads", "3", "--tensor_parallel_size", "2",
                                         "--dp_replicate_size", "1"), timeout=60)
    assert all("num_attention_heads" in o for o in out), out[0]


# ------------------------------------------------------------------------ kill and resume
def kill_at_step(kill_at):
    """From now on in this (forked) rank, the Trainer SIGKILLs its process at step `kill_at` (after
    `kill_at` completed steps): no cleanup, no finally blocks, as when a node dies or the job is
    cancelled. tests/test_stream.py uses it too."""
    original = Trainer.train_step

    def train_step(self, step):
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, step)

    Trainer.train_step = train_step


def _train_until_killed(argv, kill_at):
    kill_at_step(kill_at)
    _train(argv)


def _curve_after(history, step):
    return [h for h in history if h[0] > step]


# (ranks, the run's layout, the other layout it resumes on, steps, save every, killed at): the slow
# case is the 8-rank 3D default run; its fast twin kills a dp_shard 2 run sooner and resumes on tp 2
KILL_CASES = {
    "8-ranks": (8, ["--dp_shard_size", "2"], ["--dp_shard_size", "4", "--context_parallel_size", "1"],
                20, 5, 12),
    "2-ranks": (2, ["--dp_shard_size", "2", "--context_parallel_size", "1", "--tensor_parallel_size", "1"],
                ["--dp_shard_size", "1", "--context_parallel_size", "1", "--tensor_parallel_size", "2"],
                8, 3, 7),
}


@pytest.mark.parametrize("case", [pytest.param("8-ranks", marks=pytest.mark.slow), "2-ranks"])
def test_kill_and_resume_same_and_other_layouts(tmp_path, case):
    n, layout, other_layout, steps, every, kill_at = KILL_CASES[case]
    last = (kill_at - 1) // every * every          # the newest checkpoint before the kill
    out = tmp_path / "run"
    run = ["--max_steps", str(steps), *layout]
    save = ["--save_steps", str(every), "--save_total_limit", "5"]
    # uninterrupted
    fulls = run_world(_train, n, _argv("default.yaml", tmp_path / "full", *run), timeout=600)
    full = fulls[0]
    assert all(f == full for f in fulls), "every rank logs the same (all-reduced) curve"
    # the same run killed at step kill_at: the checkpoints before it exist
    with pytest.raises(RankError, match="killed"):
        run_world(_train_until_killed, n, _argv("default.yaml", out, *run, *save), kill_at, timeout=600)
    assert {f"step-{s}" for s in range(every, last + 1, every)} <= set(os.listdir(out))
    resume = ["--resume_from_checkpoint", "latest"]
    # resumed on the same layout: the same curve, step for step
    for same in run_world(_train, n, _argv("default.yaml", out, *run, *resume), timeout=600):
        assert [h[0] for h in _curve_after(same, last)] == list(range(last + 1, steps + 1))
        for a, b in zip(_curve_after(full, last), _curve_after(same, last)):
            assert abs(a[1] - b[1]) <= 1e-6 * abs(a[1]), (a, b)
    # resumed from the last checkpoint on another layout and on one process
    saved = str(out / f"step-{last}")
    other = run_world(_train, n, _argv("default.yaml", tmp_path / "other", "--max_steps", str(steps),
                                       *other_layout, "--resume_from_checkpoint", saved), timeout=600)
    single = run_world(_train, 1, _argv("default.yaml", tmp_path / "single1", "--max_steps", str(steps),
                                        "--resume_from_checkpoint", saved), timeout=600)[0]
    for resumed in (*other, single):                 # every rank of the other layout
        got = _curve_after(resumed, last)
        assert [h[0] for h in got] == list(range(last + 1, steps + 1))
        for a, b in zip(_curve_after(full, last), got):
            assert abs(a[1] - b[1]) <= 1e-4 * abs(a[1]), (a, b)


def _resume_error(argv):
    try:
        _train(argv)
    except (ValueError, FileNotFoundError) as err:
        return str(err)
    return "no error"


def test_sequence_cp_cannot_split_and_other_model_shape(tmp_path):
    out = run_world(_bad_world, 2, _argv("ddp.yaml", tmp_path, "--dp_replicate_size", "1",
                                         "--context_parallel_size", "2", "--sequence_len", "30"), timeout=60)
    assert all("sequence length 30 is not divisible by 2 * cp_size = 4" in o for o in out), out[0]
    run_world(_train, 2, _argv("ddp.yaml", tmp_path / "a", "--dp_replicate_size", "2", "--max_steps", "2",
                               "--save_steps", "1"), timeout=120)
    errors = run_world(_resume_error, 2, _argv("ddp.yaml", tmp_path / "b", "--dp_replicate_size", "2",
                                               "--model.intermediate_size", "192",
                                               "--resume_from_checkpoint", str(tmp_path / "a" / "step-1")),
                       timeout=120)
    assert all("intermediate_size" in e for e in errors), errors[0]


def test_damaged_checkpoint_is_refused_on_every_rank(tmp_path):
    out = tmp_path / "run"
    run_world(_train, 4, _argv("fsdp_tp.yaml", out, "--max_steps", "4", "--save_steps", "2"), timeout=300)
    step2 = out / "step-2"
    victim = max((p for p in step2.rglob("*") if p.is_file() and p.name != "manifest.json"),
                 key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    errors = run_world(_resume_error, 4, _argv("fsdp_tp.yaml", tmp_path / "again",
                                               "--resume_from_checkpoint", str(step2)), timeout=120)
    assert all(victim.name in e for e in errors), errors[0]


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("config", ["fsdp_tp.yaml", "cp_tp.yaml"])
def test_bf16_stays_within_bf16_tolerance_of_fp32(tmp_path, config, steps):
    ref = _single(tmp_path, *_steps(steps))
    argv = _argv(config, tmp_path / "bf16", "--dtype", "bfloat16", *_steps(steps))
    for got in run_world(_train, 4, argv, timeout=300):
        assert len(got) == len(ref) == steps
        for (s, a, _, _), (_, b, _, _) in zip(ref, got):
            assert abs(a - b) <= 2e-2 * abs(a), f"step {s}: bf16 loss {b} vs fp32 {a}"
        assert got[-1][1] < got[0][1] - 1.0


def test_exported_hf_directory_loads_in_transformers(tmp_path):
    import transformers

    from models.llama import LlamaForCausalLM
    out = tmp_path / "run"
    run_world(_train, 4, _argv("fsdp_tp.yaml", out, "--max_steps", "3", "--export_hf", "true",
                               "--save_final_checkpoint", "true"), timeout=300)
    ours = LlamaForCausalLM.from_pretrained(str(out / "hf")).eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(str(out / "hf")).float().eval()
    # on request: the sharded step-3 checkpoint of the 4-rank run, exported on one process
    from minipar.trainer.checkpoint.export import export_checkpoint
    export_checkpoint(str(out / "step-3"), str(tmp_path / "hf-step-3"))
    again = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf-step-3")).float().eval()
    ids = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-5)


def _layout(argv):
    return setup_run(argv).pgm.shape


def test_command_line_sizes_replace_the_default_layout(tmp_path):
    # no config given: --tensor_parallel_size 2 on 2 ranks is plain TP, not the default's cp 2 x tp 2
    assert run_world(_layout, 2, ["--tensor_parallel_size", "2", "--output_dir", str(tmp_path)]) \
        == [(1, 1, 1, 2)] * 2
    # the default layout itself, on 8 ranks: dp_shard 2 (the remainder) x cp 2 x tp 2
    assert run_world(_layout, 8, ["--output_dir", str(tmp_path)]) == [(1, 2, 2, 2)] * 8
    # an explicit config combines with the command line
    assert run_world(_layout, 8, [os.path.join(ROOT, "configs", "cp_tp.yaml"), "--dp_shard_size", "2",
                                  "--output_dir", str(tmp_path)]) == [(1, 2, 2, 2)] * 8


def _state_per_rank(argv):
    """(ZeRO-3 on?, this rank's fp32 parameter elements, the model's) after one step."""
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    trainer.train_step(0)
    mine = sum(p.numel() for p in trainer.model.parameters())
    return hasattr(trainer.model, "zero3"), mine, trainer.n_params


def test_cp_only_layout_shards_the_model_over_the_cp_ranks(tmp_path):
    """Issue 24, item 1: with dp_shard_size 1 and cp 2 the two cp ranks hold the same parameters;
    ZeRO-3 over dp_shard_cp shares them out, so each rank keeps half (its padded shard), as
    accelerate's FSDP mesh does, instead of the whole model twice. (The curve of this layout is
    test_more_layouts_match_single_process[cp2-10-steps] and [cp2-20-steps].)"""
    got = run_world(_state_per_rank, 2, _argv("ddp.yaml", tmp_path / "run", "--dp_replicate_size", "1",
                                              "--dp_shard_size", "1", "--context_parallel_size", "2"),
                    timeout=300)
    for sharded, mine, total in got:
        assert sharded, "cp 2 with dp_shard 1 ran without ZeRO-3"
        assert total / 2 <= mine < total / 2 + 64 * 4, (mine, total)   # half, plus unit padding
