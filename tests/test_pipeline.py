"""Pipeline parallelism: the split rule, the schedules, and training runs equal to one process.

In the default suite, each schedule on pp 2 against one process: afab and interleaved_1f1b for 3
steps (`test_each_schedule_on_pp2_matches_single_process`), 1F1B for 3 steps, saved sharded, resumed
on one process and exported (`test_checkpoint_saved_on_pp2_resumes_on_one_process_and_exports`),
zbv for 2 steps on pp 2 x dp_shard 2 with activation checkpointing, one reduce-scatter per unit per
step after the last W (`test_pp2_zero3_zbv_checkpointing_reduces_after_the_last_w`), and zb_h1 for
2 steps on pp 2 x tp 2 with sp and the async linears
(`test_pp_layouts_match_single_process_fast[pp2-tp2-sp-async-zb_h1]`).
Also fast: the split and schedule checks (pure, p up to 4); interleaved_1f1b on pp 2 x dp_shard 2
with activation checkpointing and clipping (ZeRO-3 reduces once per step, its FULL_STATE_DICT
checkpoint resumes on one process); bad settings refused on every rank; 2 steps of 1F1B on pp 4 and
on pp 2 x tp 2 with sp. Zero bubble in float64: the gradients after one step equal 1F1B's bit for
bit with the ledger's bytes (zbv: twice) on pp 2 and pp 3 (pp 4: slow), and on pp 2 on a model with
biases on every projection (W's db) and with LoRA (a frozen base: nothing deferred).
Slow (make test-slow): 20 steps of every schedule on pp 2 and pp 4 (the zero-bubble ones with m = p
and m = 2p; on a model with biases too), and pp 2 composed with tp (with and without sp), cp,
dp_shard, DDP, and all of them on 16 ranks (configs/5d.yaml; and under zbv).
"""
import json
import os

import pytest
import torch
from harness import run_world

import minipar
from minipar import comm_ledger
from minipar.config import ParallelismConfig
from minipar.pipeline_parallel import (
    SCHEDULES,
    build_stage,
    check_schedule,
    run_schedule,
    schedule_order,
    simulate,
    split_layers,
    stage_chunks,
    theory_bubble,
)
from minipar.pipeline_parallel.simulate import back_to_back, peak_in_flight, steady_state
from minipar.pipeline_parallel.stage import gather_over_stages
from minipar.trainer.config.check import check_pipeline
from minipar.trainer.config.train_config import load_config
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data", "shakespeare.txt")


def _tiny(layers=4, steps=3):
    # warmup 25 > steps: the learning rate of a step does not depend on max_steps, so a 3-step
    # run and the first 3 steps of a 5-step run are the same run. global batch 8 in
    # micro-batches of 2: m = 4 per step at dp 1, 2 at dp 2. Clipping at 1.0 (the default) is
    # active: the gradient norms of these steps are 2-5.
    return ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_hidden_layers",
            str(layers), "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2",
            "--sequence_len", "32", "--global_batch_size", "8", "--micro_batch_size", "2",
            "--max_steps", str(steps), "--warmup_steps", "25", "--eval_steps", str(steps),
            "--eval_batches", "1",
            "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
            "--logging_steps", "100", "--progress_bar", "false", "--save_steps", "0",
            "--save_final_checkpoint", "false", "--export_hf", "false", "--dataset", DATA]


def _argv(out, *extra, config="ddp.yaml", layers=4, steps=3):
    return [os.path.join(ROOT, "configs", config), *_tiny(layers, steps), "--dp_replicate_size", "1",
            "--output_dir", str(out), *extra]


def _curve(history):
    return [(r["step"], r["loss"], r.get("val_loss"), r["grad_norm"]) for r in history]


def _train(argv):
    torch.set_num_threads(1)
    return _curve(Trainer(setup_run(argv)).train())


def _train_counting(argv):
    """The curve, and what the ledger saw: reduce-scatters, sends, bytes sent."""
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    with comm_ledger.ledger() as led:
        history = trainer.train()
    zero3 = getattr(trainer.model, "zero3", None)
    return _curve(history), dict(reduce_scatters=led.count("reduce_scatter"), sends=led.count("send"),
                                 units=len(zero3.shards) if zero3 else 0, pp_rank=trainer.pgm.pp.rank)


def _same(ref, got, rel=1e-4):
    """Every step of ref, no more and no fewer (slice a longer reference: ref[:3]), at rel: loss,
    grad_norm, and val_loss wherever the reference evaluated."""
    assert len(got) == len(ref) and got, (len(got), len(ref))
    for (s, a, va, ga), (s2, b, vb, gb) in zip(ref, got):
        assert s == s2
        assert abs(a - b) <= rel * abs(a), f"step {s}: loss {b} vs single-process {a}"
        assert abs(ga - gb) <= rel * abs(ga), f"step {s}: grad_norm {gb} vs {ga}"
        if va is not None:
            assert vb is not None, f"step {s}: no val_loss, the single process has {va}"
            assert abs(va - vb) <= rel * abs(va), f"step {s}: val_loss {vb} vs {va}"


_REFS = {}


