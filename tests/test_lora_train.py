"""LoRA runs (adapter: lora) on sharded layouts equal one process: per-step loss within 1e-4, the
frozen base bit-identical after training, and, in fp64, the adapter gradients of ZeRO-3 + DDP."""
import math
import os

import pytest
import torch
from harness import run_world

import minipar
from minipar import ParallelismConfig, comm_ledger
from minipar import tensor_parallel as tpl
from minipar.data_parallel import replicate
from minipar.lora import add_lora, lora_parameters
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from minipar.zero3 import fully_shard
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "32",
        "--global_batch_size", "8", "--warmup_steps", "2", "--eval_steps", "0", "--logging_steps", "100",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--progress_bar", "false", "--save_steps", "0", "--save_final_checkpoint", "false",
        "--export_hf", "false", "--learning_rate", "1e-2", "--weight_decay", "0.0"]
LORA = ["--adapter", "lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_linear", "true"]


def _argv(out, steps, *extra):
    return [os.path.join(ROOT, "configs", "ddp.yaml"), *TINY, *LORA, "--max_steps", str(steps),
            "--output_dir", str(out), "--dataset", os.path.join(ROOT, "data", "shakespeare.txt"),
            "--dp_replicate_size", "1", *extra]


def _frozen(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def _train(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    before = _frozen(trainer.model)
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    optimized = sum(len(g["params"]) for g in trainer.optimizer.param_groups)
    history = trainer.train()
    after = _frozen(trainer.model)
    same = all(torch.equal(before[n], after[n]) for n in before) and before.keys() == after.keys()
    return dict(curve=[(r["step"], r["loss"], r["grad_norm"]) for r in history], base_unchanged=same,
                trained=trained, optimized=optimized, frozen=len(before))


def _same_curve(ref, got, steps, rel=1e-4):
    assert len(got) == len(ref) == steps
    for (s, a, ga), (_, b, gb) in zip(ref, got):
        assert abs(a - b) <= rel * abs(a), f"step {s}: loss {b} vs single-process {a}"
        assert abs(ga - gb) <= rel * abs(ga) + 1e-7, f"step {s}: grad_norm {gb} vs {ga}"


_REF = {}


def _single(tmp_path, steps, layers=2):
    if (steps, layers) not in _REF:
        _REF[steps, layers] = run_world(_train, 1, _argv(tmp_path / f"single{layers}", steps,
                                                         "--model.num_hidden_layers", str(layers)),
                                        timeout=300)[0]
    return _REF[steps, layers]


# dp_shard 2 alone: slow, HSDP 2 x 2 below (ZeRO-3's frozen shards, the adapters all-reduced) is its fast twin
FAST = [(2, ["--dp_shard_size", "1", "--tensor_parallel_size", "2", "--sequence_parallel", "true"])]
SLOW = [(2, ["--dp_shard_size", "2"]),
        (4, ["--dp_shard_size", "4"]),
        (4, ["--dp_shard_size", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true"]),
        (8, ["--dp_shard_size", "2", "--context_parallel_size", "2", "--tensor_parallel_size", "2",
             "--sequence_parallel", "true"]),
        (4, ["--dp_shard_size", "2", "--pipeline_parallel_size", "2", "--model.num_hidden_layers", "4",
             "--micro_batch_size", "2"]),
        (4, ["--dp_replicate_size", "2", "--dp_shard_size", "2", "--gradient_checkpointing", "true",
             "--micro_batch_size", "1"])]


def _check_layout(tmp_path, world, extra, steps):
    key = "--model.num_hidden_layers"
    layers = int(extra[extra.index(key) + 1]) if key in extra else 2
    ref = _single(tmp_path, steps, layers)
    assert ref["base_unchanged"] and ref["frozen"] > 0
    assert ref["trained"] and all(".lora.lora_" in n for n in ref["trained"])
    assert ref["optimized"] == len(ref["trained"])          # AdamW holds the adapters only
    for got in run_world(_train, world, _argv(tmp_path / "par", steps, *extra), timeout=300):
        _same_curve(ref["curve"], got["curve"], steps)
        assert got["base_unchanged"] and got["frozen"] > 0
        assert got["optimized"] == len(got["trained"])


@pytest.mark.parametrize("world,extra", FAST, ids=["tp2-sp"])
def test_lora_layouts_match_single_process(tmp_path, world, extra):
    _check_layout(tmp_path, world, extra, 4)


# the fast twins of the slow pp, cp and HSDP layouts: 3 steps on 4 ranks. pp 2 x cp 2 under ZB-H1 (the
# split backward with a frozen base: nothing deferred, the adapters' gradients in B, and the step's
# last B, not its empty last W, reducing them over cp), and HSDP 2 x 2 with checkpointing and
# accumulation (the adapters all-reduced over dp_cp, outside ZeRO-3's units)
TWINS = [(4, ["--pipeline_parallel_size", "2", "--context_parallel_size", "2", "--pipeline_schedule", "zb_h1",
              "--micro_batch_size", "2"]),
         (4, ["--dp_replicate_size", "2", "--dp_shard_size", "2", "--gradient_checkpointing", "true",
              "--micro_batch_size", "1"])]


@pytest.mark.parametrize("world,extra", TWINS, ids=["pp2-cp2-zb_h1", "hsdp2x2-checkpointing-accumulation"])
def test_lora_pp_cp_and_hsdp_match_single_process(tmp_path, world, extra):
    _check_layout(tmp_path, world, extra, 3)


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", SLOW, ids=["dp_shard2", "dp_shard4", "dp_shard2-tp2-sp",
                                                   "dp2-cp2-tp2-sp", "pp2-dp_shard2",
                                                   "hsdp2x2-checkpointing-accumulation"])
def test_lora_layouts_match_single_process_20_steps(tmp_path, world, extra):
    _check_layout(tmp_path, world, extra, 20)


CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2)


def _grads(dp_shard, tp):
    """One fp64 backward of the global batch (8, 8) split over the dp ranks: adapter gradients, full."""
    world = dp_shard * tp
    pgm = minipar.init(ParallelismConfig(dp_shard_size=dp_shard, tp_size=tp)) if world > 1 else None
    model = LlamaForCausalLM(LlamaConfig(**CFG), pgm, seed=1).double()
    add_lora(model, list(model.lora_target_modules), r=4, alpha=8, seed=0)
    with torch.no_grad():                        # B != 0, so A's gradient is not zero too
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                full = torch.randn(p.tp_full_shape, generator=torch.Generator().manual_seed(len(n)))
                p.copy_(tpl.shard_tensor(full.double(), p.tp_split_dim, model.pgm.tp))
    model.double()
    pgm = model.pgm
    if pgm.dp_shard_cp.size > 1:
        fully_shard(model, pgm, ignored_params=lora_parameters(model))
        replicate(model, pgm.dp_cp)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 64, (8, 8), generator=g), torch.randint(0, 64, (8, 8), generator=g)
    per = 8 // pgm.dp.size
    rows = slice(pgm.dp.rank * per, (pgm.dp.rank + 1) * per)
    model(ids[rows], labels=labels[rows], num_items_in_batch=labels.numel()).backward()
    frozen = [s for s in model.parameters() if not s.requires_grad]
    return dict(grads={n: tpl.gather_tensor(p.grad, p.tp_split_dim, pgm.tp)
                       for n, p in model.named_parameters() if p.requires_grad},
                frozen_without_grad=all(p.grad is None for p in frozen),
                gathered_after=model.zero3.gathered_bytes() if hasattr(model, "zero3") else 0,
                # a frozen unit is freed after its backward too (its inputs' gradients say when):
                # never more than the root and 1 + prefetch layers at a time
                peak_ok=not hasattr(model, "zero3") or model.zero3.peak_gathered_bytes <= sum(
                    u.buffer.element_size() * u.layout.padded_numel for u in model.zero3.units[:1] +
                    model.zero3.units[2:4]))


