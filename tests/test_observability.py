"""What a run reports: the planner's FLOP count in metrics.jsonl (tflops_per_s, mfu), a profiler
trace whose collectives are the ledger's, TensorBoard event files, wandb (offline) or a clear refusal."""
import json
import os
import re
import sys

import pytest
import torch
from harness import run_world

from minipar import comm_ledger
from minipar.gpus import gpu_peak_tflops, preset_for_device
from minipar.plan import Batch, Layout, ModelShape, Options
from minipar.plan import model as plan_model
from minipar.training.config.train_config import load_config
from minipar.training.run_setup import setup_run
from minipar.training.throughput import Throughput
from minipar.training.trainer import Trainer
from models.flops import step_flops
from models.llama_config import LlamaConfig
from train import planner_prediction

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [os.path.join(ROOT, "configs", "fsdp.yaml"), "--model.hidden_size", "64", "--model.intermediate_size",
        "128", "--model.num_hidden_layers", "2", "--model.num_attention_heads", "4",
        "--model.num_key_value_heads", "2", "--sequence_len", "32", "--global_batch_size", "4",
        "--max_steps", "3", "--warmup_steps", "1", "--eval_steps", "3", "--eval_batches", "1",
        "--progress_bar", "false", "--save_final_checkpoint", "false", "--export_hf", "false",
        "--dataset", os.path.join(ROOT, "data", "shakespeare.txt")]


def test_trainer_and_planner_count_the_same_flops():
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    shape = ModelShape.from_dict(vars(cfg))
    planned = plan_model.flops(shape, Layout(dp_shard=4), Batch(16, 4, 2048), Options())
    step = step_flops(cfg, 16, 2048)
    assert planned["model"] == step.causal and planned["model_full_attention"] == step.full
    # 6 N per token over the matmul weights (SmolLM-135M: 134.5 M parameters, 28.3 M of them the
    # tied embedding that the lm_head's matmul uses), attention 12 L H D s whole, half of it causal
    tokens, L, HD = 16 * 2048, 30, 9 * 64
    assert step.matmul == 6 * tokens * (L * (2 * 576 * HD + 2 * 576 * 3 * 64 + 3 * 576 * 1536) + 49152 * 576)
    assert step.attention_full == 2 * step.attention_causal == 12 * L * HD * 2048 * tokens


def test_the_summary_plans_a_preset_gpu_on_its_data_sheet():
    """train.py's prediction for the closing summary: on a GPU with a preset (minipar/gpus.py) the
    planner gets its HBM, memory and NVLink as well as the peak; elsewhere only the peak."""
    from minipar.config import ParallelismConfig
    cfg = load_config(TINY[0], TINY[1:])
    sizes = ParallelismConfig(dp_replicate_size=1, dp_shard_size=4, cp_size=1, tp_size=1, pp_size=1)
    predict = planner_prediction(cfg, sizes)
    h200, plain = predict(989.0, "NVIDIA H200"), predict(989.0, None)
    assert h200["gpu"] == "h200" and plain["gpu"] is None
    assert predict(756.0, "NVIDIA H100 PCIe")["gpu"] is None
    assert h200["tokens_per_s"] > plain["tokens_per_s"]       # the same peak, 4.8 TB/s of HBM, not 3.35


def test_peak_of_known_gpus_and_a_set_one():
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("NVIDIA L40S") == 362.0 and gpu_peak_tflops("NVIDIA L4") == 121.0
    assert gpu_peak_tflops("Some Future GPU") is None
    assert gpu_peak_tflops("NVIDIA GH200 480GB") == 989.0
    # the planner's presets: the SXM boards they describe, not the PCIe / NVL / 40GB variants
    assert [preset_for_device(n) for n in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB",
                                           "NVIDIA B200", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
                                           "NVIDIA A100-SXM4-40GB", "NVIDIA GH200 480GB", "NVIDIA L40S")] \
        == ["h100", "h200", "a100", "b200", None, None, None, None, None]
    cfg = load_config(TINY[0], TINY[1:] + ["--peak_tflops", "2.5"])
    t = Throughput(cfg, 4, torch.device("cpu"), torch.float32)
    flops = step_flops(cfg.model, 4, 32)
    got = t.of_step(0.5)
    assert got["tflops_per_s"] == pytest.approx(flops.causal / 0.5 / 4 / 1e12)
    assert got["mfu"] == pytest.approx(got["tflops_per_s"] / 2.5)
    assert got["mfu_full_attention"] == pytest.approx(flops.full / 0.5 / 4 / 1e12 / 2.5)


