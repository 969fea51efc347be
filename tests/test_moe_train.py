"""A mixture of experts trained on a layout has the per-step loss of one process (the aux loss in
the objective), the same aux loss and load imbalance in metrics.jsonl, and with a capacity factor
drops the same copies; configs/moe.yaml runs as it says."""
import os

import pytest
import torch
from harness import run_world

from minipar.trainer.config.train_config import load_config
from minipar.trainer.data.tokenizer import save_byte_tokenizer
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a tiny Mixtral: 4 experts, top-2, a large aux coefficient so that the aux loss weighs in the loss
TINY_MOE = ["--model.model_type", "mixtral", "--model.num_local_experts", "4",
            "--model.num_experts_per_tok", "2", "--model.router_aux_loss_coef", "0.1",
            "--model.hidden_size", "32", "--model.intermediate_size", "48",
            "--model.num_hidden_layers", "2", "--model.num_attention_heads", "4",
            "--model.num_key_value_heads", "2", "--sequence_len", "16", "--global_batch_size", "8",
            "--micro_batch_size", "2", "--learning_rate", "1e-2", "--warmup_steps", "1", "--eval_steps", "0",
            "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
            "--logging_steps", "100", "--progress_bar", "false", "--save_final_checkpoint", "false",
            "--export_hf", "false"]
KEYS = ("loss", "grad_norm", "moe_aux_loss", "moe_imbalance", "moe_dropped")


def _train(argv):
    torch.set_num_threads(1)
    return [{k: r[k] for k in KEYS} for r in Trainer(setup_run(argv)).train()]


def _argv(out, steps, *extra):
    return [os.path.join(ROOT, "configs", "moe.yaml"), *TINY_MOE, "--max_steps", str(steps),
            "--output_dir", str(out), "--dp_shard_size", "1", "--expert_parallel_size", "1", *extra]


def _same(ref, got, rel=1e-4):
    assert len(ref) == len(got)
    for step, (a, b) in enumerate(zip(ref, got), 1):
        for key in ("loss", "grad_norm", "moe_aux_loss"):
            assert abs(a[key] - b[key]) <= rel * abs(a[key]), f"step {step}: {key} {b[key]} vs {a[key]}"
        assert b["moe_imbalance"] == pytest.approx(a["moe_imbalance"], rel=1e-6), f"step {step}"
        assert a["moe_dropped"] == b["moe_dropped"], f"step {step}: dropped"


_REF = {}


def _single(tmp_path, steps, *extra):
    if (steps, extra) not in _REF:
        _REF[steps, extra] = run_world(_train, 1, _argv(tmp_path / "one", steps, *extra), timeout=300)[0]
    return _REF[steps, extra]


