"""A mixture of experts on every layout and under every pipeline schedule against one process, in
fp64: the load-balancing loss's reductions (models/moe_aux.py: over cp, over tp under sequence
parallelism, the side vectors between pipeline stages), the token exchange and the experts' own
ZeRO-3 group (minipar/expert_parallel/, minipar/zero3/) and the pipeline executor
(minipar/pipeline_parallel/executor.py).

Each case trains a tiny decoder (4 experts, top-2, a router far from uniform, so routing is uneven)
for 3 SGD steps of G = dp x M micro-batches. After the first, every parameter's full gradient
(embeddings, attention, router, experts, gathered over the shards, tp, ep and the stages) equals
one process's to rtol 1e-9: a lost or doubled term of the aux loss, or a count summed over the
wrong group, misses by orders of magnitude, whatever router_aux_loss_coef is. Every step, the loss
(the aux loss in it) and the step's moe_aux_loss, moe_imbalance and moe_dropped (as the trainer
sums them: MoEStepMetrics of models/moe_metrics.py, or the pipeline's
`PipelineAux.step_metrics`) are one process's, and so are the weights after the last step. The
one-process twin runs the same G micro-batches one after the other, each weighted 1/G in the aux
loss, as the trainer does. Drops are compared where a rank's capacity is one process's (not under
cp or sequence parallelism: models/moe.py).

Default: pp 2 under each schedule (AFAB, 1F1B with drops, ZB-H1, and interleaved and ZB-V with
Qwen3-MoE's dense layers, so that some chunks, under ZB-V the last one too, have no MoE layer);
cp 2, and cp 2 x tp 2 with SP; ep 2 on dp_shard 2 with drops, and with a rank that no token
reaches; ep 2 with edp 2 on dp_shard 4 (with drops) and on dp_shard 2 x cp 2; ep 2 x tp 2, with
drops, and with SP; HSDP x ep 2 with drops; pp 2 x dp_shard 2 x ep 2. Slow: ep 2 on dp_shard 2
dropless, dp_shard 4 x ep 4.
"""
import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from harness import run_world

import minipar
from minipar import ParallelismConfig, comm, comm_ledger
from minipar import tensor_parallel as tpl
from minipar.batch_split import local_batch
from minipar.expert_parallel import ep_gather
from minipar.pipeline_parallel import ScheduleHooks, build_stage, run_schedule, schedule_order
from minipar.pipeline_parallel.stage import gather_over_stages
from minipar.zero3 import ShardedStateDicts, fully_shard
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig
from models.moe_metrics import MoEStepMetrics

B, T, STEPS, LR, COEF = 8, 16, 3, 0.5, 0.05
FAMILIES = {
    "mixtral": dict(model_type="mixtral"),
    # Qwen3-MoE with dense layers between: MoE layers 1 and 3
    "qwen3-sparse": dict(model_type="qwen3_moe", decoder_sparse_step=2),
    # MoE layers 1 and 2 only: under zbv both on rank 1, the first and last chunks without one
    "qwen3-middle": dict(model_type="qwen3_moe", mlp_only_layers=[0, 3]),
}


def _config(family, layers, capacity=None, top_k=2):
    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                       num_experts_per_tok=top_k, router_aux_loss_coef=COEF, moe_capacity_factor=capacity,
                       max_position_embeddings=64, **FAMILIES[family])


