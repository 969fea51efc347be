"""The ladder (docs/ladder.md): every rung of every technique equals one process.

Each rung is a config value (ddp, fsdp.prefetch, fsdp.reshard_after_forward, sequence_parallel,
tp_async_overlap, cp_layout, cp_impl, pipeline_schedule); here each is run on a small gloo world,
in float64 so that the comparison is about the algorithm and not about the order of fp32 sums, and
compared with one process on the same global batches: losses, the gradients of the first step, and
the weights after a few AdamW steps. Rungs that change only the schedule must also send the same
bytes (the pipeline's: as many as their boundaries between ranks).
"""
import pytest
import torch
from harness import run_world
from tiny_llama import CFG, tiny_batch

import minipar
from minipar import ParallelismConfig, comm, comm_ledger
from minipar.batch_split import local_batch
from minipar.mesh import ProcessGroupManager
from minipar.optim import build_optimizer
from minipar.tensor_parallel import gather_tensor
from minipar.zero3 import ShardedStateDicts
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

STEPS = 3


def _grads(model):
    if getattr(model, "zero3", None) is not None:
        return ShardedStateDicts(model.zero3).full_from_shards([p.grad for p in model.zero3.shards])
    return {n: gather_tensor(p.grad, p.tp_split_dim, model.pgm.tp) for n, p in model.named_parameters()}


def _train(pgm, wrap=None, micro=1, layers=CFG["num_hidden_layers"]):
    """A few AdamW steps of the tiny Llama in float64 on this rank's share of each global batch
    (trainer/data/batches.py local_batch: dp rows, micro-batches, the cp layout's chunks)."""
    pgm = pgm or ProcessGroupManager.local()
    model = LlamaForCausalLM(LlamaConfig(**dict(CFG, num_hidden_layers=layers)), pgm, seed=0).double()
    if wrap is not None:
        wrap(model, pgm)
    sync = getattr(model, "grad_sync", None)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    losses, grads = [], None
    with comm_ledger.ledger() as led:
        for step in range(STEPS):
            ids, labels = tiny_batch(step)
            n = (labels != -100).sum()
            total = torch.zeros((), dtype=torch.float64)
            for m in range(micro):
                b = local_batch(ids, labels, pgm, m, micro)
                last = m == micro - 1
                with (sync.no_sync() if sync is not None and not last else _null()):
                    loss = model(b["input_ids"], position_ids=b["position_ids"], labels=b["labels"],
                                 num_items_in_batch=n)
                    loss.backward()
                total += loss.detach()
            if step == 0:
                grads = _grads(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(comm.all_reduce(total, pgm.dp_cp).item())
    wire = {}
    for r in led.records:
        calls, nbytes = wire.get((r.op, r.group), (0, 0))
        wire[(r.op, r.group)] = (calls + 1, nbytes + r.bytes)
    return dict(losses=losses, grads=grads, params=model.full_state_dict(), wire=wire)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_REF = {}


def _reference():
    if "ref" not in _REF:
        _REF["ref"] = _train(None)
    return _REF["ref"]


def _compare(got, want, tol=1e-10):
    assert got["losses"] == pytest.approx(want["losses"], rel=tol, abs=tol)
    for name, w in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], w, atol=tol, rtol=tol, msg=name)
    for name, w in want["params"].items():
        torch.testing.assert_close(got["params"][name], w, atol=tol, rtol=tol, msg=name)


def _world(config_kw, rungs):
    """Every rung of `rungs` (name -> wrap function) on one world of the layout config_kw."""
    pgm = minipar.init(ParallelismConfig(**config_kw))
    return {name: _train(pgm, wrap) for name, wrap in rungs.items()}


# ------------------------------------------------------------------------------------------ DP
def _ddp_rungs():
    from minipar.data_parallel import replicate, replicate_naive
    return {"naive": lambda m, pgm: replicate_naive(m, pgm.dp_cp),
            "bucketed": lambda m, pgm: replicate(m, pgm.dp_cp, bucket_size_mb=0.01)}


def _ddp_world():
    pgm = minipar.init(ParallelismConfig(dp_replicate_size=2))
    out = {name: _train(pgm, wrap) for name, wrap in _ddp_rungs().items()}
    out["naive-accumulate"] = _train(pgm, _ddp_rungs()["naive"], micro=2)
    return out