def test_zero3_frozen_base_adapter_gradients_equal_one_process_in_fp64():
    ref = _grads(1, 1)
    assert len(ref["grads"]) == 56
    for got in run_world(_grads, 4, 2, 2, timeout=120):
        assert got["frozen_without_grad"] and got["gathered_after"] == 0 and got["peak_ok"]
        for n, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][n], g, atol=1e-12, rtol=1e-10, msg=n)


def test_lora_checkpoint_holds_adapters_and_resumes_on_another_layout(tmp_path):
    import json
    ref = _single(tmp_path, 4)
    out = tmp_path / "run"
    run_world(_train, 2, _argv(out, 4, "--dp_shard_size", "2", "--save_steps", "2"), timeout=200)
    manifest = json.load(open(out / "step-2" / "manifest.json"))
    assert len(manifest["params"]) == 28 and all(".lora.lora_" in n for n in manifest["params"])
    # adapters and their two AdamW states, written once (dp_shard_cp rank 0): about 3 x 4 bytes each
    files = [out / "step-2" / f for f in manifest["files"] if f.startswith("shards/")]
    adapters = sum(math.prod(shape) for shape in manifest["params"].values())
    assert len(files) == 1 and os.path.getsize(files[0]) < 3 * 4 * adapters + 200_000
    got = run_world(_train, 2, _argv(out, 4, "--dp_shard_size", "1", "--tensor_parallel_size", "2",
                                     "--resume_from_checkpoint", str(out / "step-2")), timeout=200)
    for g in got:                               # (the history also holds steps 1-2, from metrics.jsonl)
        after = [r for r in g["curve"] if r[0] > 2]
        assert [s for s, _, _ in after] == [3, 4]
        _same_curve(ref["curve"][2:], after, 2)