def _reference(tmp_path_factory, layers=4, steps=5, *extra):
    key = (layers, steps, extra)
    if key not in _REFS:
        out = tmp_path_factory.mktemp("single")
        # 5 steps: evaluated at step 3 too, where the 3-step runs evaluate (at the end)
        at3 = ["--eval_steps", "3"] if steps == 5 else []
        _REFS[key] = run_world(_train, 1, _argv(out, *extra, *at3, layers=layers, steps=steps),
                               timeout=600)[0]
        assert all(g > 1.0 for *_, g in _REFS[key])        # clipping at 1.0 really engages
    return _REFS[key]


# ------------------------------------------------------------------------------ pure checks
def test_split_rule_and_uneven_split():
    assert split_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_layers(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]          # the earliest stages take the extra
    assert split_layers(6, 2, [1, 5]) == [[0], [1, 2, 3, 4, 5]]
    # interleaved: chunk j of rank r is virtual stage j * pp + r
    assert stage_chunks(8, 2, 0, 2) == [[0, 1], [4, 5]] and stage_chunks(8, 2, 1, 2) == [[2, 3], [6, 7]]
    with pytest.raises(ValueError, match="num_hidden_layers=2 cannot be split over 4"):
        split_layers(2, 4)
    with pytest.raises(ValueError, match="sums to 5, but the model has num_hidden_layers=6"):
        split_layers(6, 2, [2, 3])
    with pytest.raises(ValueError, match="must list 2 positive"):
        split_layers(6, 2, [6])


def _chunks(name, v):
    return 2 if name == "zbv" else v


@pytest.mark.parametrize("name", SCHEDULES)
def test_schedules_complete_with_the_bubble_and_memory_of_theory(name):
    kinds = "FBW" if name in ("zb_h1", "zbv") else "FB"
    for p in (2, 3, 4):
        for m in (p, p + 1, 2 * p, 3 * p):
            if name == "interleaved_1f1b" and m % p:
                continue
            for v in ((2, 3) if name == "interleaved_1f1b" else (_chunks(name, 1),)):
                orders = [schedule_order(name, p, m, r, v) for r in range(p)]
                for order in orders:              # every chunk of every micro-batch: F, then B (then W)
                    assert sorted(order) == sorted({(k, c, i) for k in kinds for c in range(v)
                                                    for i in range(m)})
                    for c in range(v):
                        for i in range(m):
                            at = [order.index((k, c, i)) for k in kinds]
                            assert at == sorted(at)
                # t_F = t_B (= t_W): raises on a deadlock
                events, total = simulate(orders, v, t_f=1.0, t_b=1.0, t_w=1.0, name=name)
                for r in range(p):
                    busy = sum(e - s for _, s, e in events[r])
                    assert abs((1 - busy / total) - theory_bubble(name, p, m, v)) < 1e-9
                peaks = [peak_in_flight(o) for o in orders]
                if name == "afab":
                    assert peaks == [m] * p
                elif name == "1f1b":
                    assert peaks == [p - r for r in range(p)]       # independent of m
                elif name == "zb_h1":
                    assert peaks == [p] * p                        # 1F1B's first stage, everywhere
                elif name == "zbv":
                    assert peaks == [min(2 * p, m + r + 1) for r in range(p)]
                else:
                    assert peaks == [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]


def test_zero_bubble_bubbles_against_1f1b():
    # the paper's claims at t_F = t_B = t_W, in idle time per step: ZB-H1 a third of 1F1B's (whose
    # backward is B + W), ZB-V (m >= 2p - 1) a sixth; and ZB-V at least as good as ZB-H1 always
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p):
            def idle(name, v=1):
                orders = [schedule_order(name, p, m, r, v) for r in range(p)]
                t_b = 2.0 if name == "1f1b" else 1.0
                events, total = simulate(orders, v, t_f=1.0, t_b=t_b, t_w=1.0, name=name)
                return total - 3 * m
            assert idle("zb_h1") == pytest.approx(idle("1f1b") / 3)
            assert idle("zbv", 2) == pytest.approx(idle("1f1b") / 6)


def test_steps_back_to_back_hide_only_zbvs_fill():
    # with no collective between steps the next step's fill overlaps this one's drain: the V of
    # zbv then idles max(0, 4p - 2 - 2m) half-slots a step (none once the V is full, m >= 2p - 1),
    # while every other schedule keeps its one-step bubble exactly
    for p in (2, 3, 4, 5):
        for m in range(p, 3 * p + 1):
            for name in SCHEDULES:
                if name == "interleaved_1f1b" and m % p:
                    continue
                v = 2 if name in ("interleaved_1f1b", "zbv") else 1
                split = name in ("zb_h1", "zbv")
                times = dict(t_f=1.0, t_b=1.0, t_w=1.0) if split else dict(t_f=1.0, t_b=2.0)
                orders = [schedule_order(name, p, m, r, v) for r in range(p)]
                one = simulate(orders, v, name=name, **times)[1] - 3 * m
                period, idle = steady_state(simulate(back_to_back(orders, m, 3), v, name=name, **times)[0], m)
                assert period == pytest.approx(3 * m + max(idle)) and min(idle) == pytest.approx(max(idle))
                if name == "zbv":
                    assert 2 * idle[0] == pytest.approx(max(0, 4 * p - 2 - 2 * m))
                    assert idle[0] < one - 0.25 if m >= 2 * p - 1 else idle[0] <= one
                else:
                    assert idle[0] == pytest.approx(one)
                assert idle[0] / period == pytest.approx(theory_bubble(name, p, m, v, steady=True))
    with pytest.raises(ValueError, match="at least 3 steps"):
        orders = back_to_back([schedule_order("1f1b", 2, 2, r) for r in range(2)], 2, 2)
        steady_state(simulate(orders, 1)[0], 2)


