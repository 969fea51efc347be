"""The planner against real runs: every config of configs/ on the tiny model, forked gloo worlds.

Per rank and config, one real optimizer step (train.py's Trainer) is measured and compared with
minipar.plan's prediction for the same model, layout, batch and dtype:
  - persistent state, EXACTLY: the bytes of model.parameters() (the ZeRO-3 shards, or the TP-local
    parameters), their .grad, and every tensor of the optimizer state, taken just before zero_grad;
  - the peak of gathered ZeRO-3 buffers over two steps (zero3.peak_gathered_bytes), EXACTLY;
  - communication, EXACTLY: comm.ledger()'s (op, group) -> calls and buffer bytes of the step;
  - activations, EXACTLY, at three sequence lengths (a mixture of experts' planned for the routing
    each rank observed: tests/test_plan_moe.py). "Measured activation memory" here is the
    bytes of the distinct storages that autograd saves for backward during one micro-batch's
    forward (torch.autograd.graph.saved_tensors_hooks), parameters and gathered ZeRO-3 buffers
    excluded: what the forward leaves alive for backward, its peak. Transient buffers that no
    backward needs (the logits themselves) are not in it. With activation checkpointing, what the
    forward keeps (layer inputs and the unwrapped root).
"""
import contextlib
import dataclasses
import functools
import glob
import math
import os

import pytest
import torch
import yaml
from harness import run_world

from minipar import batch_split, comm_ledger
from minipar.pipeline_parallel.p2p import activation_shape
from minipar.plan import Layout, activations, collectives, memory, search
from minipar.plan.__main__ import main as plan_main
from minipar.plan.estimate import Cluster, crosses_nodes
from minipar.plan.inputs import Batch, ModelShape, Options
from minipar.plan.long_step import plan_stage
from minipar.plan.pipeline_stage import Pipeline
from minipar.plan.stage_units import stages
from minipar.trainer.prediction import from_train_config
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.moe import MoEExperts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "32",
        "--global_batch_size", "8", "--max_steps", "2", "--warmup_steps", "1", "--eval_steps", "0",
        "--progress_bar", "false", "--save_final_checkpoint", "false", "--export_hf", "false",
        # MFU's peak given: no rank measures its CPU's (six 1024 x 1024 matmuls, a third of
        # test_plan_matches_runs_on_4_ranks' time); nothing here reads the MFU (or the loss curve)
        "--peak_tflops", "1", "--loss_curve", "false"]
SEQS = (32, 64, 128)       # the three activation sizes