@pytest.mark.parametrize("argv,message", [
    (["--wandb_project", "p"], "needs the wandb package, which is not installed: pip install wandb"),
    (["--profile_steps", "[3, 2]"], "profile_steps must be \\[first, last\\]"),
    (["--profile_steps", "[2, 9]"], "ends after max_steps 3"),
    (["--peak_tflops", "0", "--wandb_mode", "offlin"], "2 config values are wrong: peak_tflops must be > 0.*"
                                                       "wandb_mode must be one of online, offline, disabled"),
])
def test_reporting_keys_are_checked_before_any_collective(tmp_path, argv, message):
    if "--wandb_project" in argv and _has("wandb"):
        pytest.skip("wandb is installed here")
    with pytest.raises(ValueError, match=message):
        setup_run(TINY + argv + ["--output_dir", str(tmp_path)])
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def _has(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


FAKE_WANDB = '''
import json, os
class _Run:
    def __init__(self, kw): self.kw, self.rows = kw, []
    def log(self, row, step): self.rows.append(dict(row, _step=step))
    def finish(self):
        with open(os.path.join(self.kw["dir"], "fake_wandb.json"), "w") as f:
            json.dump(dict(init={k: v for k, v in self.kw.items() if k != "config"}, rows=self.rows), f)
def init(**kw): return _Run(kw)
'''


def _train(argv, fake_wandb_dir=None):
    if fake_wandb_dir:        # a stand-in with wandb's calls, where wandb itself is not installed
        sys.path.insert(0, fake_wandb_dir)
    run = setup_run(argv)
    trainer, lines = Trainer(run, predict=planner_prediction(run.cfg, run.pgm.config)), []
    trainer.loop.log = lines.append
    trainer.train()
    return lines, planner_prediction(run.cfg, run.pgm.config)(0.05)


def test_metrics_tensorboard_and_wandb_offline(tmp_path):
    """One process, 3 steps: metrics.jsonl carries tflops_per_s and both MFUs, and the TensorBoard
    events and the wandb rows (offline) hold the same numbers under HF's tags."""
    out = tmp_path / "run"
    extra = ["--output_dir", str(out), "--peak_tflops", "0.05", "--use_tensorboard", "true",
             "--wandb_project", "minipar-test", "--wandb_mode", "offline"]
    fake = None
    if not _has("wandb"):
        fake = tmp_path / "fake"
        fake.mkdir()
        (fake / "wandb.py").write_text(FAKE_WANDB)
        sys.path.insert(0, str(fake))            # load_config's check looks for it in this process too
    try:
        lines, predicted = run_world(_train, 1, TINY + ["--dp_shard_size", "1"] + extra,
                                     str(fake) if fake else None, timeout=300)[0]
    finally:
        if fake:
            sys.path.remove(str(fake))
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    flops = step_flops(load_config(TINY[0], TINY[1:]).model, 4, 32).causal
    for r in rows:
        assert r["tflops_per_s"] == pytest.approx(flops / 1e12 * r["tokens_per_s"] / (4 * 32), rel=1e-6)
        assert r["mfu"] == pytest.approx(r["tflops_per_s"] / 0.05) and r["mfu_full_attention"] > r["mfu"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s", "train/mfu",
            "train/tflops_per_s", "eval/loss"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("train/mfu")] == \
        [(r["step"], pytest.approx(r["mfu"], rel=1e-6)) for r in rows]
    assert [e.step for e in events.Scalars("eval/loss")] == [3]
    summary = "\n".join(lines)               # the closing summary: measured, then the planner's prediction
    mean_mfu = sum(r["mfu"] for r in rows[1:]) / 2
    assert f"MFU {100 * mean_mfu:.1f} % (full attention" in summary
    assert "planner (python -m minipar.plan, at this peak" in summary
    assert f"{predicted['tokens_per_s']:.0f} tokens/s, MFU {100 * predicted['mfu']:.1f} %" in summary
    if not fake:                             # wandb itself: its offline run, for `wandb sync`
        assert list(out.glob("wandb/offline-run-*/run-*.wandb")), "no offline wandb run under output_dir"
    if fake:
        logged = json.load(open(out / "fake_wandb.json"))
        assert logged["init"]["mode"] == "offline" and logged["init"]["project"] == "minipar-test"
        assert [x["_step"] for x in logged["rows"]] == [1, 2, 3]
        assert logged["rows"][-1]["eval/loss"] == pytest.approx(rows[-1]["val_loss"])


SPAN = re.compile(r"^(all_reduce|all_gather|reduce_scatter|all_to_all|send_recv|send|broadcast):(\w+)$")


def _traced_and_ledgered(argv):
    trainer = Trainer(setup_run(argv))
    per_step, step_fn = {}, trainer.train_step

    def train_step(step):                         # the ledger of exactly what the trace's span covers
        with comm_ledger.ledger() as led:
            out = step_fn(step)
        per_step[step + 1] = {f"{op}:{g}": n for (op, g), (n, _) in led.summary().items()}
        return out
    trainer.train_step = train_step
    trainer.train()
    rank = trainer.pgm.global_rank
    with open(os.path.join(trainer.cfg.output_dir, "traces", f"rank{rank}.pt.trace.json")) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    traced = {}
    for number in (2, 3):
        step = next(e for e in events if e["name"] == f"train_step {number}")
        inside = [e["name"] for e in events if SPAN.match(e["name"])
                  and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        traced[number] = {k: inside.count(k) for k in set(inside)}
    waits = sum(e["name"].startswith("wait:all_gather:dp_shard_cp") for e in events)
    return traced, {k: per_step[k] for k in (2, 3)}, waits


def test_trace_collectives_per_step_equal_the_ledger(tmp_path):
    """dp_shard 2 x tp 2 (ZeRO-3 with prefetch, TP's collectives): the spans of steps 2 and 3 in each
    rank's trace are the ledger's calls of those steps, op by op and group by group."""
    argv = TINY + ["--dp_shard_size", "2", "--tensor_parallel_size", "2", "--profile_steps", "[2, 3]",
                   "--output_dir", str(tmp_path / "t"), "--peak_tflops", "1"]
    for traced, ledgered, waits in run_world(_traced_and_ledgered, 4, argv, timeout=300):
        assert traced == ledgered
        assert {"all_gather:dp_shard_cp", "reduce_scatter:dp_shard_cp", "all_reduce:tp"} <= set(traced[2])
        assert waits > 0                          # the prefetched gathers are waited on, visibly