def test_ddp_naive_and_bucketed_equal_one_process():
    want = _reference()
    n_params = len(list(LlamaForCausalLM(LlamaConfig(**CFG), None).parameters()))
    for got in run_world(_ddp_world, 2, timeout=120):
        for rung in ("naive", "bucketed", "naive-accumulate"):
            _compare(got[rung], want)
        naive, bucketed = got["naive"]["wire"], got["bucketed"]["wire"]
        grads = ("all_reduce", "dp_cp")
        # the same gradient bytes; naive in one call per parameter, bucketed in fewer, larger ones
        assert naive[grads][1] == bucketed[grads][1]
        assert naive[grads][0] == STEPS * (n_params + 2)          # + the used flags, the logged loss
        assert bucketed[grads][0] < naive[grads][0]
        assert got["naive-accumulate"]["wire"][grads] == naive[grads]   # no_sync: one reduction per step


# -------------------------------------------------------------------------------------- ZeRO-3
ZERO3_RUNGS = {"prefetch0": dict(prefetch=0), "prefetch1": dict(prefetch=1), "prefetch2": dict(prefetch=2),
               "no-reshard": dict(prefetch=1, reshard_after_forward=False)}


def _zero3_world():
    from minipar.zero3 import fully_shard
    rungs = {name: (lambda m, pgm, kw=kw: fully_shard(m, pgm, **kw))
             for name, kw in ZERO3_RUNGS.items()}
    return _world(dict(dp_shard_size=2), rungs)


def test_zero3_prefetch_and_reshard_rungs_equal_one_process():
    want = _reference()
    for got in run_world(_zero3_world, 2, timeout=180):
        for rung in ZERO3_RUNGS:
            _compare(got[rung], want)
        # prefetching moves the gathers earlier; it gathers the same bytes
        gathers = {rung: got[rung]["wire"][("all_gather", "dp_shard_cp")][1]
                   for rung in ("prefetch0", "prefetch1", "prefetch2")}
        assert len(set(gathers.values())) == 1, gathers
        # reshard_after_forward=False keeps the units gathered for backward: fewer bytes gathered
        assert got["no-reshard"]["wire"][("all_gather", "dp_shard_cp")][1] < gathers["prefetch1"]


# ------------------------------------------------------------------------------------------ TP
TP_RUNGS = {"plain": dict(), "sp": dict(sequence_parallel=True), "async": dict(tp_async_overlap=True),
            "sp-async": dict(sequence_parallel=True, tp_async_overlap=True)}


def _tp_world():
    return {name: _train(minipar.init(ParallelismConfig(tp_size=2, **kw))) for name, kw in TP_RUNGS.items()}


def test_tp_rungs_equal_plain_tp_and_one_process():
    want = _reference()
    for got in run_world(_tp_world, 2, timeout=180):
        for rung in TP_RUNGS:
            _compare(got[rung], want)
            _compare(got[rung], got["plain"], tol=1e-12)
        # the async overlap reorders the backward, it sends exactly what its non-async twin sends
        assert got["async"]["wire"] == got["plain"]["wire"]
        sp, sp_async = got["sp"]["wire"], got["sp-async"]["wire"]
        assert {k: v for k, v in sp_async.items() if k[0] != "all_gather"} == \
            {k: v for k, v in sp.items() if k[0] != "all_gather"}
        # under SP the backward re-gathers the sequence-sharded input instead of keeping the full
        # one (Megatron's trade: bytes for activation memory): once per column-parallel region,
        # q/k/v and gate/up of each layer and the lm_head, per step
        regions = STEPS * (2 * CFG["num_hidden_layers"] + 1)
        extra = sp_async[("all_gather", "tp")][0] - sp[("all_gather", "tp")][0]
        assert extra == regions, (sp, sp_async)