def _tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _saved_bytes(model, batch, n_items, h=None, autocast=contextlib.nullcontext):
    """Distinct storages saved for backward by one forward, parameters excluded, under the run's
    autocast (bf16 without ZeRO-3: its casts are saved too). (No backward: the graph is dropped,
    which frees what it saved; ZeRO-3 has already resharded after forward.)
    A pipeline stage runs each of its model chunks once, on a residual stream `h` of the shape and
    dtype that p2p.py receives (the input ids on the first virtual stage): one micro-batch's bytes,
    the received h among them (executor.py keeps it for its gradient, saved by a layer or not)."""
    seen = {}
    params = list(model.parameters())      # the same tensors all forward (their storages may move)

    def excluded():
        ptrs = {p.untyped_storage().data_ptr() for p in params}
        zero3 = getattr(model, "zero3", None)
        if zero3 is not None:
            ptrs |= {u.buffer.untyped_storage().data_ptr() for u in zero3.units if u.gathered_bytes}
        return ptrs

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in seen and st.data_ptr() not in excluded():
            seen[st.data_ptr()] = st.nbytes()
        return t

    outs = []          # alive until the end: a freed graph's storages could be reused, and missed
    # the micro-batch is its own storage, as on a GPU (local_batch copies it to the device); on the
    # CPU it is a view of the global batch, whose whole int64 ids the embedding would seem to keep
    batch = {k: v.clone() for k, v in batch.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        for chunk in range(getattr(model, "num_chunks", 1)):
            x = batch["input_ids"] if h is None or model.is_first_virtual(chunk) else h().requires_grad_()
            if x.requires_grad:    # the executor keeps a received h until its backward reads x.grad:
                # in bf16 a tensor no layer saves (the norm keeps an fp32 copy, autocast's stream too)
                outs.append(x)
                seen.setdefault(x.untyped_storage().data_ptr(), x.untyped_storage().nbytes())
            outs.append(model(x, position_ids=batch["position_ids"], labels=batch["labels"],
                              num_items_in_batch=n_items, **(dict(chunk=chunk) if h is not None else {})))
    return sum(seen.values())


def _measure(argv, activations=True):
    torch.set_num_threads(1)
    tr = Trainer(setup_run(argv))
    state = {}
    zero_grad = tr.optimizer.zero_grad

    def measure_then_zero(set_to_none=True):    # the state as it stands at the end of the step
        params = list(tr.model.parameters())
        opt = [v for st in tr.optimizer.state.values() for v in st.values()]
        state.update(params=_tensor_bytes(params), grads=_tensor_bytes(p.grad for p in params),
                     optimizer=_tensor_bytes(opt))
        zero_grad(set_to_none=set_to_none)

    tr.optimizer.zero_grad = measure_then_zero
    with comm_ledger.ledger() as led:
        tr.train_step(0)
    ledger = {k: list(v) for k, v in led.summary().items()}
    tr.train_step(1)                            # the second step prefetches in the learned order
    kept = tr.step.validator.kept if tr.step.validator is not None else None
    if kept is not None:                        # post-validation's copy of step 2's update, unchecked
        opt = [v for st in kept["optimizer"]["state"].values() for v in st.values()]
        state["kept"] = _tensor_bytes(kept["params"]) + _tensor_bytes(kept["grads"]) + _tensor_bytes(opt)
    zero3 = getattr(tr.model, "zero3", None)
    state["gathered"] = zero3.peak_gathered_bytes if zero3 is not None else 0
    M, pgm, acts, routing = tr.run.num_micro_steps, tr.pgm, {}, {}
    # a mixture of experts' routing in each measured forward: the rows each MoE layer's local experts
    # received (models/moe.py's MoEExperts, called with its runs' lengths), for tests/test_plan_moe.py
    runs = []
    hooks = [m.register_forward_hook(lambda m, args, out: runs.append(
        [int(c) for c in (args[1] if isinstance(args[1], list) else args[1].tolist())]))
        for m in tr.model.modules() if isinstance(m, MoEExperts)]
    for checkpointing in (False, True) if activations else ():
        tr.model.gradient_checkpointing = checkpointing
        for seq in SEQS:
            g = torch.Generator().manual_seed(seq)
            ids = torch.randint(0, 256, (tr.cfg.global_batch_size, seq), generator=g)
            batch = batch_split.local_batch(ids, ids.roll(-1, 1), pgm, 0, M)
            h = None
            if tr.step.pipelined:                 # what a stage receives: p2p.py's shape and dtype
                shape = activation_shape(batch, pgm, tr.cfg.model.hidden_size, pgm.config.sequence_parallel)
                h = lambda: torch.randn(shape).to(tr.step.act_dtype)
            runs.clear()
            acts[(checkpointing, seq)] = _saved_bytes(tr.model, batch, ids.numel(), h, tr.autocast)
            routing[(checkpointing, seq)] = list(runs)
    for hook in hooks:
        hook.remove()
    return dict(state=state, ledger=ledger, acts=acts, routing=routing, cfg=tr.cfg, layout=pgm.config)


def _measure_all(argvs, activations=True):
    """Several runs one after another in the same world (each builds its own groups); activations=False:
    no activation bytes measured (acts {}), for a check that does not read them."""
    return [_measure(argv, activations) for argv in argvs]


def _argv(config, tmp, *extra):
    layers = ["--model.num_hidden_layers", "4"] if _sizes(config)["pipeline_parallel_size"] > 2 else []
    return [os.path.join(ROOT, "configs", config), *TINY, *layers, "--output_dir", str(tmp),
            "--dataset", os.path.join(ROOT, "data", "shakespeare.txt"), *extra]


def _plan_rank(model, layout, pipe, batch, opts, rank):
    """(memory, ledger, one micro-batch's activations) planned for global rank `rank`: with
    pipeline parallelism its stage's (pp is the outermost grid dimension: stage rank // W)."""
    if pipe is None:
        act = lambda b, ck: activations(model, layout, b, opts)["checkpointed" if ck else "full"]
        return memory(model, layout, opts), collectives(model, layout, batch, opts), act
    st = stages(model, pipe)[rank // layout.world]
    p = plan_stage(model, layout, pipe, st, batch, opts)
    act = lambda b, ck: plan_stage(model, layout, pipe, st, b, opts)["activations"][
        "per_micro_checkpointed" if ck else "per_micro"]
    return p["memory"], p["collectives"], act


def _check(r0, results, routed=None):
    """State, gathered peak and ledger exactly on every rank; the activations of each stage's first
    rank exactly too. routed(r, checkpointing, seq): the bytes by which rank r's observed routing
    (a mixture of experts', tests/test_plan_moe.py) departs from the balanced plan; given, every
    rank's activations are held, exactly, to the plan plus it."""
    model, sizes, batch, opts = from_train_config(r0["cfg"])
    lc = r0["layout"]
    layout = Layout(lc.dp_replicate_size, lc.dp_shard_size, lc.cp_size, lc.tp_size, lc.sequence_parallel,
                    lc.cp_impl, lc.cp_ulysses_size)
    pipe = Pipeline.from_sizes(sizes) if sizes.get("pp", 1) > 1 else None
    for rank, r in enumerate(results):
        mem, coll, act = _plan_rank(model, layout, pipe, batch, opts, rank)
        want = {k: [c, b] for k, (c, b) in coll.items()}
        got = r["state"]
        where = f"{pipe or ''} {layout}, rank {rank}"
        assert (got["params"], got["grads"], got["optimizer"], got["gathered"], got.get("kept", 0)) == \
            (mem["params"], mem["grads"], mem["optimizer"], mem["gathered"], mem.get("kept", 0)), \
            f"{where}: measured state {got}, planned {mem}"
        assert r["ledger"] == want, f"{where}: ledger {sorted(r['ledger'].items())}\n" \
                                    f"planned {sorted(want.items())}"
        if rank % layout.world and routed is None:      # activations: the first rank of each stage
            continue
        for (checkpointing, seq), measured in r["acts"].items():
            planned = act(dataclasses.replace(batch, sequence_len=seq), checkpointing)
            planned += routed(r, checkpointing, seq) if routed is not None else 0
            assert planned == measured, \
                f"{where}, seq {seq}, checkpointing {checkpointing}: " \
                f"planned {planned} B, measured {measured} B"


def _check_world(world, runs, tmp_path):
    argvs = [_argv(config, tmp_path / str(i), *extra) for i, (config, extra) in enumerate(runs)]
    per_rank = run_world(_measure_all, world, argvs, timeout=900)
    for i in range(len(runs)):
        _check(per_rank[0][i], [r[i] for r in per_rank])


def _sizes(config):
    with open(os.path.join(ROOT, "configs", config)) as f:
        d = yaml.safe_load(f)
    return {k: d.get(k) or 1 for k in ("dp_replicate_size", "dp_shard_size", "context_parallel_size",
                                       "tensor_parallel_size", "pipeline_parallel_size")}


def _base_model(config):
    with open(os.path.join(ROOT, "configs", config)) as f:
        return (yaml.safe_load(f) or {}).get("base_model")


ALL_CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
# finetune.yaml's model is the directory `python -m minipar.trainer.data.make_example` writes (its
# loading is held against one process in tests/test_hf_load.py); here every model is the tiny one
# the mixtures of experts: tests/test_plan_moe.py holds moe.yaml against its plan (routing-dependent bytes)
MOE_CONFIGS = ["finetune_moe.yaml", "moe.yaml"]
FROM_BASE_MODEL = [c for c in ALL_CONFIGS if _base_model(c) and c not in MOE_CONFIGS]
CONFIGS = [c for c in ALL_CONFIGS if c not in FROM_BASE_MODEL + MOE_CONFIGS]
WORLDS = {c: math.prod(_sizes(c).values()) for c in CONFIGS}
WORLDS["default.yaml"] = 8          # dp_shard takes the remainder: 2 x cp 2 x tp 2, as its comment says
# beyond the configs: sequence parallelism, bf16 ZeRO-3, activation checkpointing (its recompute
# repeats the forward's TP all-reduces and ring hops), accumulation over micro-batches, and ZeRO-3
# over dp_shard x cp (what the 8- and 16-rank configs add, on 4 ranks)
VARIANTS = [("fsdp_tp.yaml", ["--sequence_parallel", "true", "--gradient_checkpointing", "true",
                              "--fsdp.prefetch", "0"]),
            ("fsdp.yaml", ["--dtype", "bfloat16", "--micro_batch_size", "1"]),
            ("hsdp.yaml", ["--micro_batch_size", "1", "--fsdp.sync_each_batch", "false"]),
            ("cp_tp.yaml", ["--gradient_checkpointing", "true"]),
            ("fsdp.yaml", ["--context_parallel_size", "2", "--dp_shard_size", "2",
                           "--tensor_parallel_size", "1"])]
# pipeline parallelism beyond pp.yaml (pp 4, 1F1B, no dp): every pp path of minipar/plan/pipeline.py
# on 4 ranks: ZeRO-3 per stage in bf16 (bf16 messages, the empty root of the first stage), TP + SP
# inside the stages under AFAB with checkpointing, DDP and ZeRO-3 per stage under the interleaved schedule,
# ZeRO-3 under ZB-V and TP + SP under ZB-H1, and bf16 TP without ZeRO-3 (autocast: fp32 messages and
# stream, the TP collectives in two dtypes as collective_counts.py prices them)
TIED = ["--model.tie_word_embeddings", "true"]
PP_VARIANTS = [("fsdp.yaml", ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--dtype", "bfloat16",
                              "--micro_batch_size", "1"]),
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2",
                            "--sequence_parallel", "true", "--pipeline_schedule", "afab",
                            "--gradient_checkpointing", "true"]),
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--dp_replicate_size", "2",
                            "--pipeline_schedule", "interleaved_1f1b", "--micro_batch_size", "1",
                            "--model.num_hidden_layers", "4"]),
               # ZeRO-3 prefetch under interleaving: the learned unit order alternates between chunks
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--pipeline_schedule",
                            "interleaved_1f1b", "--micro_batch_size", "1", "--model.num_hidden_layers", "8"]),
               # zero bubble: W gathers nothing and reduces once per step; the V's sends and turn
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--pipeline_schedule",
                            "zbv", "--micro_batch_size", "1", "--model.num_hidden_layers", "4"]),
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2",
                            "--sequence_parallel", "true", "--pipeline_schedule", "zb_h1"]),
               # stages stepping alone: the loss and norm in one background sum over the world,
               # the norm measured (for the log) though nothing is clipped
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--pipeline_schedule",
                            "zbv", "--micro_batch_size", "1", "--model.num_hidden_layers", "4",
                            "--max_grad_norm", "0", "--pipeline_overlap_steps", "true"]),
               # ... with clipping: post-validation keeps a copy of the stage's whole state
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--pipeline_schedule",
                            "zbv", "--micro_batch_size", "1", "--model.num_hidden_layers", "4",
                            "--pipeline_overlap_steps", "true"]),
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2", "--dtype",
                            "bfloat16", "--micro_batch_size", "1", "--model.num_hidden_layers", "4"]),
               # tied embeddings (pipeline_parallel/tied_ends.py): the last stage's copy of E (its
               # root E alone, its norm a unit) and the all-reduce over pp_ends, ZeRO-3 in bf16 and
               # TP + SP; under ZB-V both ends on rank 0 (one root of E + norm, no sum); interleaved
               ("fsdp.yaml", ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--dtype", "bfloat16",
                              "--micro_batch_size", "1", *TIED]),
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--tensor_parallel_size", "2",
                            "--sequence_parallel", "true", *TIED]),
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--pipeline_schedule",
                            "zbv", "--micro_batch_size", "1", "--model.num_hidden_layers", "4", *TIED]),
               ("pp.yaml", ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--pipeline_schedule",
                            "interleaved_1f1b", "--micro_batch_size", "1", "--model.num_hidden_layers", "8",
                            *TIED])]