def _state(argv):
    """A LoRA run's persistent bytes per rank at the end of its first step (params, grads, AdamW
    states), its collectives by the comm ledger, and the config the planner reads."""
    torch.set_num_threads(1)
    tr = Trainer(setup_run(argv))
    state, zero_grad = {}, tr.optimizer.zero_grad
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if t is not None)   # noqa: E731

    def measure_then_zero(set_to_none=True):    # the state as it stands at the end of the step
        params = list(tr.model.parameters())
        opt = [v for st in tr.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        state.update(params=nbytes(params), grads=nbytes(p.grad for p in params), optimizer=nbytes(opt))
        zero_grad(set_to_none=set_to_none)

    tr.optimizer.zero_grad = measure_then_zero
    with comm_ledger.ledger() as led:
        tr.train_step(0)
    return dict(state, gathered=getattr(getattr(tr.model, "zero3", None), "peak_gathered_bytes", 0),
                ledger={k: list(v) for k, v in led.summary().items()}, cfg=tr.cfg, layout=tr.pgm.config)


PLANNED = [(["--lora_target_modules", "[q_proj, o_proj, up_proj, down_proj]"], ("q_proj", "o_proj", "up_proj",
                                                                               "down_proj")),
           (["--lora_target_modules", "[up_proj, down_proj]", "--sequence_parallel", "true", "--dtype",
             "bfloat16"], ("up_proj", "down_proj"))]


@pytest.mark.parametrize("extra,targets", PLANNED, ids=["attention-and-mlp", "mlp-only-sp-bf16"])
def test_planner_counts_lora_memory_and_collectives_exactly(tmp_path, extra, targets):
    """python -m minipar.plan's counts for a LoRA run (minipar/plan/model.py, collective_counts.py)
    against the run itself on dp_shard 2 x tp 2: the frozen shards, the adapters' gradients and
    AdamW states, the gathered units, and every collective of the step (no reduce-scatter; the
    adapters' all-reduces over tp and dp_cp; layer 0's backward f/g that do not run)."""
    from minipar.plan import Layout, collectives, memory
    from minipar.trainer.prediction import from_train_config
    argv = _argv(tmp_path, 1, "--dp_shard_size", "2", "--tensor_parallel_size", "2",
                 "--lora_target_linear", "false", *extra)
    for got in run_world(_state, 4, argv, timeout=200):
        model, _, batch, opts = from_train_config(got["cfg"])
        assert opts.lora_r == 4 and opts.lora_targets == targets
        lc = got["layout"]
        layout = Layout(1, lc.dp_shard_size, 1, lc.tp_size, lc.sequence_parallel)
        mem = memory(model, layout, opts)
        want = (mem["params"], mem["grads"], mem["optimizer"], mem["gathered"])
        assert (got["params"], got["grads"], got["optimizer"], got["gathered"]) == want
        assert mem["grads"] < mem["params"] / 5 and mem["accumulated_grads"] == 0
        assert got["ledger"] == {k: [c, b] for k, (c, b) in collectives(model, layout, batch, opts).items()}