def test_async_column_parallel_alone_equals_plain_layers():
    """The Function alone, with a bias and under autocast's dtype rules: outputs and gradients."""
    def world():
        from minipar import tensor_parallel as tpl
        from minipar.tensor_parallel import mappings as tp_mappings
        pgm = minipar.init(ParallelismConfig(tp_size=2))
        out = {}
        for sp in (False, True):
            torch.manual_seed(0)
            x = torch.randn(2, 8, 16, dtype=torch.float64)
            x = tp_mappings._split(x, 1, pgm.tp) if sp else x
            res = []
            for overlap in (False, True):
                torch.manual_seed(1)                 # the same weights for both
                a = tpl.ColumnParallelLinear(16, 12, pgm.tp, bias=True, sequence_parallel=sp,
                                             async_overlap=overlap)
                b = tpl.ColumnParallelLinear(16, 8, pgm.tp, sequence_parallel=sp, async_overlap=overlap)
                a.double(), b.double()
                xi = x.clone().requires_grad_(True)
                ya, yb = tpl.column_parallel_group(xi, (a, b))
                (ya.square().sum() + (yb * 3).sum()).backward()
                res.append([ya, yb, xi.grad, a.weight.grad, a.bias.grad, b.weight.grad])
            for plain, fused in zip(*res):
                torch.testing.assert_close(fused, plain, atol=1e-12, rtol=1e-12)
            out[sp] = True
        return out
    assert all(r == {False: True, True: True} for r in run_world(world, 2, timeout=120))


# ------------------------------------------------------------------------------------------ CP
def _cp_world():
    from minipar.data_parallel import replicate
    return {layout: _train(minipar.init(ParallelismConfig(cp_size=2, cp_layout=layout)),
                           lambda m, pgm: replicate(m, pgm.dp_cp)) for layout in ("contiguous", "zigzag")}


def test_cp_contiguous_and_zigzag_equal_one_process():
    want = _reference()
    for got in run_world(_cp_world, 2, timeout=180):
        for layout in ("contiguous", "zigzag"):
            _compare(got[layout], want)
        # the same ring, the same bytes: the layouts differ only in who computes how much
        assert got["contiguous"]["wire"] == got["zigzag"]["wire"]


CP_IMPL_RUNGS = {"ring": dict(cp_impl="ring"), "ulysses": dict(cp_impl="ulysses"),
                 "usp": dict(cp_impl="usp", cp_ulysses_size=2)}


def _cp_impl_world():
    from minipar.data_parallel import replicate
    return {name: _train(minipar.init(ParallelismConfig(cp_size=4, **kw)),
                         lambda m, pgm: replicate(m, pgm.dp_cp)) for name, kw in CP_IMPL_RUNGS.items()}


def test_cp_impl_ring_ulysses_and_usp_equal_one_process():
    """cp 4: the ring, Ulysses over the 4 ranks (the 2 KV heads repeated twice) and USP (Ulysses over
    2, the ring over 2) give one process's losses, gradients and weights; each moves what
    context_parallel/ulysses.py's docstring says, over its own groups."""
    want = _reference()
    hq, hkv = CFG["num_attention_heads"], CFG["num_key_value_heads"]
    d, L, B = CFG["hidden_size"] // hq, 8 // 4, 8                   # tiny_batch: B 8 x T 8, L = T / cp
    layers = STEPS * CFG["num_hidden_layers"]
    for got in run_world(_cp_impl_world, 4, timeout=240):
        for rung in CP_IMPL_RUNGS:
            _compare(got[rung], want)
        ring, uly, usp = (got[r]["wire"] for r in CP_IMPL_RUNGS)
        assert not [k for k in ring if k[0] == "all_to_all"] and ("send_recv", "cp") in ring
        assert not [k for k in uly if k[0] == "send_recv"]
        # q, k, v, out and dout, dq, dk, dv: 8 all-to-alls per layer and step, fp64; Ulysses over 4
        # repeats each KV head f = 4 / gcd(2, 4) = 2 times, USP's group of 2 needs none
        for wire, u, f in ((uly, 4, 2), (usp, 2, 1)):
            calls, nbytes = wire[("all_to_all", "cp_ulysses")]
            assert calls == 8 * layers and nbytes == layers * 4 * B * L * d * 8 * (hq + f * hkv), (u, wire)
        # USP's ring runs over the 2 groups: 1 hop instead of the cp ring's 3, the same bytes per hop
        assert usp[("send_recv", "cp_ring")][1] * 3 == ring[("send_recv", "cp")][1]


# ------------------------------------------------------------------------------------------ PP
PP_RUNGS = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")