# the default suite's share of PP_VARIANTS: ZeRO-3 per stage in bf16, ZeRO-3 under the interleaved
# schedule, stages stepping alone with clipping under ZB-V, bf16 TP, tied on ZeRO-3 in bf16; the
# slow twin runs them all
PP_FAST = [PP_VARIANTS[i] for i in (0, 3, 7, 8, 9)]


@pytest.mark.parametrize("pp_runs", [PP_FAST, pytest.param(PP_VARIANTS, marks=pytest.mark.slow)],
                         ids=["fast", "every-pp-variant"])
def test_plan_matches_runs_on_4_ranks(tmp_path, pp_runs):
    """Every 4-rank config, and the variants, in one forked world of 4."""
    runs = [(c, []) for c in CONFIGS if WORLDS[c] == 4] + VARIANTS + pp_runs
    assert len(runs) >= 10 and "pp.yaml" in [c for c, _ in runs]
    _check_world(4, runs, tmp_path)


# bf16 TP without ZeRO-3: autocast keeps the residual stream fp32 and casts only a matmul's output,
# so the embedding's g and the backward of every f carry fp32, the row-parallel outputs' g bf16
BF16_TP_UNSHARDED = [("ddp.yaml", ["--dp_replicate_size", "2", "--tensor_parallel_size", "2", "--dtype",
                                   "bfloat16", "--gradient_checkpointing", "true"]),
                     ("ddp.yaml", ["--dp_replicate_size", "2", "--tensor_parallel_size", "2", "--dtype",
                                   "bfloat16", "--sequence_parallel", "true"])]