def _back_to_back_grads(schedule, p, m):
    """Losses and gradients of a step on batches a, one on batches b, then of a and b run back to
    back with nothing between them (b's sends reach a rank still in a's W's), in float64."""
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    pgm = minipar.init(ParallelismConfig(pp_size=p, dp_shard_size=1))
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2 * p,
                      num_attention_heads=4, num_key_value_heads=2)
    gen = torch.Generator().manual_seed(0)
    data = [[dict(input_ids=torch.randint(0, 64, (2, 8), generator=gen),
                  labels=torch.randint(0, 64, (2, 8), generator=gen),
                  position_ids=torch.arange(8).expand(2, -1)) for _ in range(m)] for _ in "ab"]
    v = _chunks(schedule, 1)
    stage = build_stage(LlamaForCausalLM(cfg, pgm, seed=0), pgm, v, None, schedule)
    order = schedule_order(schedule, p, m, pgm.pp.rank, v)
    out = []
    for steps in ([0], [1], [0, 1]):
        stage.zero_grad(set_to_none=True)
        losses = [float(run_schedule(stage, order, pgm, data[k], m * 16, act_dtype=torch.float64))
                  for k in steps]
        out.append((losses, {n: q.grad.clone() for n, q in stage.named_parameters()}))
    return out


@pytest.mark.parametrize("schedule", ["zbv", "1f1b"])
def test_steps_run_back_to_back_pair_their_messages(schedule):
    # the tags repeat every step; a message of step b taken for one of step a would mix the two
    got = run_world(_back_to_back_grads, 2, schedule, 2, 4, timeout=300)
    assert sum(r[0][0][0] for r in got) != sum(r[1][0][0] for r in got)      # a and b differ
    for (a, ga), (b, gb), (both, gboth) in got:
        assert both == a + b
        for name in ga:
            torch.testing.assert_close(gboth[name], ga[name] + gb[name], rtol=1e-10, atol=1e-15)  # fp64 order


def test_simulate_with_each_stage_its_own_times():
    # 1F1B, p 2, m 2, stage 1 twice as slow (F 2, B 4) as stage 0 (F 1, B 2), by hand:
    #   stage 0  F0 0-1  F1 1-2                 B0 7-9             B1 13-15
    #   stage 1         F0 1-3  B0 3-7  F1 7-9  B1 9-13
    orders = [schedule_order("1f1b", 2, 2, r) for r in range(2)]
    slow = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 2.0, "B": 4.0}}
    events, total = simulate(orders, 1, name="1f1b", duration=lambda rank, a: slow[rank][a.kind])
    assert total == 15.0
    assert [(a.kind, a.micro, s, e) for a, s, e in events[0]] == [
        ("F", 0, 0.0, 1.0), ("F", 1, 1.0, 2.0), ("B", 0, 7.0, 9.0), ("B", 1, 13.0, 15.0)]
    # the same stages evenly timed (the mean) would hide stage 0's waiting on its slow neighbour
    assert simulate(orders, 1, t_f=1.5, t_b=3.0, name="1f1b")[1] < total


