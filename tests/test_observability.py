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
from minipar.plan import Batch, Layout, ModelShape, Options, collectives
from minipar.plan import model as plan_model
from minipar.trainer.config.train_config import load_config
from minipar.trainer.prediction import from_train_config, planner_prediction
from minipar.trainer.run_setup import setup_run
from minipar.trainer.throughput import Throughput
from minipar.trainer.trainer import Trainer
from models.flops import step_flops
from models.llama_config import LlamaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [os.path.join(ROOT, "configs", "fsdp.yaml"), "--model.hidden_size", "64", "--model.intermediate_size",
        "128", "--model.num_hidden_layers", "2", "--model.num_attention_heads", "4",
        "--model.num_key_value_heads", "2", "--sequence_len", "32", "--global_batch_size", "4",
        "--max_steps", "3", "--warmup_steps", "1", "--eval_steps", "3", "--eval_batches", "1",
        "--progress_bar", "false", "--save_final_checkpoint", "false", "--export_hf", "false",
        "--dataset", os.path.join(ROOT, "data", "shakespeare.txt")]


def _hand_flops(tokens, L, d, f, V, H, K, D, s):
    """6 N per token over the matmul weights (q, o: d H D; k, v: d K D; gate, up, down: d f; the
    lm_head V d, tied or not), attention 12 L H D s per token whole, half of it causal."""
    matmul = 6 * tokens * (L * (2 * d * H * D + 2 * d * K * D + 3 * d * f) + V * d)
    return matmul, matmul + 6 * L * H * D * s * tokens, matmul + 12 * L * H * D * s * tokens


def test_trainer_and_planner_count_the_flops_written_by_hand():
    """SmolLM-135M (134.5 M parameters, 28.3 M of them the tied embedding whose matmul the lm_head
    does): the trainer's count (step_flops) and the planner's, each against the formula by hand."""
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    matmul, causal, full = _hand_flops(16 * 2048, 30, 576, 1536, 49152, 9, 3, 64, 2048)
    step = step_flops(cfg, 16, 2048)
    assert (step.matmul, step.causal, step.full) == (matmul, causal, full)
    shape = ModelShape.from_dict(vars(cfg))
    planned = plan_model.flops(shape, Layout(dp_shard=4), Batch(16, 4, 2048), Options())
    assert (planned["model"], planned["model_full_attention"]) == (causal, full)