def test_plan_matches_bf16_tp_runs_without_zero3(tmp_path):
    """State, ledger and activations exactly (measured under the run's autocast: its bf16 casts of
    every matmul's input and weight, the fp32 stream), with and without SP."""
    _check_world(4, BF16_TP_UNSHARDED, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("config", [c for c in CONFIGS if WORLDS[c] > 4])
def test_plan_matches_run_8_and_16_ranks(tmp_path, config):
    _check_world(WORLDS[config], [(config, [])], tmp_path)


# ------------------------------------------------------------------ the planner alone (no ranks)
LLAMA = os.path.join(ROOT, "configs", "models")


def _llama(name):
    import json
    with open(os.path.join(LLAMA, name + ".json")) as f:
        return ModelShape.from_dict(json.load(f))


def test_llama_parameter_counts():
    # the published sizes: 8.03 B and 70.6 B parameters
    assert round(_llama("llama-3.1-8b").num_params() / 1e9, 2) == 8.03
    assert round(_llama("llama-3.1-70b").num_params() / 1e9, 1) == 70.6


def test_crosses_nodes_follows_the_grid():
    # 2x2x2x2 on nodes of 4: tp (ranks t, t+1) and cp (stride 2) stay inside; dp_shard_cp spans 0..6
    cross = crosses_nodes(Layout(2, 2, 2, 2), gpus_per_node=4)
    assert cross == dict(tp=False, cp=False, cp_ulysses=False, cp_ring=False, dp_shard_cp=True,  # ring: u 1
                         dp_replicate=True, dp_cp=True)
    assert not any(crosses_nodes(Layout(2, 2, 2, 2), gpus_per_node=16).values())


@functools.lru_cache(maxsize=None)
def _search_8b(world):
    """The search for Llama 3.1 8B, 64 x 8192 tokens, on `world` GPUs (two tests read world 8's)."""
    return search(_llama("llama-3.1-8b"), Batch(64, 1, 8192), Options(), Cluster(), world)


def test_search_follows_its_rules():
    """The estimate ranks; the placement rules only choose among the layouts within 5 % of the fastest."""
    for world in (8, 16):
        s = _search_8b(world)
        rec, ranked = s["recommended"], s["ranked"]
        assert rec in ranked and all(p["memory"]["fits"] for p in ranked)
        assert [p["time"]["step_s"] for p in ranked] == sorted(p["time"]["step_s"] for p in ranked)
        band = [p for p in ranked if p["time"]["step_s"] <= 1.05 * ranked[0]["time"]["step_s"]]
        assert rec in band and rec["layout"]["tp"] <= 8
        if any(p["layout"]["tp"] <= 8 for p in band):
            band = [p for p in band if p["layout"]["tp"] <= 8]
        assert rec["layout"]["cp"] == min(p["layout"]["cp"] for p in band)
        if world > 8 and any(not p["comm"]["dp_shard_cp"]["crosses_nodes"] for p in band):
            assert not rec["comm"]["dp_shard_cp"]["crosses_nodes"]
        # pipeline layouts are ranked too (planned stage by stage, under every schedule that runs),
        # recommended across nodes only
        pps = {p["layout"].get("pp", 1) for p in ranked}
        assert pps == ({1, 2, 4, 8} if world <= 8 else {1, 2, 4, 8, 16})
        assert world > 8 or rec["layout"].get("pp", 1) == 1
        piped = [p for p in ranked if "stages" in p]
        assert all(len(p["stages"]) == p["layout"]["pp"] for p in piped)
        assert {p["pipeline"]["schedule"] for p in piped} == {"1f1b", "interleaved_1f1b", "zb_h1", "zbv"}
        # the same layout under ZB-H1: 1F1B's sends, a third of its bubble, so never slower
        step = {(p["layout_str"].split(" (")[0] + p["layout_str"].split(")")[1], p["pipeline"]["schedule"]):
                p["time"] for p in piped}
        both = [k for k, sch in step if sch == "1f1b" and (k, "zb_h1") in step]
        assert both and all(step[(k, "zb_h1")]["step_s"] < step[(k, "1f1b")]["step_s"]
                            and step[(k, "zb_h1")]["bubble"] < step[(k, "1f1b")]["bubble"] / 2 for k in both)
        assert all(p["options"]["gradient_checkpointing"] in (False, "selective", True) for p in ranked)


@pytest.mark.slow
def test_search_never_trades_a_real_slowdown_for_a_placement_rule():
    """70B on 256 GPUs: "shard groups inside a node" once picked a layout 2.2x slower than the
    fastest that fit (85th of 98); now the recommendation is within 5 % (the issue asks 10 %).
    A minute of search: slow; its fast twin is test_search_follows_its_rules (8B on 8 and 16 GPUs,
    the recommendation inside the 5 % band)."""
    s = search(_llama("llama-3.1-70b"), Batch(256, 1, 8192), Options(), Cluster(), 256)
    fastest, rec = s["ranked"][0]["time"]["step_s"], s["recommended"]["time"]["step_s"]
    assert len(s["ranked"]) > 100 and rec <= 1.05 * fastest, (rec, fastest)


def test_long_steps_extend_the_replay_exactly():
    """A stage of a long step (m > 4p) is computed from three short replays and extended; the
    answer is the full replay's, under AFAB, 1F1B, interleaved, ZB-H1 and ZB-V, ZeRO-3 and DDP,
    prefetch 1 and 2."""
    from minipar.plan import Pipeline, plan_stage
    from minipar.plan.pipeline_stage import replay_stage
    from minipar.plan.stage_units import stages
    m8, m70 = _llama("llama-3.1-8b"), _llama("llama-3.1-70b")
    cases = [(m8, Layout(1, 2, 1, 2, True), Pipeline(4, "1f1b"), Batch(64, 1, 4096),
              Options(dtype="bfloat16")),
             (m8, Layout(2, 1, 1, 2, True), Pipeline(2, "afab"), Batch(48, 1, 4096), Options()),
             (m8, Layout(1, 4, 2, 1, False), Pipeline(4, "1f1b"), Batch(192, 2, 4096),
              Options(gradient_checkpointing=True, prefetch=2)),
             (m70, Layout(1, 2, 1, 8, True), Pipeline(8, "1f1b"), Batch(1024, 1, 8192),
              Options(dtype="bfloat16", sync_each_batch=False)),
             # the zero-bubble schedules repeat per micro-batch too, the interleaved one per group of p
             (m8, Layout(1, 2, 1, 2, True), Pipeline(4, "zb_h1"), Batch(64, 1, 4096), Options()),
             (m8, Layout(1, 2, 1, 2, True), Pipeline(2, "zbv", 2), Batch(64, 1, 4096),
              Options(gradient_checkpointing=True)),
             (m8, Layout(1, 2, 1, 2, True), Pipeline(2, "interleaved_1f1b", 2), Batch(64, 1, 4096),
              Options())]
    for model, lay, pipe, batch, opts in cases:
        assert batch.micro_steps(lay) > 4 * pipe.pp
        for st in stages(model, pipe):
            assert plan_stage(model, lay, pipe, st, batch, opts) \
                == replay_stage(model, lay, pipe, st, batch, opts)


def test_pipeline_stage_peak_is_its_largest_phase():
    """A stage's peak is the largest of its own phases (peak.py, with the activations its schedule
    keeps in flight), not the sum of every line's maximum: under no_sync the shard gradients only
    come with the last backward, and the logits, the layers' gradient pieces and the state's
    gradients never meet. Each phase is held to its formula; the old sum is above all of them."""
    from minipar.plan.model import _padded
    from minipar.plan.pipeline import plan_pipeline
    from minipar.plan.stage_units import stage_units
    model, lay, batch = _llama("llama-3.1-8b"), Layout(1, 4, 1, 1), Batch(32, 1, 4096)
    pipe, opts = Pipeline(2, "1f1b"), Options(dtype="bfloat16")
    p = plan_pipeline(model, lay, pipe, batch, opts, Cluster())
    first, last = p["stages"]
    for st in p["stages"]:
        m, a = st["memory"], st["activations"]
        assert m["total"] == max(m["phases"].values())
        assert m["total"] < m["persistent"] + m["gathered"] + m["accumulated_grads"] + a["as_configured"]
    # the first stage's last forward: two micro-batches in flight, the layers' window gathered, the
    # unsharded fp32 accumulators of no_sync, no shard gradient yet
    m, a = first["memory"], first["activations"]
    assert a["in_flight"] == 2 and m["accumulated_grads"] > 0 and set(m["phases"]) == {
        "forward", "layer backward", "backward end", "optimizer"}
    S = m["persistent"] - m["grads"]
    assert m["phases"]["forward"] == S + m["gathered"] + m["accumulated_grads"] + a["as_configured"]
    # the last stage's loss forward: the root gathered, one micro-batch in flight, its logits and
    # z - max beside the fp32 softmax
    m, a = last["memory"], last["activations"]
    root = _padded(stage_units(model, lay, stages(model, pipe)[1])[0].numel, 4) * 2
    logits = 4096 * model.vocab_size
    assert a["in_flight"] == 1 and m["phases"]["loss forward"] == (
        m["persistent"] - m["grads"] + root + a["as_configured"] + logits * (2 + 4) + m["accumulated_grads"])


def test_cli_json_and_errors(capsys):
    import json
    assert plan_main([os.path.join(ROOT, "configs", "hsdp.yaml"), "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["layout"] == dict(dp_replicate=2, dp_shard=2, cp=1, tp=1, sequence_parallel=False,
                               cp_impl="ring", cp_ulysses_size=None, ep=1)
    m = p["memory"]
    assert m["persistent"] == m["params"] + m["grads"] + m["optimizer"] and m["gathered"] > 0
    assert set(p["comm"]) == {"dp_shard_cp", "dp_replicate", "dp_cp"}
    assert plan_main(["--model", os.path.join(LLAMA, "llama-3.1-8b.json"), "--world", "6", "--tp", "3"]) == 2
    assert "tp 3 does not divide num_attention_heads 32" in capsys.readouterr().err
    assert plan_main(["--model", os.path.join(LLAMA, "llama-3.1-8b.json"), "--world", "8", "--tp", "4",
                      "--dp-shard", "4"]) == 2
    assert "multiply to 16" in capsys.readouterr().err


def test_cli_gpu_presets_and_the_flags_that_replace_them(capsys):
    """--gpu plans on a data sheet's peak, HBM, memory and NVLink (minipar/gpus.py); a flag given
    replaces its figure; Cluster's own defaults are the h100 preset; the text names the GPU."""
    import json

    from minipar.gpus import PRESETS
    assert {k: getattr(Cluster(), k) for k in PRESETS["h100"]} == PRESETS["h100"]
    base = ["--model", os.path.join(LLAMA, "llama-3.1-8b.json"), "--world", "8", "--dp-shard", "8"]
    budget, step = {}, {}
    for gpu in ("h100", "h200", "a100", "b200"):
        assert plan_main(base + ["--gpu", gpu, "--json"]) == 0
        p = json.loads(capsys.readouterr().out)
        budget[gpu], step[gpu] = p["memory"]["budget"], p["time"]["step_s"]
    assert budget["h200"] == pytest.approx(budget["h100"] * 141 / 80)
    assert step["b200"] < step["h200"] < step["h100"] < step["a100"]   # h200: H100's peak, faster HBM
    assert plan_main(base + ["--gpu", "h200", "--gpu-memory", "80GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["budget"] == pytest.approx(budget["h100"])
    assert plan_main(base + ["--gpu", "a100", "--peak-tflops", "300"]) == 0
    assert capsys.readouterr().out.startswith("GPU: a100 (minipar/gpus.py, flags replace its figures): "
                                              "300 TFLOP/s dense bf16, HBM 2039 GB/s, 80 GiB")


def test_results_file_is_current():
    """benchmarks/results/plan.md holds what the planner says now (one cell, regenerated)."""
    with open(os.path.join(ROOT, "benchmarks", "results", "plan.md")) as f:
        text = f.read()
    rec = _search_8b(8)["recommended"]
    assert f"| llama-3.1-8b | 8 | 64 x 8192 | {rec['layout_str']}" in text, \
        "benchmarks/results/plan.md is stale: run python benchmarks/plan_llama.py"


def test_every_config_is_planned_or_refused(capsys, tmp_path, monkeypatch):
    """The configs that test_plan_matches_* does not run are those whose model is a generated
    base_model directory: planned once it exists, refused clearly before. Pipeline configs are
    planned stage by stage."""
    assert sorted(CONFIGS + FROM_BASE_MODEL + MOE_CONFIGS) == ALL_CONFIGS
    assert all(WORLDS[c] in (4, 8, 16) for c in CONFIGS)
    assert any(_sizes(c)["pipeline_parallel_size"] > 1 for c in CONFIGS)
    monkeypatch.chdir(tmp_path)
    for config in FROM_BASE_MODEL:
        assert plan_main([os.path.join(ROOT, "configs", config), "--world", "8"]) == 2
        assert f"base_model '{_base_model(config)}'" in capsys.readouterr().err
    if FROM_BASE_MODEL:
        from minipar.trainer.data.make_example import make_example
        make_example("out/example")                   # what the README runs before fine-tuning
        capsys.readouterr()
        for config in FROM_BASE_MODEL:
            assert plan_main([os.path.join(ROOT, "configs", config), "--world", "8"]) == 0
            assert "dp_shard 2 x cp 2 x tp 2 on 8 GPUs" in capsys.readouterr().out


def test_cli_pipeline_overlap_steps_hides_zbvs_fill(capsys):
    """--pipeline-overlap-steps (the trainer's pipeline_overlap_steps): zbv's bubble is the one of
    steps run back to back, none once m >= 2p - 1, and the step shorter; 1F1B's is unchanged; pp 1
    and --search are refused."""
    import json
    pp = [os.path.join(ROOT, "configs", "pp.yaml"), "--pp", "2", "--world", "2", "--json",
          "--max-grad-norm", "0"]
    got = {}
    for schedule in ("1f1b", "zbv"):
        for extra in ([], ["--pipeline-overlap-steps"]):
            assert plan_main(pp + ["--pipeline-schedule", schedule] + extra) == 0
            got[schedule, bool(extra)] = json.loads(capsys.readouterr().out)["time"]
    # with clipping (pp.yaml's max_grad_norm 1.0) each stage post-validates: it keeps a copy of its
    # persistent state through the next step, and copies it every step (pipeline_parallel/post_validate.py)
    assert plan_main(pp[:-2] + ["--pipeline-schedule", "zbv", "--pipeline-overlap-steps"]) == 0
    clipped = json.loads(capsys.readouterr().out)
    for st in clipped["stages"]:
        assert st["memory"]["kept"] == st["memory"]["persistent"] > 0
    assert clipped["time"]["step_s"] > got["zbv", True]["step_s"]
    m = 8                                          # 16 sequences in micro-batches of 2, dp 1
    assert got["zbv", False]["bubble"] == pytest.approx(1 / (6 * m + 1)) and got["zbv", True]["bubble"] == 0
    assert got["zbv", True]["step_s"] < got["zbv", False]["step_s"]
    assert got["1f1b", True]["bubble"] == got["1f1b", False]["bubble"] == pytest.approx(1 / (m + 1))
    assert plan_main([os.path.join(ROOT, "configs", "fsdp.yaml"), "--pipeline-overlap-steps"]) == 2
    assert "give --pp 2 or more" in capsys.readouterr().err
    assert plan_main([os.path.join(ROOT, "configs", "pp.yaml"), "--search", "--pipeline-overlap-steps"]) == 2
    assert "--search ranks every pipeline size itself" in capsys.readouterr().err


def test_cli_pipeline_json_bubble_and_errors(capsys):
    """A pipeline config prints every stage; the time carries the bubble of its schedule; bad
    pipeline settings are refused with the trainer's own messages, and --search tries every pp itself."""
    import json
    assert plan_main([os.path.join(ROOT, "configs", "5d.yaml"), "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["world"] == 16 and p["layout"]["pp"] == 2 and [s["rank"] for s in p["stages"]] == [0, 1]
    first, last = p["stages"]
    assert first["first"] and last["last"] and first["layers"] == [[0, 1]] and last["layers"] == [[2, 3]]
    m = p["micro_steps"]
    assert p["time"]["bubble"] == pytest.approx(1 / (m + 1)) and p["time"]["pp_s"] > 0
    assert p["comm"]["pp"]["crosses_nodes"] and first["comm"]["pp"]["ops"]["send"]["calls"] == m
    assert first["activations"]["in_flight"] == min(m, 2) and last["activations"]["in_flight"] == 1
    assert plan_main([os.path.join(ROOT, "configs", "pp.yaml"), "--pipeline-schedule", "interleaved_1f1b",
                      "--json"]) == 2          # 4 layers cannot fill 4 stages x 2 chunks
    assert "cannot be split over 8 (virtual) pipeline stages" in capsys.readouterr().err
    assert plan_main([os.path.join(ROOT, "configs", "pp.yaml"), "--global-batch-size", "4"]) == 2
    assert "needs at least 4 micro-batches" in capsys.readouterr().err
    assert plan_main([os.path.join(ROOT, "configs", "pp.yaml"), "--search", "--pp", "2"]) == 2
    assert "--search ranks every pipeline size itself" in capsys.readouterr().err
    # the config's pp: searched over
    assert plan_main([os.path.join(ROOT, "configs", "pp.yaml"), "--search", "--json"]) == 0
    # 4 GPUs, one node: "PP only across nodes" breaks near-ties only; for this tiny model the estimate
    # puts pp 2 (half the all-reduce) well ahead of every pp 1 layout, so the estimate wins
    found = json.loads(capsys.readouterr().out)
    times = [p["time"]["step_s"] for p in found["ranked"]]
    assert {p["layout"].get("pp", 1) for p in found["ranked"]} == {1, 2}
    assert found["recommended"]["time"]["step_s"] <= 1.05 * times[0]
    assert found["recommended"]["layout"].get("pp", 1) == 1 or \
        all(t > 1.05 * times[0] for p, t in zip(found["ranked"], times) if p["layout"].get("pp", 1) == 1)
    llama = os.path.join(LLAMA, "llama-3.1-8b.json")
    assert plan_main(["--model", llama, "--world", "16", "--pp", "4",
                      "--pipeline-schedule", "interleaved_1f1b",
                      "--global-batch-size", "16", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["time"]["bubble"] == pytest.approx(3 / (2 * p["micro_steps"] + 3))
    assert [len(s["layers"]) for s in p["stages"]] == [2] * 4     # 32 layers: 8 virtual stages of 4


def test_the_fewest_gpus_hint_counts_pipelines():
    """The fast twin of the one below: 8B on 16 GiB cards fits no layout of 8 GPUs; the hint names 16,
    where the search recommends a pipeline (a stage holds half the layers' state)."""
    from minipar.plan.layout_search import smallest_world
    model, batch = _llama("llama-3.1-8b"), Batch(8, 1, 4096)
    cluster = Cluster(gpu_memory_bytes=16 * 2 ** 30)
    assert search(model, batch, Options(), cluster, 8)["recommended"] is None
    need = smallest_world(model, batch, Options(), cluster, 1)
    best = search(model, batch, Options(), cluster, need)["recommended"]
    assert need == 16 and best is not None and best["layout"]["pp"] == 2


@pytest.mark.slow
def test_the_fewest_gpus_hint_is_a_world_where_the_search_finds_a_fit():
    """The hint counts pipelines too, and the world it names has a recommendation (70B: 24 GPUs;
    at 16, pp 2 x tp 8, the optimizer phase's foreach AdamW temporary needs 88 GB of an 80 GB card)."""
    from minipar.plan.layout_search import smallest_world
    model, batch, cluster = _llama("llama-3.1-70b"), Batch(64, 1, 8192), Cluster()
    assert search(model, batch, Options(), cluster, 8)["recommended"] is None
    need = smallest_world(model, batch, Options(), cluster, 8)
    assert need == 24 and search(model, batch, Options(), cluster, need)["recommended"] is not None


def test_plan_vs_published_is_current(tmp_path):
    """benchmarks/results/plan_vs_published.md is what the command writes now (the planner beside
    published runs; a few seconds, no search)."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location("plan_vs_published",
                                                  os.path.join(ROOT, "benchmarks", "plan_vs_published.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench              # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "plan_vs_published.md"
    bench.main(str(out))
    with open(os.path.join(ROOT, "benchmarks", "results", "plan_vs_published.md")) as f:
        assert out.read_text() == f.read(), \
            "benchmarks/results/plan_vs_published.md is stale: run python benchmarks/plan_vs_published.py"


def test_cli_reshard_and_checkpointing_flags(capsys):
    """--no-reshard-after-forward keeps each layer gathered from its forward into its backward (one
    gather per micro-batch, more memory); --no-gradient-checkpointing overrides a config's."""
    import json
    fsdp = os.path.join(ROOT, "configs", "fsdp.yaml")
    plans = []
    for flags in ([], ["--no-reshard-after-forward"], ["--gradient-checkpointing"],
                  ["--gradient-checkpointing", "--no-gradient-checkpointing"]):
        assert plan_main([fsdp, "--json"] + flags) == 0
        plans.append(json.loads(capsys.readouterr().out))
    base, kept, ac, no_ac = plans
    assert base["options"]["reshard_after_forward"] and not kept["options"]["reshard_after_forward"]
    gathers = [p["comm"]["dp_shard_cp"]["ops"]["all_gather"]["calls"] for p in (base, kept)]
    assert gathers[0] > gathers[1] and kept["memory"]["gathered"] > base["memory"]["gathered"]
    assert ac["options"]["gradient_checkpointing"] and not no_ac["options"]["gradient_checkpointing"]