def _fp64_model(pgm, layers, variant=None):
    """A float64 LlamaForCausalLM of `layers` layers, seed 0, the same on every rank. variant "bias":
    biases on every projection (attention_bias, mlp_bias: q/k/v as Qwen2's, o, gate/up/down), drawn
    nonzero; "lora": adapters on every projection, the base frozen, lora_B drawn nonzero (so that
    lora_A's gradient is not zero either)."""
    from minipar.lora import add_lora
    bias = variant == "bias"
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=bias, mlp_bias=bias)
    model = LlamaForCausalLM(cfg, pgm, seed=0)
    if variant == "lora":
        add_lora(model, list(model.lora_target_modules), r=4, alpha=8, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, q in model.named_parameters():
            if n.endswith(".bias") or n.endswith("lora_B"):
                q.copy_(0.1 * torch.randn(q.shape, generator=gen))
    return model


def _fp64_grads(schedule, p, m, layers, variant=None, schedules=("1f1b",)):
    """Gradients (over the whole model, by name), bytes sent and loss after one step of each of
    `schedules` and of `schedule` from the same weights, in float64; also whether every frozen
    weight (LoRA's base) was left without a gradient."""
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    pgm = minipar.init(ParallelismConfig(pp_size=p, dp_shard_size=1))
    gen = torch.Generator().manual_seed(0)
    batches = [dict(input_ids=torch.randint(0, 64, (2, 8), generator=gen),
                    labels=torch.randint(0, 64, (2, 8), generator=gen),
                    position_ids=torch.arange(8).expand(2, -1)) for _ in range(m)]
    out = {}
    for name in (*schedules, schedule):
        v = _chunks(name, 1)
        stage = build_stage(_fp64_model(pgm, layers, variant), pgm, v, None, name)
        with comm_ledger.ledger() as led:
            loss = run_schedule(stage, schedule_order(name, p, m, pgm.pp.rank, v), pgm, batches, m * 16,
                                act_dtype=torch.float64)
        assert stage.weight_grads is None or not stage.weight_grads.pending()
        trained = {n: q.grad.clone() for n, q in stage.named_parameters() if q.requires_grad}
        frozen_clean = all(q.grad is None for q in stage.parameters() if not q.requires_grad)
        out[name] = (gather_over_stages(trained, pgm), led.total_bytes("send"), float(loss), frozen_clean)
    return out


@pytest.mark.parametrize("schedule,p,m", [
    ("zb_h1", 2, 2), ("zbv", 2, 4), ("zb_h1", 3, 3), ("zbv", 3, 3),     # p 3: a middle stage too
    pytest.param("zb_h1", 4, 8, marks=pytest.mark.slow), pytest.param("zbv", 4, 4, marks=pytest.mark.slow)])
def test_zero_bubble_gradients_equal_1f1b_exactly_and_send_its_bytes(schedule, p, m):
    got = run_world(_fp64_grads, p, schedule, p, m, 2 * p, timeout=300)
    ref, mine = got[0]["1f1b"][0], got[0][schedule][0]
    assert sorted(ref) == sorted(mine) and len(ref) == 3 + 9 * 2 * p
    for name in ref:                             # bit for bit: W adds the same products in the same order
        assert torch.equal(ref[name], mine[name]), name
    assert sum(r[schedule][2] for r in got) == sum(r["1f1b"][2] for r in got)
    for r in got:                                # ZB-H1: 1F1B's sends; ZB-V: twice (2 (p - 1) boundaries)
        assert r[schedule][1] == (1 if schedule == "zb_h1" else 2) * r["1f1b"][1] > 0


@pytest.mark.parametrize("variant", ["bias", "lora"])
def test_zero_bubble_biases_and_lora_equal_1f1b_in_fp64(variant):
    # the split backward's other branches: W's db (a biased model: q/k/v/gate/up biases go through
    # SplitLinear; o/down's are added after the tp reduction, autograd's), and LoRA's frozen base
    # (nothing deferred, no gradient; the adapters' gradients come in B). zbv and zb_h1 against 1F1B
    # after one step, pp 2, m 4, every trained parameter; zb_h1 in the same world
    got = run_world(_fp64_grads, 2, "zbv", 2, 4, 4, variant, ("1f1b", "zb_h1"), timeout=300)
    ref = got[0]["1f1b"][0]
    biases = [n for n in ref if n.endswith(".bias")]
    adapters = [n for n in ref if ".lora.lora_" in n]
    if variant == "bias":                        # 4 layers x (q, k, v, o, gate, up, down)
        assert len(biases) == 28 and len(ref) == 3 + 16 * 4
    else:                                        # the adapters only: the base is frozen
        assert len(adapters) == len(ref) == 2 * 7 * 4
    assert all(ref[n].abs().sum() > 0 for n in biases + adapters)
    for schedule in ("zb_h1", "zbv"):
        mine = got[0][schedule][0]
        assert sorted(mine) == sorted(ref), schedule
        for name in ref:
            assert torch.equal(mine[name], ref[name]), f"{schedule}: {name}"     # bit for bit, as above
        assert sum(r[schedule][2] for r in got) == sum(r["1f1b"][2] for r in got)
        assert all(r[schedule][3] for r in got), f"{schedule}: a frozen weight got a gradient"


def test_too_few_micro_batches_and_bad_settings_are_refused():
    check_schedule("afab", 4, 1, 1)
    with pytest.raises(ValueError, match="needs at least 4 micro-batches per step.*has 3"):
        check_schedule("1f1b", 4, 3, 1)
    with pytest.raises(ValueError, match="multiple of pipeline_parallel_size 4"):
        check_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="pipeline_virtual_stages=2 only applies"):
        check_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="use one of afab, 1f1b, interleaved_1f1b, zb_h1, zbv"):
        check_schedule("gpipe", 2, 4, 1)
    with pytest.raises(ValueError, match="zb_h1 on 4 stages needs at least 4 micro-batches.*has 2"):
        check_schedule("zb_h1", 4, 2, 1)
    with pytest.raises(ValueError, match="zbv on 2 stages needs at least 2 micro-batches.*has 1"):
        check_schedule("zbv", 2, 1, 2)
    with pytest.raises(ValueError, match="zbv needs pipeline_virtual_stages = 2"):
        check_schedule("zbv", 2, 4, 3)
    cfg = load_config(None, _tiny(2) + ["--pipeline_schedule", "zbv"])
    with pytest.raises(ValueError, match="num_hidden_layers=2 cannot be split over 4"):
        check_pipeline(cfg, 2, 4)                # the V: 2 chunks x 2 stages
    cfg = load_config(None, _tiny(4) + ["--pipeline_layers", "[1, 2]"])
    with pytest.raises(ValueError, match="sums to 3"):
        check_pipeline(cfg, 2, 4)
    cfg = load_config(None, _tiny(4) + ["--model.tie_word_embeddings", "true"])
    check_pipeline(cfg, 2, 4)                    # tied: a copy per end, summed (test_pipeline_tied.py)
    cfg = load_config(None, _tiny(4) + ["--pipeline_schedule", "interleaved_1f1b"])
    with pytest.raises(ValueError, match="num_hidden_layers=4 cannot be split over 8"):
        check_pipeline(cfg, 4, 4)                # 2 chunks x 4 stages = 8 virtual stages