def test_flops_are_what_torch_counts_in_a_step():
    """torch's FlopCounterMode over the decoder's forward and backward (attention on the math
    backend, so its matmuls are counted: the whole s x s score matrix) counts step_flops' full
    FLOPs, the matmuls alone its matmul FLOPs: a weight left out of the count, or one counted
    twice, would differ."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from models.llama import LlamaForCausalLM
    for tie in (False, True):
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
        model = LlamaForCausalLM(cfg, seed=0)
        ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(ids[:, :-1].contiguous(), labels=ids[:, 1:].contiguous()).backward()
        counts = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
        step = step_flops(cfg, 2, 32)
        assert counts["mm"] == step.matmul and counter.get_total_flops() == step.full, (counts, step)
        assert step.full == _hand_flops(64, 2, 64, 96, 256, 4, 2, 16, 32)[2]


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
def test_reporting_keys_are_checked_before_any_collective(tmp_path, argv, message, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)      # as if not installed (find_spec: None)
    with pytest.raises(ValueError, match=message):
        setup_run(TINY + argv + ["--output_dir", str(tmp_path)])
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def _has(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def _wandb_offline_records(run_dir):
    """wandb's protobuf Records of an offline run, read from its run-*.wandb file: a header of 7
    bytes (":W&B", a magic number, a version), then LevelDB's log format: 32 KiB blocks of chunks,
    each crc32 (4 bytes), length (2), type (1 whole, 2 first, 3 middle, 4 last), the data."""
    import struct

    from wandb.proto import wandb_internal_pb2
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:              # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending, pos = pending + data[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


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
    trainer, lines = Trainer(run), []
    trainer.loop.log = lines.append
    trainer.train()
    return lines, planner_prediction(run.cfg, run.pgm.config)(0.05)


def test_metrics_tensorboard_and_wandb_offline(tmp_path):
    """One process, 3 steps: metrics.jsonl carries tflops_per_s and both MFUs, and the TensorBoard
    events and the wandb rows (offline) hold the same numbers under HF's tags. wandb itself where
    it is installed (`make` installs it, the test extra of setup.cfg, so CI runs this with the real
    package and reads back the rows of its offline run); a stand-in with its calls elsewhere."""
    out = tmp_path / "run"
    extra = ["--output_dir", str(out), "--peak_tflops", "0.05", "--use_tensorboard", "true",
             "--wandb_project", "minipar-test", "--wandb_mode", "offline"]
    fake = None
    if not _has("wandb"):
        assert not os.environ.get("CI"), "CI installs wandb (setup.cfg's test extra): it runs the real one"
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
    if fake:
        logged = json.load(open(out / "fake_wandb.json"))
        assert logged["init"]["mode"] == "offline" and logged["init"]["project"] == "minipar-test"
        logged = logged["rows"]
    else:                                    # wandb itself: its offline run, for `wandb sync`
        records = list(_wandb_offline_records(out))
        assert [r.run.project for r in records if r.WhichOneof("record_type") == "run"] == ["minipar-test"]
        logged = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                  for r in records if r.WhichOneof("record_type") == "history"]
    assert [x["_step"] for x in logged] == [r["step"] for r in rows] == [1, 2, 3]
    for x, r in zip(logged, rows):
        assert x["train/loss"] == pytest.approx(r["loss"], rel=1e-6)
        assert x["train/grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-6)
        assert x["train/mfu"] == pytest.approx(r["mfu"], rel=1e-6)
    assert logged[-1]["eval/loss"] == pytest.approx(rows[-1]["val_loss"])
    assert "eval/loss" not in logged[0]


SPAN = re.compile(r"^(all_reduce|all_gather|reduce_scatter|all_to_all|send_recv|send|broadcast):(\w+)$")


def _traced_and_ledgered(argv):
    trainer = Trainer(setup_run(argv))
    per_step, step_fn = {}, trainer.train_step

    def train_step(step):                         # the ledger of exactly what the trace's span covers
        with comm_ledger.ledger() as led:
            out = step_fn(step)
        per_step[step + 1] = {f"{op}:{g}": cb for (op, g), cb in led.summary().items()}
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


def _theory(argv):
    """{"op:group": calls} and {"op:group": bytes} of one step on every rank of this single-stage
    layout, from the planner's count (minipar/plan/collective_counts.py: each technique's docstring
    made arithmetic), not from a run: a collective the code forgot is still in it."""
    model, sizes, batch, opts = from_train_config(load_config(argv[0], argv[1:]))
    layout = Layout(sizes["dp_replicate"], sizes["dp_shard"], sizes["cp"], sizes["tp"],
                    sizes["sequence_parallel"], sizes["cp_impl"], sizes["cp_ulysses_size"])
    planned = collectives(model, layout, batch, opts)
    return ({f"{op}:{g}": c for (op, g), (c, _) in planned.items()},
            {f"{op}:{g}": b for (op, g), (_, b) in planned.items()})


def test_trace_collectives_per_step_are_the_theory(tmp_path):
    """dp_shard 2 x tp 2 + SP (ZeRO-3 with prefetch, TP's collectives): the spans of steps 2 and 3
    in each rank's trace are the planner's count of a step, op by op and group by group, and the
    ledger's bytes of those steps are the planner's bytes."""
    argv = TINY + ["--dp_shard_size", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true",
                   "--profile_steps", "[2, 3]", "--output_dir", str(tmp_path / "t"), "--peak_tflops", "1"]
    calls, nbytes = _theory(argv)
    assert {"all_gather:dp_shard_cp", "reduce_scatter:dp_shard_cp", "all_gather:tp", "reduce_scatter:tp",
            "all_reduce:tp", "all_reduce:dp_cp", "all_reduce:dp_shard_cp"} <= set(calls)
    for traced, ledgered, waits in run_world(_traced_and_ledgered, 4, argv, timeout=300):
        for step in (2, 3):
            assert traced[step] == calls, f"step {step}: traced {sorted(traced[step].items())}\n" \
                                          f"theory {sorted(calls.items())}"
            assert ledgered[step] == {k: (calls[k], nbytes[k]) for k in calls}, f"step {step}"
        assert waits > 0                          # the prefetched gathers are waited on, visibly