def _pp_world():
    """pp 2, 4 layers (one per chunk under the 2-chunk schedules), 4 micro-batches of tiny_batch's
    8 rows: each schedule's losses, first gradients (gathered over the stages), weights, bytes."""
    from minipar.pipeline_parallel import build_stage, run_schedule, schedule_order
    from minipar.pipeline_parallel.stage import gather_over_stages
    pgm, m, out = minipar.init(ParallelismConfig(pp_size=2)), 4, {}
    for schedule in PP_RUNGS:
        v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
        model = LlamaForCausalLM(LlamaConfig(**dict(CFG, num_hidden_layers=4)), pgm, seed=0).double()
        stage = build_stage(model, pgm, v, None, schedule)
        opt = build_optimizer(stage, lr=1e-2, weight_decay=0.1)
        order = schedule_order(schedule, 2, m, pgm.pp.rank, v)
        losses, grads = [], None
        with comm_ledger.ledger() as led:
            for step in range(STEPS):
                ids, labels = tiny_batch(step)
                micro = [local_batch(ids, labels, pgm, i, m) for i in range(m)]
                loss = run_schedule(stage, order, pgm, micro, (labels != -100).sum(), act_dtype=torch.float64)
                if step == 0:
                    grads = gather_over_stages({n: p.grad.clone() for n, p in stage.named_parameters()}, pgm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(comm.all_reduce(loss, pgm.pp).item())
        out[schedule] = dict(losses=losses, grads=grads, params=stage.full_state_dict(),
                             sent=led.total_bytes("send"))
    return out


def test_pp_schedule_rungs_equal_one_process():
    """1F1B, interleaved, ZB-H1 and ZB-V on pp 2: one process's losses, gradients and weights; the
    zero-bubble ones send 1F1B's bytes (ZB-H1) or twice them (ZB-V's two crossings each way),
    interleaving three times (its ring of 3 boundaries)."""
    want = _train(None, layers=4)
    for got in run_world(_pp_world, 2, timeout=240):
        for rung in PP_RUNGS:
            _compare(got[rung], want)
        sent = {rung: got[rung]["sent"] for rung in PP_RUNGS}
        assert sent["zb_h1"] == sent["1f1b"] > 0 and sent["zbv"] == 2 * sent["1f1b"]
        assert sent["interleaved_1f1b"] == 3 * sent["1f1b"]


def test_bad_rung_values_are_clear_errors():
    with pytest.raises(ValueError, match="cp_layout"):
        ParallelismConfig(cp_layout="striped")
    from minipar.trainer.config.train_config import load_config
    with pytest.raises(ValueError, match="ddp must be naive or bucketed"):
        load_config(None, ["--ddp", "fast"])
    with pytest.raises(ValueError, match="cp_layout"):
        load_config(None, ["--cp_layout", "striped"])


# ------------------------------------------------------------------------- through train.py's keys
def _trainer_run(argv):
    from minipar.data_parallel import NaiveGradSync
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    c = trainer.pgm.config
    wiring = dict(naive=isinstance(trainer.grad_sync, NaiveGradSync), layout=c.cp_layout,
                  overlap=trainer.model.model.layers[0].self_attn.q_proj.async_overlap)
    return wiring, [r["loss"] for r in trainer.train()]


@pytest.mark.slow            # the fast twins: the rung tests above, on the same code paths
def test_rung_keys_reach_the_trainer(tmp_path):
    """ddp and tp_async_overlap on dp_replicate 2 x tp 2, cp_layout on cp 2 x tp 2 (SP on both), from
    the command line: each reaches the trainer, and each run's loss curve is one process's. (cp_layout
    gets its own run: with cp > 1 the cp ranks share ZeRO-3's shards, so there is no DDP to choose.)"""
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [os.path.join(root, "configs", "ddp.yaml"), "--dp_replicate_size", "1",
            "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_hidden_layers", "1",
            "--model.num_attention_heads", "4",
            "--model.num_key_value_heads", "2", "--sequence_len", "16", "--global_batch_size", "4",
            "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
            "--max_steps", "3", "--eval_steps", "0", "--logging_steps", "100", "--progress_bar", "false",
            "--save_final_checkpoint", "false", "--export_hf", "false", "--output_dir", str(tmp_path)]
    _, want = run_world(_trainer_run, 1, argv, timeout=120)[0]
    tp = ["--tensor_parallel_size", "2", "--sequence_parallel", "true"]
    for rungs, wired in ((["--dp_replicate_size", "2", "--ddp", "naive", "--tp_async_overlap", "true"],
                          dict(naive=True, overlap=True)),
                         (["--context_parallel_size", "2", "--cp_layout", "contiguous"],
                          dict(naive=False, layout="contiguous"))):
        for wiring, got in run_world(_trainer_run, 4, argv + tp + rungs, timeout=180):
            assert {k: wiring[k] for k in wired} == wired
            assert got == pytest.approx(want, rel=1e-5)