def _bad_world(argv):
    try:
        setup_run(argv)
    except ValueError as err:
        return str(err)
    return "no error"


def test_bad_pipeline_refused_on_every_rank_before_any_collective(tmp_path):
    out = run_world(_bad_world, 2, _argv(tmp_path, "--pipeline_parallel_size", "2", layers=1), timeout=120)
    assert all("num_hidden_layers=1 cannot be split over 2" in o for o in out), out[0]
    out = run_world(_bad_world, 2,
                    _argv(tmp_path, "--pipeline_parallel_size", "2", "--micro_batch_size", "8"), timeout=120)
    assert all("needs at least 2 micro-batches" in o for o in out), out[0]


# ------------------------------------------------------------------- equal to one process (fast)
# 1f1b: the checkpoint test's run; zb_h1 and zbv: the composed fast runs below (zbv + ZeRO-3, zb_h1 + TP)
@pytest.mark.parametrize("schedule", ["afab", "interleaved_1f1b"])
def test_each_schedule_on_pp2_matches_single_process(tmp_path_factory, tmp_path, schedule):
    ref = _reference(tmp_path_factory)
    got = run_world(_train, 2,
                    _argv(tmp_path, "--pipeline_parallel_size", "2", "--pipeline_schedule", schedule),
                    timeout=300)
    for g in got:                              # every stage logs the same loss
        _same(ref[:3], g)


def test_pp2_zero3_checkpointing_reduce_scatters_once_per_step(tmp_path_factory, tmp_path):
    # interleaved: two chunks per rank, each unit reduce-scattered in its own chunk's last backward
    ref = _reference(tmp_path_factory)
    save = tmp_path / "pp2-shard2"
    got = run_world(_train_counting, 4, _argv(save, "--pipeline_parallel_size", "2", "--dp_shard_size", "2",
                                              "--pipeline_schedule", "interleaved_1f1b",
                                              "--gradient_checkpointing", "true",
                                              "--save_final_checkpoint", "true",
                                              "--fsdp.state_dict_type", "FULL_STATE_DICT"), timeout=300)
    steps, m = 3, 2                            # 8 samples / (micro_batch_size 2 x dp 2)
    for curve, led in got:
        _same(ref[:3], curve)
        assert led["units"] > 0 and led["reduce_scatters"] == steps * led["units"], led   # not x m
        # v p - 1 = 3 boundaries: rank 0 sends 2 activations and 1 gradient per micro-batch, rank 1 the
        # reverse; an evaluation sends one activation per boundary (rank 0: 2, rank 1: 1)
        assert led["sends"] == steps * m * 3 + (2 if led["pp_rank"] == 0 else 1), led
    # the full checkpoint (gathered over the shards and the stages) resumes on one process
    resumed = run_world(_train, 1, _argv(tmp_path / "one", "--resume_from_checkpoint", str(save / "step-3"),
                                         steps=5), timeout=300)[0]
    _same(ref[3:], resumed)


def test_pp2_zero3_zbv_checkpointing_reduces_after_the_last_w(tmp_path_factory, tmp_path):
    # the V puts the embedding and the loss on rank 0; every B and W but the last under no_sync:
    # one reduce-scatter per unit per step, after the step's last W
    ref = _reference(tmp_path_factory)
    argv = _argv(tmp_path, "--pipeline_parallel_size", "2", "--dp_shard_size", "2",
                 "--pipeline_schedule", "zbv", "--gradient_checkpointing", "true", steps=2)
    got = run_world(_train_counting, 4, argv, timeout=300)
    steps, m = 2, 2
    for curve, led in got:
        _same(ref[:2], curve)
        assert led["units"] > 0 and led["reduce_scatters"] == steps * led["units"], led
        # 2 (p - 1) = 2 boundaries cross ranks, each way: 2 sends per micro-batch on each rank; an
        # evaluation sends one activation from each rank (chunk 0 down, chunk 1 up)
        assert led["sends"] == steps * m * 2 + 1, led


def _save_on_pp2(tmp_path_factory, tmp_path):
    """3 steps of 1F1B on pp 2 (equal to one process), saved (sharded) and exported at the end."""
    ref = _reference(tmp_path_factory)           # 5 uninterrupted steps on one process
    save = tmp_path / "pp2"
    got = run_world(_train, 2, _argv(save, "--pipeline_parallel_size", "2", "--pipeline_schedule", "1f1b",
                                     "--save_final_checkpoint", "true", "--export_hf", "true"), timeout=300)
    for g in got:
        _same(ref[:3], g)
    return ref, save


