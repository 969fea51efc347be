"""compile: true (minipar/regional_compile.py) equals eager on every layout, compiles every graph in
the first step only, and breaks its graphs only at the collectives' boundaries.

Each case runs the same model, batches and layout twice, eagerly and compiled, and compares on
every rank: the first step's gradients (fp32, 1e-5) and a few steps' losses (1e-4). The backend is
aot_eager in the default suite (dynamo's tracing and AOT autograd's joint graph, run by the eager
kernels: the compiled path without inductor's C++ compile, which takes minutes on a 2-core CPU);
inductor itself in the slow tests. Default suite: one process and dp_shard 2, on a one-layer model.
"""
from __future__ import annotations

import pytest
import torch

import minipar
from minipar.api import prepare
from minipar.compose import LoRA
from minipar.config import ParallelismConfig
from models.llama_config import LlamaConfig
from tests.harness import run_world

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2)
MOE = dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
           router_aux_loss_coef=0.05)
B, T, STEPS = 4, 16, 4


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, TINY["vocab_size"], (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _train(sizes, model, settings, steps=STEPS):
    """On each rank: the first step's local gradients, the losses of `steps` steps, and the compile
    counters (graphs after step 1 and at the end, graph breaks)."""
    pgm = minipar.init(ParallelismConfig(**sizes))
    pm, optimizer, step = prepare(LlamaConfig(**model), pgm, learning_rate=3e-3, **settings)
    step.backward(*_batch(0))
    grads = {n: p.grad.clone() for n, p in pm.model.named_parameters() if p.grad is not None}
    optimizer.zero_grad()
    losses, graphs = [], []
    for i in range(steps):
        losses.append(float(step(*_batch(i))["loss"]))
        graphs.append(pm.compiled.graphs if pm.compiled else 0)
    stats = pm.compiled
    return dict(grads=grads, losses=losses, graphs=graphs,
                breaks=stats.graph_breaks if stats else 0, reasons=stats.break_reasons() if stats else [])


def _compare(n, sizes, model=TINY, backend="aot_eager", **settings):
    eager = run_world(_train, n, sizes, model, settings, timeout=300)
    compiled = run_world(_train, n, sizes, model, dict(settings, compile=True, compile_backend=backend),
                         timeout=600)
    for rank, (e, c) in enumerate(zip(eager, compiled)):
        assert e["grads"].keys() == c["grads"].keys()
        for name, g in e["grads"].items():
            torch.testing.assert_close(c["grads"][name], g, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")
        assert c["losses"] == pytest.approx(e["losses"], abs=1e-4, rel=1e-4)
        # every graph compiled in the first forward/backward; none after (step 2 on: flat)
        assert len(set(c["graphs"])) == 1, f"rank {rank} recompiled: graphs per step {c['graphs']}"
    return compiled


def test_one_process_compiled_equals_eager_without_graph_breaks():
    out = _compare(1, {})[0]
    assert out["graphs"][0] == 1 and out["breaks"] == 0, out["reasons"]


def test_dp_shard2_hooks_stay_outside_the_compiled_layer():
    """ZeRO-3's gather/free hooks are module hooks, the compiled region the layer's forward: no
    break, one graph, the same gradients (which the reduce-scatter hooks produced)."""
    out = _compare(2, dict(dp_shard_size=2))
    assert all(r["graphs"][0] == 1 and r["breaks"] == 0 for r in out), out[0]["reasons"]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,model,settings,graphs", [
    (dict(tp_size=2, sequence_parallel=True), TINY, {}, 10),
    (dict(cp_size=2, cp_impl="ring"), TINY, {}, None),
    (dict(cp_size=2, cp_impl="ulysses"), TINY, {}, None),
    (dict(pp_size=2), dict(TINY, num_hidden_layers=2), dict(micro_batches=2), None),
    (dict(dp_shard_size=2, ep_size=2), MOE, {}, None),
    ({}, TINY, dict(lora=LoRA(r=4, alpha=8.0)), None),
    ({}, TINY, dict(gradient_checkpointing="selective"), None),
    ({}, TINY, dict(gradient_checkpointing=True), None),
    (dict(tp_size=2), TINY, dict(gradient_checkpointing=True), None),
], ids=["tp2-sp", "cp2-ring", "cp2-ulysses", "pp2", "ep2-moe", "lora", "selective-ac", "full-ac",
        "tp2-full-ac"])
def test_layouts_compiled_equal_eager(sizes, model, settings, graphs):
    n = max(1, sizes.get("tp_size", 1) * sizes.get("cp_size", 1) * sizes.get("pp_size", 1)
            * sizes.get("dp_shard_size", 1))
    out = _compare(n, sizes, model, **settings)
    print("GRAPHS", [(r["graphs"][0], r["breaks"]) for r in out])
    assert graphs is None or all(r["graphs"][0] == graphs for r in out), [r["graphs"] for r in out]