@pytest.mark.parametrize("world,extra", [
    (2, ["--tensor_parallel_size", "2", "--sequence_parallel", "true"]),     # dropless
    (2, ["--dp_shard_size", "2", "--moe_capacity_factor", "1.0"]),           # dropping
], ids=["tp2-sp", "shard2-capacity"])
def test_moe_layout_equals_one_process(tmp_path, world, extra):
    capacity = [e for e in extra if e in ("--moe_capacity_factor", "1.0")]
    ref = _single(tmp_path, 4, *capacity)
    assert ref[0]["moe_aux_loss"] > 0.9 and len(ref[0]["moe_imbalance"]) == 2
    if capacity:                                   # a factor of 1 drops copies, and both drop the same
        assert all(r["moe_dropped"] > 0 for r in ref)
    else:
        assert all(r["moe_dropped"] == 0 for r in ref)
    for got in run_world(_train, world, _argv(tmp_path / "run", 4, *extra), timeout=300):
        _same(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [
    (4, ["--dp_shard_size", "4", "--expert_parallel_size", "2"]),            # configs/moe.yaml's layout
    (2, ["--context_parallel_size", "2"]),
    (4, ["--context_parallel_size", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true"]),
    (4, ["--dp_shard_size", "2", "--tensor_parallel_size", "2", "--gradient_checkpointing", "true"]),
], ids=["config-shard4", "cp2", "cp2-tp2-sp", "shard2-tp2-checkpointed"])
def test_moe_more_layouts_equal_one_process_for_20_steps(tmp_path, world, extra):
    ref = _single(tmp_path, 20)
    assert ref[-1]["loss"] < ref[0]["loss"]        # and it learns
    for got in run_world(_train, world, _argv(tmp_path / "run", 20, *extra), timeout=600):
        _same(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("coef", ["0.1", "0"])
def test_pipeline_equals_one_process(tmp_path, coef):
    """train.py on pp 2 (1F1B over 4 micro-batches, one MoE layer per stage): the aux loss pools both
    stages' counts (models/moe_aux.py's PipelineAux: side vectors forward and back), and the losses
    and gradient norms are one process's, with it and without it (router_aux_loss_coef 0); so are
    the step's aux loss, imbalance per layer and drops. The fast twin, far tighter, is
    tests/test_moe_layouts.py: every schedule's first-step gradients in fp64."""
    def losses(history):
        return [(r["loss"], r["grad_norm"]) for r in history]
    extra = ("--model.router_aux_loss_coef", coef)
    ref = run_world(_train_pp, 1, _argv(tmp_path / "one", 3, *extra), timeout=300)[0]
    got = run_world(_train_pp, 2, _argv(tmp_path / "pp", 3, *extra, "--pipeline_parallel_size", "2"),
                    timeout=300)
    for g in got:
        for (a, ga), (b, gb) in zip(losses(ref), losses(g)):
            assert abs(a - b) <= 1e-4 * a and abs(ga - gb) <= 1e-4 * ga, (coef, a, b, ga, gb)
        if coef != "0":                          # the step's figures too, gathered over the stages
            _same_moe(ref, g)


def _same_moe(ref, got):
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) <= 1e-5 * a["moe_aux_loss"], f"step {step}"
        assert b["moe_imbalance"] == pytest.approx(a["moe_imbalance"], rel=1e-6), f"step {step}"
        assert a["moe_dropped"] == b["moe_dropped"], f"step {step}"


def _train_pp(argv):
    torch.set_num_threads(1)
    return Trainer(setup_run(argv)).train()


def test_moe_config_refusals_name_every_value():
    """Refused on load, before any group exists: a capacity factor <= 0 (with the other wrong values
    in one error) or on a dense model, top-k above the experts."""
    moe = os.path.join(ROOT, "configs", "moe.yaml")
    with pytest.raises(ValueError, match=r"2 config values are wrong: learning_rate must be > 0.*"
                                         r"moe_capacity_factor=0\.0: a capacity factor is > 0"):
        load_config(moe, ["--moe_capacity_factor", "0", "--learning_rate", "-1"])
    with pytest.raises(ValueError, match=r"moe_capacity_factor=1\.5: .*applies to a mixture of experts"):
        load_config(os.path.join(ROOT, "configs", "ddp.yaml"), ["--moe_capacity_factor", "1.5"])
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and the number of experts"):
        load_config(moe, ["--model.num_experts_per_tok", "9"])
    assert load_config(moe, ["--moe_capacity_factor", "1.25"]).model.moe_capacity_factor == 1.25


def _first_step_and_hf_loss(argv):
    import transformers
    torch.set_num_threads(1)
    run = setup_run(argv)
    trainer = Trainer(run)
    ids, labels = trainer.sampler.global_batch(run.train_tokens, 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(run.cfg.base_model, dtype=torch.float32).eval()
    with torch.no_grad():     # our labels arrive shifted (label[t] = token t + 1): a plain mean CE
        out = hf(input_ids=ids, output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).double(), labels.flatten(),
                                               ignore_index=-100)
    ref = ce.item() + run.cfg.model.router_aux_loss_coef * out.aux_loss.item()   # the run's coefficient
    return trainer.train_step(0)["loss"], ref


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen3_moe"])
def test_hub_moe_checkpoint_first_step_equals_transformers(tmp_path, family):
    """make_example's writer puts a Hub-layout MoE (per-expert tensors, sharded with an index) on
    disk; base_model reads it on tp 2 with SP (each rank its attention slices, all experts), and the
    first step's loss, the aux loss included (its coefficient the run's, over config.json's), is
    transformers' on the same batch."""
    from minipar.trainer.data.make_example import EXAMPLES, write_checkpoint
    from models.llama_config import LlamaConfig
    shape = dict(EXAMPLES[family], vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, num_local_experts=4, router_aux_loss_coef=0.1)
    shape.update(intermediate_size=48, moe_intermediate_size=24, head_dim=16) if family == "qwen3_moe" else \
        shape.update(intermediate_size=48)
    base = str(tmp_path / "base")
    weight_map = write_checkpoint(base, LlamaConfig(**shape), dtype=torch.float32, max_shard_bytes=40_000)
    save_byte_tokenizer(base)                      # base_model is also the tokenizer: bytes here
    assert f"model.layers.1.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}.experts.3." \
        f"{'w2' if family == 'mixtral' else 'down_proj'}.weight" in weight_map
    argv = [os.path.join(ROOT, "configs", "finetune_moe.yaml"), "--base_model", base,
            "--output_dir", str(tmp_path / "out"), "--datasets", "[]", "--sample_packing", "false",
            "--val_set_size", "0", "--dataset", os.path.join(ROOT, "data", "shakespeare.txt"),
            "--sequence_len", "16", "--global_batch_size", "4", "--max_steps", "1", "--export_hf", "false",
            "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
            "--progress_bar", "false", "--context_parallel_size", "1", "--tensor_parallel_size", "2",
            "--sequence_parallel", "true", "--expert_parallel_size", "1",
            "--model.router_aux_loss_coef", "0.3"]                                  # over config.json's
    for got, ref in run_world(_first_step_and_hf_loss, 2, argv, timeout=300):
        assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [
    (4, ["--pipeline_schedule", "1f1b", "--dp_shard_size", "2", "--moe_capacity_factor", "1.0"]),
    (2, ["--pipeline_schedule", "interleaved_1f1b"]),                           # two chunks per rank
    (2, ["--pipeline_schedule", "zbv"]),                                        # the V: a turn kept local
    (4, ["--pipeline_schedule", "zb_h1", "--tensor_parallel_size", "2", "--sequence_parallel", "true"]),
    (4, ["--pipeline_schedule", "1f1b", "--context_parallel_size", "2"]),
    (4, ["--pipeline_schedule", "1f1b", "--dp_shard_size", "2", "--expert_parallel_size", "2"]),
], ids=["1f1b-shard2-capacity", "interleaved", "zbv", "zb_h1-tp2-sp", "1f1b-cp2", "1f1b-shard2-ep2"])
def test_moe_pipeline_schedules_equal_one_process(tmp_path, world, extra):
    """Every schedule carries the aux loss's side vectors (forward with the activations, back with
    their gradients), alone and beside ZeRO-3 (with drops past capacity), TP + SP, CP and EP: 6
    steps of train.py as one process's, the step's MoE figures included. The fast twins, in fp64
    on the model: tests/test_moe_layouts.py's pp2-* cases."""
    four = ("--model.num_hidden_layers", "4")
    capacity = ("--moe_capacity_factor", "1.0") if "--moe_capacity_factor" in extra else ()
    ref = _single(tmp_path, 6, *four, *capacity)
    for got in run_world(_train_pp, world, _argv(tmp_path / "run", 6, *four, "--pipeline_parallel_size", "2",
                                              *extra), timeout=600):
        for step, (a, b) in enumerate(zip(ref, got), 1):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-4 * abs(a[key]), f"step {step}: {key} {b[key]} vs {a[key]}"
        _same_moe(ref, got)