def _resume(ref, step3, out, world, *extra):
    for got in run_world(_train, world, _argv(out, *extra, "--resume_from_checkpoint", step3, steps=5),
                         timeout=300):         # every stage
        assert [g[0] for g in got] == [4, 5]
        _same(ref[3:], got)


def test_checkpoint_saved_on_pp2_resumes_on_one_process_and_exports(tmp_path_factory, tmp_path):
    from safetensors.torch import load_file

    from minipar.trainer.checkpoint.export import export_checkpoint
    ref, save = _save_on_pp2(tmp_path_factory, tmp_path)
    _resume(ref, str(save / "step-3"), tmp_path / "resume1", 1)
    # the run's own export (gathered over the stages) is the whole model, as a 1-process export
    export_checkpoint(str(save / "step-3"), str(tmp_path / "hf1"))
    mine = load_file(str(save / "hf" / "model.safetensors"))
    one = load_file(str(tmp_path / "hf1" / "model.safetensors"))
    assert sorted(mine) == sorted(one) and "model.layers.3.mlp.up_proj.weight" in mine
    for name in one:
        torch.testing.assert_close(mine[name], one[name], rtol=0, atol=0)


# fast twins of the slow 20-step runs below, 2 steps on 4 ranks (~8 s each on 2 cores, most of it
# starting the ranks): pp 4, and pp 2 x tp 2 with sp. pp x cp and pp x DDP: slow only (see SLOW)
@pytest.mark.parametrize("world,extra", [
    (4, ["--pipeline_parallel_size", "4", "--pipeline_schedule", "1f1b"]),
    (4, ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true"]),
    (4, ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true",
         "--pipeline_schedule", "zb_h1", "--tp_async_overlap", "true"]),
    pytest.param(4, ["--pipeline_parallel_size", "2", "--context_parallel_size", "2"],
                 marks=pytest.mark.slow),
    pytest.param(4, ["--pipeline_parallel_size", "2", "--dp_replicate_size", "2", "--dp_shard_size", "1"],
                 marks=pytest.mark.slow),
], ids=["pp4-1f1b", "pp2-tp2-sp", "pp2-tp2-sp-async-zb_h1", "pp2-cp2", "pp2-ddp2"])
def test_pp_layouts_match_single_process_fast(tmp_path_factory, tmp_path, world, extra):
    ref = _reference(tmp_path_factory)
    for g in run_world(_train, world, _argv(tmp_path, *extra, steps=2), timeout=300):
        _same(ref[:2], g)


def test_stages_stepping_alone_train_as_the_synchronous_run(tmp_path):
    # pipeline_overlap_steps (no clipping): each stage updates at once and goes on; the loss and
    # grad norm of a step come a step late, the updates are the synchronous run's, so is the
    # curve (which the zbv runs above hold against one process), with a save at step 2 settled
    # before it is written
    argv = ["--max_grad_norm", "0", "--save_steps", "2"]
    pp = ["--pipeline_parallel_size", "2", "--pipeline_schedule", "zbv"]
    sync = run_world(_train, 2, _argv(tmp_path / "sync", *argv, *pp, steps=4), timeout=300)
    alone = run_world(_train, 2, _argv(tmp_path / "alone", *argv, *pp, "--pipeline_overlap_steps", "true",
                                       steps=4), timeout=300)
    for a, b in zip(sync, alone):      # the same updates; the sums only rounded otherwise (float32 norm)
        _same(a, b, rel=1e-6)
    assert os.listdir(tmp_path / "alone" / "step-2")
    assert [json.loads(x)["step"] for x in open(tmp_path / "alone" / "metrics.jsonl")] == [1, 2, 3, 4]


@pytest.mark.parametrize("clip", ["0", "1.0"], ids=["no-clipping", "post-validated"])
def test_stages_stepping_alone_agree_on_sigterm_a_step_late(tmp_path, clip):
    # rank 1 is signalled during step 2; the flag's all-reduce is read after step 3, so both
    # ranks save step 3 and leave, its record written (with clipping, step 3's update checked first)
    from test_reliability import _train_signalled
    argv = _argv(tmp_path, "--max_grad_norm", clip, "--pipeline_parallel_size", "2", "--pipeline_schedule",
                 "zbv", "--pipeline_overlap_steps", "true", steps=6)
    got = run_world(_train_signalled, 2, argv, 1, 1, timeout=300)
    assert [g[:2] for g in got] == [("preempted", 3)] * 2, got
    assert os.listdir(tmp_path / "step-3") and [[x[0] for x in g[2]] for g in got] == [[1, 2, 3]] * 2


def _train_validated(argv):
    """The curve, and the post-validator's counts (updates checked, redone clipped)."""
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    curve = _curve(trainer.train())
    v = trainer.step.validator
    return curve, (v.checked, v.redone) if v is not None else None


@pytest.mark.parametrize("clip", [pytest.param("1.0", marks=pytest.mark.slow), "2.58"],
                         ids=["every-step-clips", "some-steps-clip"])