def _batch(step):
    g = torch.Generator().manual_seed(3 + step)
    ids = torch.randint(0, 256, (B, T), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _model(config, pgm):
    model = LlamaForCausalLM(config, pgm, seed=5).double()
    with torch.no_grad():                     # a router far from uniform: routing is uneven
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(40)
                if config.num_experts_per_tok == 1:
                    # top-1 over logits (a, -a, 0, 0): every token goes to expert 0 or 1, so the ep
                    # rank holding experts 2 and 3 receives no token at all, in every layer
                    p[1], p[2:] = -p[0], 0.0
    return model


def _full(model, pgm, grads=False):
    """{name: full tensor} of the weights or their gradients, gathered over everything."""
    if getattr(model, "zero3", None) is not None:
        full = ShardedStateDicts(model.zero3).full_from_shards([s.grad if grads else s.detach()
                                                                for s in model.zero3.shards])
    else:
        full = {n: ep_gather(tpl.gather_tensor(p.grad if grads else p.detach(), p.tp_split_dim, pgm.tp),
                             getattr(p, "ep_split_dim", None), pgm.ep).clone()
                for n, p in model.named_parameters()}
    return gather_over_stages({n: t.cpu() for n, t in full.items()}, pgm)


@torch.no_grad()
def _sgd(model):
    params = model.zero3.shards if getattr(model, "zero3", None) is not None else list(model.parameters())
    for p in params:
        p.sub_(LR * p.grad)
        p.grad = None


def _pipeline_step(model, pgm, micro, schedule, v):
    """One step's micro-batches through this rank's stage under `schedule`, as
    minipar/compose.py runs them: ZeRO-3 in no_sync until the last B (or W)."""
    order = schedule_order(schedule, pgm.pp.size, len(micro), pgm.pp.rank, v)
    with contextlib.ExitStack() as unsynced:
        if getattr(model, "zero3", None) is not None:
            unsynced.enter_context(model.zero3.no_sync())

        def before_backward(action, last):
            if last:
                unsynced.close()
        loss = run_schedule(model, order, pgm, micro, B * T, act_dtype=torch.float64,
                            hooks=ScheduleHooks(before_backward))
    for group in (pgm.dp_cp, pgm.pp):
        comm.all_reduce(loss, group)
    return loss.item(), model.pipeline_aux.step_metrics(loss.device, len(micro))


def _step(model, pgm, micro):
    """One step's micro-batches, as minipar/trainer/trainer.py runs them: ZeRO-3 in no_sync
    but for the last; each micro-batch's aux loss weighted 1/(dp x M)."""
    loss, moe = torch.zeros((), dtype=torch.float64), MoEStepMetrics(pgm, "cpu")
    for m, batch in enumerate(micro):
        sync = m == len(micro) - 1 or getattr(model, "zero3", None) is None
        with contextlib.nullcontext() if sync else model.zero3.no_sync():
            part = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                         num_items_in_batch=B * T, aux_weight=1.0 / (pgm.dp.size * len(micro)))
            part.backward()
        loss += part.detach()
        moe.add(model.moe_metrics)
    comm.all_reduce(loss, pgm.dp_cp)
    return loss.item(), moe.reduce()


