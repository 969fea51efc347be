"""train.py with expert parallelism: an MoE run on ep ranks borrowed from dp_shard (x cp) has the
per-step loss of one process (the aux loss in the objective), its aux loss, load imbalance and
dropped copies; and its checkpoints move across ep sizes (minipar/expert_parallel/, minipar/zero3/,
the checkpoint's ep segments in minipar/trainer/checkpoint/layout.py)."""
import os

import pytest
import torch
from harness import run_world

from minipar.trainer.data.make_example import main as make_example
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a tiny Mixtral: 4 experts, top-2, an aux loss big enough to matter
MOE = ["--model.model_type", "mixtral", "--model.num_local_experts", "4", "--model.num_experts_per_tok",
       "2", "--model.router_aux_loss_coef", "0.05", "--model.hidden_size", "64", "--model.intermediate_size",
       "64", "--model.num_hidden_layers", "2", "--model.num_attention_heads", "4",
       "--model.num_key_value_heads", "2",
       "--sequence_len", "32", "--global_batch_size", "8", "--warmup_steps", "2", "--eval_steps", "0",
       "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
       "--logging_steps", "100", "--progress_bar", "false", "--export_hf", "false",
       "--dataset", os.path.join(ROOT, "data", "shakespeare.txt"), "--dp_replicate_size", "1"]


def _train(argv):
    """(ep size, experts of one MoE layer on this rank, [(step, loss, grad_norm)])."""
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    history = trainer.train()
    experts = trainer.model.model.layers[0].mlp.experts.gate_proj.shape[0]
    return trainer.pgm.ep.size, experts, [(r["step"], r["loss"], r["grad_norm"]) for r in history]


def _argv(out, *extra):
    return [os.path.join(ROOT, "configs", "ddp.yaml"), *MOE, "--output_dir", str(out), *extra]


KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_imbalance", "moe_dropped")