def test_stages_stepping_alone_with_clipping_redo_each_update_clipping_changes(tmp_path, clip):
    # pipeline_overlap_steps with max_grad_norm (post_validate.py): each stage updates as if no
    # clipping were due and checks a step later; where the norm says clipping was due it redoes
    # the update clipped and runs the next step's schedule again. The curve is the synchronous
    # run's at every threshold: 1.0, where every step clips (the references above show it; slow),
    # and one between the synchronous run's norms, where some do and some do not (the fast twin:
    # both branches); the updates redone are exactly the steps whose norm exceeded it (step 2
    # checked before its save, the last one at the end of the run, before the evaluation), and a
    # run resumed from step 2 goes on as the uninterrupted one did
    pp = ["--pipeline_parallel_size", "2", "--pipeline_schedule", "zbv", "--max_grad_norm", clip]
    sync = run_world(_train, 2, _argv(tmp_path / "sync", *pp, steps=4), timeout=300)
    alone = run_world(_train_validated, 2, _argv(tmp_path / "alone", *pp, "--pipeline_overlap_steps", "true",
                                                 "--save_steps", "2", steps=4), timeout=300)
    due = sum(g + 1e-6 > float(clip) for *_, g in sync[0])
    assert due == 4 if clip == "1.0" else 0 < due < 4, [g for *_, g in sync[0]]
    for a, (b, counts) in zip(sync, alone):
        _same(a, b, rel=1e-6)
        assert counts == (4, due)
    resumed = run_world(_train, 2, _argv(tmp_path / "resumed", *pp, "--pipeline_overlap_steps", "true",
                                         "--resume_from_checkpoint", str(tmp_path / "alone" / "step-2"),
                                         steps=4), timeout=300)
    for (b, _), r in zip(alone, resumed):
        _same(b[2:], r, rel=1e-6)


def test_stepping_alone_is_refused_where_it_cannot_apply():
    from minipar.trainer.config.check import check
    from minipar.trainer.config.train_config import TrainConfig
    cfg = TrainConfig(pipeline_overlap_steps=True)            # pp 1
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=1 .*set pipeline_parallel_size >= 2"):
        check(cfg)


@pytest.mark.slow
def test_checkpoint_saved_on_pp2_resumes_on_pp4(tmp_path_factory, tmp_path):
    ref, save = _save_on_pp2(tmp_path_factory, tmp_path)
    _resume(ref, str(save / "step-3"), tmp_path / "resume4", 4, "--pipeline_parallel_size", "4")


# ------------------------------------------------------------------- 20 steps (make test-slow)
def _pp(world, layers, name, *extra):
    return pytest.param(world, layers, ["--pipeline_parallel_size", *extra], id=name)