def _reference(family, layers, capacity, top_k, groups):
    """One process, each step's G micro-batches in turn: the first step's gradients, each step's
    (loss, moe_aux_loss, imbalance, dropped), the counts of the first and last steps, the weights
    after the last."""
    torch.set_num_threads(1)
    ref = _model(_config(family, layers, capacity, top_k), None)
    out, rows = dict(steps=[], counts=[]), B // groups
    for step in range(STEPS):
        ids, labels = _batch(step)
        loss, aux, counts, dropped = 0.0, 0.0, 0, 0
        for g in range(groups):
            part = ref(ids[g * rows:(g + 1) * rows], labels=labels[g * rows:(g + 1) * rows],
                       num_items_in_batch=B * T, aux_weight=1.0 / groups)
            part.backward()
            metrics = ref.moe_metrics
            loss, aux = loss + part.item(), aux + metrics["aux_loss"].item() / groups
            counts, dropped = counts + metrics["counts"].double(), dropped + metrics["dropped"]
        imbalance = (counts.max(dim=1).values / counts.mean(dim=1)).tolist()
        out["steps"].append((loss, aux, imbalance, dropped))
        out["counts"].append(counts)
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in ref.named_parameters()}
        _sgd(ref)
    out["weights"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return out


def _case(sizes, family, capacity, top_k, schedule, micro_per_rank):
    """This rank's run: each step's (loss, moe_aux_loss, imbalance, dropped); on rank 0 the full
    first-step gradients and last weights; the ep exchanges of the first step; the layout."""
    torch.set_num_threads(1)
    pgm = minipar.init(ParallelismConfig(**sizes))
    v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
    config = _config(family, _layers(pgm.pp.size, v), capacity, top_k)
    model = _model(config, pgm)
    if pgm.pp.size > 1:
        model = build_stage(model, pgm, v, None, schedule)
    if pgm.dp_shard_cp.size > 1:
        fully_shard(model, pgm)
    M, rank0 = micro_per_rank, dist.get_rank() == 0
    out = dict(steps=[])
    for step in range(STEPS):
        ids, labels = _batch(step)
        micro = [local_batch(ids, labels, pgm, m, M) for m in range(M)]
        with comm_ledger.ledger() as led:
            if pgm.pp.size > 1:
                loss, moe = _pipeline_step(model, pgm, micro, schedule, v)
            else:
                loss, moe = _step(model, pgm, micro)
        out["steps"].append((loss, moe["moe_aux_loss"], moe["moe_imbalance"], moe["moe_dropped"]))
        if step == 0:
            grads = _full(model, pgm, grads=True)
            out["grads"] = grads if rank0 else None
            out["exchanges"] = (led.count("all_to_all", "ep"), led.count("all_to_all_uneven", "ep"))
        _sgd(model)
    weights = _full(model, pgm)
    out["weights"] = weights if rank0 else None
    out["layout"] = (pgm.ep.size, pgm.cp.size, pgm.tp.size, pgm.config.sequence_parallel, pgm.pp.size)
    return out


def _layers(pp, v):
    return max(2, pp * v)                       # a layer per virtual stage, at least 2


def _case_of(family="mixtral", capacity=None, top_k=2, schedule=None, micro=2, **sizes):
    """A layout (ParallelismConfig sizes), the model, the schedule (pp) and M micro-batches a dp rank."""
    sizes.setdefault("dp_shard_size", 1)
    return dict(sizes=sizes, family=family, capacity=capacity, top_k=top_k, schedule=schedule, micro=micro)


CASES = {
    # every schedule on pp 2 (4 micro-batches a step), with drops under 1F1B, and chunks without an
    # MoE layer (the first, and under zbv the last too) under interleaved and zbv
    "pp2-afab": _case_of(pp_size=2, schedule="afab", micro=4),
    "pp2-1f1b-capacity": _case_of(pp_size=2, schedule="1f1b", micro=4, capacity=1.0),
    "pp2-interleaved-dense-layers": _case_of(pp_size=2, schedule="interleaved_1f1b", micro=4,
                                             family="qwen3-sparse"),
    "pp2-zb_h1": _case_of(pp_size=2, schedule="zb_h1", micro=4),
    "pp2-zbv-dense-ends": _case_of(pp_size=2, schedule="zbv", micro=4, family="qwen3-middle"),
    "pp2-shard2-ep2": _case_of(pp_size=2, dp_shard_size=2, ep_size=2, schedule="1f1b"),
    # the aux loss's counts summed over cp, and over tp under SP too (ZeRO-3 over cp)
    "cp2": _case_of(cp_size=2),
    "cp2-tp2-sp": _case_of(cp_size=2, tp_size=2, sequence_parallel=True),
    # the experts split over ep, ZeRO-3-sharded over edp (a rank that receives no token: top-1
    # over two experts)
    "shard2-ep2-capacity": _case_of(dp_shard_size=2, ep_size=2, capacity=1.0),
    "shard2-ep2-a-rank-gets-no-token": _case_of(dp_shard_size=2, ep_size=2, top_k=1),
    "shard4-ep2-edp2-capacity": _case_of(dp_shard_size=4, ep_size=2, capacity=1.0, micro=1),
    "shard2-cp2-ep2-edp2": _case_of(dp_shard_size=2, cp_size=2, ep_size=2),
    "shard2-tp2-ep2-capacity": _case_of(dp_shard_size=2, tp_size=2, ep_size=2, capacity=1.0),
    "shard2-tp2-sp-ep2": _case_of(dp_shard_size=2, tp_size=2, sequence_parallel=True, ep_size=2),
    "hsdp-ep2-capacity": _case_of(dp_replicate_size=2, dp_shard_size=2, ep_size=2, capacity=1.0),
}
# dropless ep 2 alone (the fast cases hold it with cp, with tp + SP and with pp), and ep 4
SLOW = {"shard2-ep2": _case_of(dp_shard_size=2, ep_size=2),
        "shard4-ep4": _case_of(dp_shard_size=4, ep_size=4)}


_REF = {}


def _error(got, want):
    return ((got - want).abs().max() / want.abs().max().clamp(min=1e-300)).item()


def _differ(got, want):
    return [n for n in want if not torch.allclose(got[n], want[n], rtol=1e-9, atol=1e-12)]


@pytest.mark.parametrize("name", list(CASES) + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_gradients_and_steps_equal_one_process_fp64(name):
    case = {**CASES, **SLOW}[name]
    sizes, capacity, micro = case["sizes"], case["capacity"], case["micro"]
    size = {k: sizes.get(k, 1) for k in ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size",
                                         "pp_size", "ep_size")}
    world, pp = math.prod(size.values()) // size["ep_size"], size["pp_size"]     # ep borrows dp ranks
    v = 2 if case["schedule"] in ("interleaved_1f1b", "zbv") else 1
    key = (case["family"], _layers(pp, v), capacity, case["top_k"],
           size["dp_replicate_size"] * size["dp_shard_size"] * micro)                  # G = dp x M
    if key not in _REF:
        _REF[key] = run_world(_reference, 1, *key, timeout=120)[0]
    ref = _REF[key]
    results = run_world(_case, world, sizes, case["family"], capacity, case["top_k"], case["schedule"], micro,
                        timeout=240)
    grads, weights = results[0]["grads"], results[0]["weights"]
    assert set(grads) == set(ref["grads"]) and set(weights) == set(ref["weights"])
    errors = _differ(grads, ref["grads"])
    assert not errors, f"{name}: first-step gradients differ from one process (max error / max |g|): " + \
        ", ".join(f"{n} {_error(grads[n], ref['grads'][n]):.2g}" for n in errors)
    assert not _differ(weights, ref["weights"]), f"{name}: weights after {STEPS} steps differ"
    # the router moved: the steps route differently, so they compare something new
    assert not torch.equal(ref["counts"][0], ref["counts"][-1])
    moe_layers = ref["counts"][0].shape[0]
    for rank, r in enumerate(results):
        where = f"{name} rank {rank}"
        assert r["layout"] == (size["ep_size"], size["cp_size"], size["tp_size"],
                               sizes.get("sequence_parallel", False), pp), where
        drops_comparable = size["cp_size"] == 1 and not sizes.get("sequence_parallel")
        for step, (got, want) in enumerate(zip(r["steps"], ref["steps"]), 1):
            loss, aux, imbalance, dropped = got
            ref_loss, ref_aux, ref_imbalance, ref_dropped = want
            # the router's probabilities are fp32 (as transformers'), so the sums P_e of the aux
            # loss's value are fp32 sums, in another order on another layout (its gradient, C_e, is exact)
            assert abs(aux - ref_aux) <= 1e-6 * abs(ref_aux), (where, step, aux, ref_aux)
            assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss) + COEF * 1e-6 * abs(ref_aux), \
                (where, step, loss, ref_loss)
            assert imbalance == pytest.approx(ref_imbalance, abs=1e-6), (where, step, imbalance)
            assert len(imbalance) == moe_layers, where
            if drops_comparable:
                assert dropped == ref_dropped, (where, step, dropped, ref_dropped)
            assert (ref_dropped > 0) == (capacity is not None), (where, step, ref_dropped)
        if size["ep_size"] > 1 and pp == 1:  # per MoE layer and micro-batch: the counts once,
            # the tokens four times (dispatch, combine, and their backwards)
            n = moe_layers * micro
            assert r["exchanges"] == (n, 4 * n), (where, r["exchanges"])
    if case["top_k"] == 1:                      # experts 2 and 3 saw nothing in the first step
        assert ref["counts"][0][:, 2:].sum() == 0 and ref["counts"][0][:, :2].all()


def test_an_moe_config_without_an_moe_layer_sends_no_side_vector():
    # every layer in mlp_only_layers: no stage has routing counts to pool, and a side vector whose
    # loss divides by the number of MoE layers (zero) would make the pipeline's loss NaN
    dense = _config("qwen3-middle", 4)
    dense.mlp_only_layers = [0, 1, 2, 3]
    assert LlamaForCausalLM(dense, None, seed=0).pipeline_aux is None
    assert LlamaForCausalLM(_config("qwen3-middle", 4), None, seed=0).pipeline_aux is not None