def _train_metrics(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    return trainer.pgm.ep.size, [{k: r[k] for k in KEYS} for r in trainer.train()]


def _curve_argv(out, steps, *extra):
    # micro-batches of 2 rows on every layout: the aux loss sees the same tokens as one process's
    return _argv(out, "--max_steps", str(steps), "--micro_batch_size", "2", "--save_final_checkpoint",
                 "false", "--learning_rate", "1e-2", *extra)


_REF = {}


def _single(tmp_path, steps, *extra):
    if (steps, extra) not in _REF:
        _REF[steps, extra] = run_world(_train_metrics, 1, _curve_argv(tmp_path / "one", steps, *extra),
                                       timeout=300)[0][1]
    return _REF[steps, extra]


def _same(ref, got, rel=1e-4):
    assert len(ref) == len(got)
    for step, (a, b) in enumerate(zip(ref, got), 1):
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert abs(a[key] - b[key]) <= rel * abs(a[key]), f"step {step}: {key} {b[key]} vs {a[key]}"
        assert b["moe_imbalance"] == pytest.approx(a["moe_imbalance"], rel=1e-5), f"step {step}"
        assert a["moe_dropped"] == b["moe_dropped"], f"step {step}: dropped"


CAPACITY = ("--moe_capacity_factor", "1.0")


@pytest.mark.parametrize("world,steps,capacity,extra", [
    # the fast twin: 3 steps, with a capacity factor (the dropped copies are one process's)
    (2, 3, CAPACITY, ["--dp_shard_size", "2", "--expert_parallel_size", "2"]),
    # 20 steps, dropless (under cp the caps are a rank's own tokens': models/moe.py); their fast
    # twins, in fp64 and on the model, are tests/test_moe_layouts.py's
    pytest.param(4, 20, (), ["--dp_shard_size", "4", "--expert_parallel_size", "4"], marks=pytest.mark.slow),
    pytest.param(4, 20, CAPACITY, ["--dp_shard_size", "4", "--expert_parallel_size", "2"],
                 marks=pytest.mark.slow),
    pytest.param(4, 20, (), ["--dp_shard_size", "2", "--tensor_parallel_size", "2",
                             "--expert_parallel_size", "2", "--gradient_checkpointing", "true"],
                 marks=pytest.mark.slow),
    pytest.param(8, 20, (), ["--dp_shard_size", "2", "--context_parallel_size", "2", "--tensor_parallel_size",
                             "2", "--expert_parallel_size", "4"], marks=pytest.mark.slow),
    pytest.param(4, 20, (), ["--dp_replicate_size", "2", "--dp_shard_size", "2",
                             "--expert_parallel_size", "2"], marks=pytest.mark.slow),
], ids=["shard2-ep2-capacity", "shard4-ep4", "shard4-ep2-capacity", "shard2-tp2-ep2-checkpointed",
        "shard2-cp2-tp2-ep4", "hsdp-ep2"])
def test_ep_layout_equals_one_process(tmp_path, world, steps, capacity, extra):
    ref = _single(tmp_path, steps, *capacity)
    assert all((r["moe_dropped"] > 0) == bool(capacity) for r in ref)
    if steps == 20:
        assert ref[-1]["loss"] < ref[0]["loss"]           # and it learns
    ep = int(extra[extra.index("--expert_parallel_size") + 1])
    for size, got in run_world(_train_metrics, world, _curve_argv(tmp_path / "run", steps, *capacity, *extra),
                               timeout=600):
        assert size == ep
        _same(ref, got)


@pytest.mark.parametrize("kind,resume_on", [
    # the fast twin: resumed on one process, no ep at all
    ("SHARDED_STATE_DICT", [(1, ())]),
    # resumed on dp_shard 2 at ep 1 (each rank all four experts, ZeRO-3 over both) and on dp_shard 4
    # at ep 4 (one expert each)
    pytest.param("FULL_STATE_DICT", [(2, ("--dp_shard_size", "2", "--expert_parallel_size", "1")),
                                     (4, ("--dp_shard_size", "4", "--expert_parallel_size", "4"))],
                 marks=pytest.mark.slow),
], ids=["sharded-to-one-process", "full-to-ep1-and-ep4"])
def test_checkpoint_saved_at_ep2_resumes_on_other_ep(tmp_path, kind, resume_on):
    """dp_shard 2 x ep 2 for 3 steps, saving at step 2; resumed from it on another layout, step 3
    has the same loss and grad norm (micro-batches of 2 rows everywhere: the aux loss sees the same
    tokens)."""
    mb = ("--micro_batch_size", "2")
    steps = ["--max_steps", "3", "--save_steps", "2", "--save_total_limit", "3",
             "--fsdp.state_dict_type", kind, *mb]
    full = run_world(_train, 2, _argv(tmp_path / "ep2", "--dp_shard_size", "2",
                                      "--expert_parallel_size", "2", *steps), timeout=300)
    assert [f[:2] for f in full] == [(2, 2)] * 2      # two experts on each rank
    assert full[1][2] == full[0][2]                   # every rank logs the one curve
    for world, layout in resume_on:
        ep = 1 if world == 1 else int(layout[-1])
        for rank, resumed in enumerate(run_world(_train, world, _argv(
                tmp_path / f"resumed{world}", *layout, "--max_steps", "3", *mb, "--resume_from_checkpoint",
                str(tmp_path / "ep2" / "step-2")), timeout=300)):
            assert resumed[:2] == (ep, 4 // ep)
            assert [s for s, _, _ in resumed[2]] == [3]
            for (s, a, ga), (_, b, gb) in zip(full[0][2][2:], resumed[2]):
                assert abs(a - b) <= 1e-5 * abs(a) and abs(ga - gb) <= 1e-4 * abs(ga), \
                    (world, rank, s, a, b, ga, gb)


def _finetune(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    return trainer.pgm.ep.size, [(r["step"], r["loss"], r["grad_norm"]) for r in trainer.train()]


@pytest.mark.slow
def test_finetune_moe_reads_only_its_experts_and_equals_ep1(tmp_path):
    """configs/finetune_moe.yaml from a Hub-layout Mixtral (per-expert tensors, sharded safetensors):
    its 8-rank layout (dp_shard 2 x cp 2 x tp 2, ep 4, each rank reading its 2 experts) has the
    losses of the same layout at ep 1, every rank reading all 8."""
    make_example([str(tmp_path / "ex"), "--model", "mixtral"])
    argv = [os.path.join(ROOT, "configs", "finetune_moe.yaml"),
            "--base_model", str(tmp_path / "ex" / "model"),
            "--datasets", f'[{{"path": "{tmp_path / "ex" / "chat.jsonl"}", "type": "chat_template"}}]',
            "--max_steps", "3", "--sequence_len", "128", "--global_batch_size", "4", "--progress_bar",
            "false", "--eval_steps", "0", "--save_steps", "0", "--save_final_checkpoint", "false",
            "--export_hf", "false", "--dataset_prepared_path", str(tmp_path / "prepared")]
    runs = {ep: run_world(_finetune, 8, argv + ["--output_dir", str(tmp_path / f"ep{ep}"),
                                                "--expert_parallel_size", str(ep)], timeout=900)
            for ep in (4, 1)}
    assert [r[0] for r in runs[4]] == [4] * 8 and [r[0] for r in runs[1]] == [1] * 8
    for rank in range(8):                             # every rank against every rank of ep 1
        for (s, a, ga), (_, b, gb) in zip(runs[1][0][1], runs[4][rank][1]):
            assert abs(a - b) <= 1e-5 * abs(a) and abs(ga - gb) <= 1e-4 * abs(ga), (rank, s, a, b, ga, gb)
        assert runs[1][rank][1] == runs[1][0][1]


def _refusal(argv):
    try:
        setup_run(argv)
    except ValueError as err:
        return str(err)
    return "no error"


def test_an_ep_the_layout_cannot_hold_is_refused_on_every_rank(tmp_path):
    """Before any group exists, on every rank, every problem in one error naming the values."""
    moe = _argv(tmp_path / "bad", "--model.num_local_experts", "3", "--dp_shard_size", "1",
                "--tensor_parallel_size", "2", "--expert_parallel_size", "2")
    for err in run_world(_refusal, 2, moe, timeout=60, init=False):
        assert "the 3 experts cannot be split over expert_parallel_size=2" in err, err
        assert "expert_parallel_size=2 does not divide dp_shard_size x context_parallel_size = 1 x 1" in err
    dense = [os.path.join(ROOT, "configs", "ddp.yaml"), "--dp_replicate_size", "1", "--dp_shard_size", "2",
             "--expert_parallel_size", "2", "--output_dir", str(tmp_path / "dense")]
    for err in run_world(_refusal, 2, dense, timeout=60, init=False):
        assert "expert_parallel_size=2 needs a Mixture-of-Experts model, and this model is dense" in err, err


def _train_loss(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    return trainer.pgm.ep.size, [(r["loss"], r["grad_norm"]) for r in trainer.train()]


@pytest.mark.slow
def test_pp2_shard2_ep2_equals_one_process(tmp_path):
    """pp 2 x dp_shard 2 x ep 2 on 4 ranks, 20 steps, equal to one process, the aux loss in the
    objective (the stages pass its counts along: models/moe_aux.py's PipelineAux). The fast twin,
    in fp64 on the model: tests/test_moe_layouts.py's pp2-shard2-ep2."""
    ref = run_world(_train_loss, 1, _curve_argv(tmp_path / "one", 20), timeout=300)[0][1]
    assert ref[-1][0] < ref[0][0]
    layout = ("--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--expert_parallel_size", "2")
    for ep, got in run_world(_train_loss, 4, _curve_argv(tmp_path / "pp", 20, *layout), timeout=600):
        assert ep == 2 and len(got) == 20
        for step, ((a, ga), (b, gb)) in enumerate(zip(ref, got), 1):
            assert abs(a - b) <= 1e-4 * abs(a) and abs(ga - gb) <= 1e-4 * abs(ga), (step, a, b, ga, gb)