SLOW = [
    _pp(2, 4, "pp2-afab", "2", "--pipeline_schedule", "afab"),
    _pp(2, 4, "pp2-1f1b", "2", "--pipeline_schedule", "1f1b"),
    _pp(2, 4, "pp2-interleaved", "2", "--pipeline_schedule", "interleaved_1f1b"),
    _pp(4, 8, "pp4-afab", "4", "--pipeline_schedule", "afab"),
    _pp(4, 8, "pp4-1f1b", "4", "--pipeline_schedule", "1f1b"),
    _pp(4, 8, "pp4-interleaved", "4", "--pipeline_schedule", "interleaved_1f1b"),
    _pp(4, 4, "pp2-tp2", "2", "--tensor_parallel_size", "2"),
    _pp(4, 4, "pp2-tp2-sp", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true"),
    _pp(4, 4, "pp2-cp2", "2", "--context_parallel_size", "2"),
    _pp(4, 4, "pp2-shard2-checkpointing", "2", "--dp_shard_size", "2", "--gradient_checkpointing", "true"),
    _pp(4, 4, "pp2-ddp2-interleaved", "2", "--dp_replicate_size", "2", "--dp_shard_size", "1",
        "--pipeline_schedule", "interleaved_1f1b"),
    _pp(8, 4, "pp2-hsdp2x2", "2", "--dp_replicate_size", "2", "--dp_shard_size", "2",
        "--micro_batch_size", "1"),
    _pp(16, 4, "pp2-shard2-cp2-tp2-sp", "2", "--dp_shard_size", "2", "--context_parallel_size", "2",
        "--tensor_parallel_size", "2", "--sequence_parallel", "true"),
    # zero bubble: m = p and m = 2p on pp 2 and pp 4 (global batch 8), then composed
    _pp(2, 4, "pp2-zb_h1-m2", "2", "--pipeline_schedule", "zb_h1", "--micro_batch_size", "4"),
    _pp(2, 4, "pp2-zb_h1-m4", "2", "--pipeline_schedule", "zb_h1"),
    _pp(2, 4, "pp2-zbv-m2", "2", "--pipeline_schedule", "zbv", "--micro_batch_size", "4"),
    _pp(2, 4, "pp2-zbv-m4", "2", "--pipeline_schedule", "zbv"),
    _pp(4, 8, "pp4-zb_h1-m4", "4", "--pipeline_schedule", "zb_h1"),
    _pp(4, 8, "pp4-zb_h1-m8", "4", "--pipeline_schedule", "zb_h1", "--micro_batch_size", "1"),
    _pp(4, 8, "pp4-zbv-m4", "4", "--pipeline_schedule", "zbv"),
    _pp(4, 8, "pp4-zbv-m8", "4", "--pipeline_schedule", "zbv", "--micro_batch_size", "1"),
    _pp(4, 4, "pp2-shard2-zbv-checkpointing", "2", "--dp_shard_size", "2", "--pipeline_schedule", "zbv",
        "--gradient_checkpointing", "true"),
    _pp(4, 4, "pp2-shard2-zb_h1", "2", "--dp_shard_size", "2", "--pipeline_schedule", "zb_h1"),
    _pp(4, 4, "pp2-tp2-sp-zb_h1", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true",
        "--pipeline_schedule", "zb_h1"),
    _pp(4, 4, "pp2-tp2-sp-zbv-async", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true",
        "--pipeline_schedule", "zbv", "--tp_async_overlap", "true"),
    _pp(4, 4, "pp2-ddp2-zbv", "2", "--dp_replicate_size", "2", "--dp_shard_size", "1",
        "--pipeline_schedule", "zbv"),
    _pp(16, 4, "pp2-shard2-cp2-tp2-sp-zb_h1", "2", "--dp_shard_size", "2", "--context_parallel_size", "2",
        "--tensor_parallel_size", "2", "--sequence_parallel", "true", "--pipeline_schedule", "zb_h1"),
    _pp(16, 4, "pp2-shard2-cp2-tp2-sp-zbv", "2", "--dp_shard_size", "2", "--context_parallel_size", "2",
        "--tensor_parallel_size", "2", "--sequence_parallel", "true", "--pipeline_schedule", "zbv"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world,layers,extra", SLOW)
def test_twenty_steps_match_single_process(tmp_path_factory, tmp_path, world, layers, extra):
    ref = _reference(tmp_path_factory, layers, 20)
    got = run_world(_train, world, _argv(tmp_path, *extra, layers=layers, steps=20), timeout=1800)
    for g in got:
        assert len(g) == 20
        _same(ref, g)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
def test_biased_model_under_zero_bubble_matches_single_process(tmp_path_factory, tmp_path, schedule):
    # 20 steps of a model with a bias on every projection (W's db, trained from zero), pp 2; the fast
    # proof: test_zero_bubble_biases_and_lora_equal_1f1b_in_fp64
    bias = ["--model.attention_bias", "true", "--model.mlp_bias", "true"]
    ref = _reference(tmp_path_factory, 4, 20, *bias)
    got = run_world(_train, 2, _argv(tmp_path, *bias, "--pipeline_parallel_size", "2", "--pipeline_schedule",
                                     schedule, steps=20), timeout=1800)
    for g in got:
        _same(ref, g)


@pytest.mark.slow
@pytest.mark.parametrize("config,world", [("pp.yaml", 4), ("5d.yaml", 16)])
def test_pipeline_configs_match_single_process(tmp_path_factory, tmp_path, config, world):
    ref = _reference(tmp_path_factory, 4, 20)
    got = run_world(_train, world, _argv(tmp_path, config=config, steps=20), timeout=1800)
    for g in got:                              # every rank, not rank 0 alone
        assert len(g) == 20
        _same(ref, g)


@pytest.mark.slow
def test_packed_finetune_on_pp2_matches_one_process(tmp_path_factory, tmp_path):
    # packed chat rows: document_ids reach every stage's attention (tests/test_datasets.py's run)
    from test_datasets import _packed_run, load_tokenizer, make_example
    d = tmp_path_factory.mktemp("example")
    paths = make_example(str(d), num_conversations=120, vocab_size=2048, tokenizer_chars=200_000)
    example = dict(paths, dir=str(d), tok=load_tokenizer(paths["tokenizer"]))
    _packed_run(example, tmp_path, 3, 4, pipeline_parallel_size=2, dp_shard_size=2, micro_batch_size=2)


def test_stages_apply_the_models_rope_scaling(tmp_path):
    """Llama 3.1's RoPE scaling (the frequencies of long wavelengths stretched) reaches every stage:
    pp 2 equals one process on a model with the scaling, far closer than the same model without it."""
    scaled = tmp_path / "llama3-rope.yaml"
    scaled.write_text("model:\n  rope_scaling: {rope_type: llama3, factor: 32.0, low_freq_factor: 1.0,\n"
                      "                 high_freq_factor: 4.0, original_max_position_embeddings: 4}\n")
    argv = lambda out, *extra: [str(scaled), *_tiny(2, 2), "--output_dir", str(out), *extra]  # noqa: E731
    ref = run_world(_train, 1, argv(tmp_path / "one"), timeout=300)[0]
    plain = run_world(_train, 1, _argv(tmp_path / "plain", layers=2, steps=2), timeout=300)[0]
    gap = lambda a, b: max(abs(x[3] - y[3]) / abs(x[3]) for x, y in zip(a, b))  # noqa: E731  (grad norms)
    assert gap(ref, plain) > 1e-4                          # the scaling changes the gradients
    for got in run_world(_train, 2, argv(tmp_path / "pp2", "--pipeline_parallel_size", "2"), timeout=300):
        _same(ref, got)
        assert gap(ref, got) < 1e-5
