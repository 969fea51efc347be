"""The planner on mixtures of experts (minipar/plan/moe.py) against a real run of configs/moe.yaml.

One optimizer step of dp_shard 4 x ep 2 (and two variants) on 4 forked gloo ranks (the tiny model
of tests/test_plan.py, Mixtral-shaped: 8 experts, top-2), compared per rank with the plan:
  - persistent state and the peak of gathered ZeRO-3 buffers (the experts' units over edp), EXACTLY;
  - the ledger per (op, group), EXACTLY, but for the token exchange ("all_to_all_uneven", "ep"), whose
    bytes depend on the routing: its calls exactly, its bytes summed over the ranks exactly (every
    copy sent is received once, so the balanced plan is the mean) and each rank's within 25 %;
  - activations EXACTLY on every rank, planned for the routing the rank observed (`_routed`): the
    experts' rows and the regroup's indices are M on a rank, which moves with the routing, so a rank
    keeps the balanced plan plus (M - N) x minipar/plan/moe.py's received_row_bytes per MoE layer;
    and their mean over the ranks EXACTLY the balanced plan's: summed over an ep group the M are
    N each (as the exchange's bytes).
And an MoE without ZeRO-3 in bf16 (autocast: the experts' and the router's bf16 weight casts, the
fp32 stream), ep 1, held as tests/test_plan.py holds the dense configs, its activations exactly
on every rank given the routing: the plan counts every expert's three bf16 weight casts, and an
expert that no row reaches runs no matmul (models/moe.py) and casts none, 3 e F d less (at 32
tokens some expert of a layer gets no row: measured, rank 0 keeps 96 KiB less, its layer 1's
experts 0 and 6 uncast, 6 casts of 16 KiB). With ep 1 every M is N, so there the plan is an
upper bound, short of it by the unreached experts' casts alone.
"""
import dataclasses
import functools

import pytest
from harness import run_world
from test_plan import _argv, _measure_all
from test_plan import _check as _check_dense

from minipar.plan import activations, collectives, memory
from minipar.plan.__main__ import main as plan_main
from minipar.plan.activation_bytes import stream_bytes
from minipar.plan.estimate import Cluster, plan
from minipar.plan.feasible import check
from minipar.plan.inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options
from minipar.plan.moe import copies, crosses_nodes, expert_cast_bytes, moe_layers, received_row_bytes
from minipar.trainer.prediction import from_train_config

MIXTRAL_8X7B = dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    num_local_experts=8, num_experts_per_tok=2)
TOKEN_EXCHANGE = ("all_to_all_uneven", "ep")


# beyond moe.yaml: tp 2 with SP and checkpointing (no f / g around the experts, their gradients
# summed over tp, the recomputed exchanges), HSDP in bf16 (the experts' shards over dp_replicate), and
# cp 2 (ep borrows a cp rank: the ep and edp groups cut dp_shard_cp; the aux loss summed over cp), and
# Qwen3-MoE's layout under plain tp (its q / k norms' gradients summed over tp; edp of 1 shards nothing)
VARIANTS = [[], ["--tensor_parallel_size", "2", "--dp_shard_size", "2", "--sequence_parallel", "true",
                 "--gradient_checkpointing", "true"],
            ["--dp_replicate_size", "2", "--dp_shard_size", "2", "--dtype", "bfloat16"],
            ["--dp_shard_size", "2", "--context_parallel_size", "2"],
            ["--model.model_type", "qwen3_moe", "--tensor_parallel_size", "2", "--dp_shard_size", "2"]]
# without ZeRO-3 (ep 1, which needs no dp_shard): Qwen3-MoE on DDP 2 x tp 2 in bf16, under autocast
AUTOCAST = ["--expert_parallel_size", "1", "--dp_shard_size", "1", "--dp_replicate_size", "2",
            "--tensor_parallel_size", "2", "--dtype", "bfloat16", "--model.model_type", "qwen3_moe"]
# every variant's activations are checked (Qwen3-MoE's too, since the plan counts index_add_'s saved
# source and the router's own n / T tokens under SP)
NO_ACTIVATIONS = set()


def test_plan_moe_matches_runs(tmp_path):
    argvs = [_argv("moe.yaml", tmp_path / str(i), "--micro_batch_size", "1", *v)
             for i, v in enumerate(VARIANTS + [AUTOCAST])]
    per_rank = run_world(_measure_all, 4, argvs, timeout=900)
    for i in range(len(VARIANTS)):
        _check([r[i] for r in per_rank], i not in NO_ACTIVATIONS)
    # AUTOCAST's activations: every rank's exactly, given its routing; under ep 1 (M = N) an upper bound
    r0 = per_rank[0][-1]
    routed = functools.partial(_routed, *from_train_config(r0["cfg"]), _layout(r0))
    _check_dense(r0, [r[-1] for r in per_rank], routed)
    assert all(routed(r[-1], *key) <= 0 for r in per_rank for key in r[-1]["acts"])


def _layout(r0) -> Layout:
    lc = r0["layout"]
    return Layout(lc.dp_replicate_size, lc.dp_shard_size, lc.cp_size, lc.tp_size, lc.sequence_parallel,
                  lc.cp_impl, lc.cp_ulysses_size, ep=lc.ep_size or 1)


def _routed(model, sizes, batch, opts, layout, r, checkpointing, seq) -> int:
    """Rank r's planned activations less the balanced plan's, for the routing it observed (r["routing"]:
    the rows each MoE layer's local experts received): (M - N) received_row_bytes per layer, and under
    autocast less an unreached expert's weight casts for each local expert that got no row (all
    without a row: the model runs expert 0 on zero rows, which casts its weights). A checkpointed
    layer keeps only its input: no part of it moves with the routing."""
    if checkpointing:
        return 0
    runs = r["routing"][(checkpointing, seq)]
    assert len(runs) == moe_layers(model), (len(runs), moe_layers(model))    # one forward, each MoE layer
    e, pe = DTYPE_BYTES[opts.dtype], stream_bytes(layout, opts)
    N = copies(model, layout, dataclasses.replace(batch, sequence_len=seq))
    out = sum(sum(rows) - N for rows in runs) * received_row_bytes(model, layout, e, pe)
    if pe != e:                                                     # autocast
        unreached = sum(min(rows.count(0), len(rows) - 1) for rows in runs)
        out -= unreached * expert_cast_bytes(model, e)
    return out


def _check(results, check_activations=True):
    model, sizes, batch, opts = from_train_config(results[0]["cfg"])
    layout = _layout(results[0])
    assert model.is_moe and sizes["ep"] == layout.ep == 2
    mem, coll = memory(model, layout, opts), collectives(model, layout, batch, opts)
    want = {k: list(v) for k, v in coll.items()}
    exchanged = 0
    for rank, r in enumerate(results):
        got = r["state"]
        assert (got["params"], got["grads"], got["optimizer"], got["gathered"]) == \
            (mem["params"], mem["grads"], mem["optimizer"], mem["gathered"]), f"rank {rank}: {got} vs {mem}"
        ledger = dict(r["ledger"])
        calls, nbytes = ledger.pop(TOKEN_EXCHANGE)
        assert calls == want[TOKEN_EXCHANGE][0]
        assert abs(nbytes - want[TOKEN_EXCHANGE][1]) <= 0.25 * want[TOKEN_EXCHANGE][1], (rank, nbytes)
        exchanged += nbytes
        rest = {k: v for k, v in want.items() if k != TOKEN_EXCHANGE}
        assert ledger == rest, f"rank {rank}: ledger {sorted(ledger.items())}\nplanned {sorted(rest.items())}"
    assert exchanged == len(results) * want[TOKEN_EXCHANGE][1]    # exact in each ep group
    for (checkpointing, seq) in results[0]["acts"] if check_activations else ():
        act = activations(model, layout, dataclasses.replace(batch, sequence_len=seq), opts)
        planned = act["checkpointed" if checkpointing else "full"]
        every = [r["acts"][(checkpointing, seq)] for r in results]
        routed = [_routed(model, sizes, batch, opts, layout, r, checkpointing, seq) for r in results]
        # each rank exactly, for the rows its experts received
        assert every == [planned + x for x in routed], (checkpointing, seq, planned, routed, every)
        assert len(results) * planned == sum(every), (checkpointing, seq, planned, every)  # balanced over ep


def test_mixtral_8x7b_parameters_and_placement():
    """Mixtral 8x7B: 46.7 B parameters, 12.9 B active (Mistral's figures); on 16 GPUs of 8 per node,
    ep 8 stays inside a node while its edp group (every 8th rank) crosses."""
    model = ModelShape.from_dict(MIXTRAL_8X7B)
    layout = Layout(dp_shard=16, ep=8)
    p = plan(model, layout, Batch(16, 1, 4096), Options(), Cluster())
    assert round(p["moe"]["total_params"] / 1e9, 1) == 46.7
    assert round(p["moe"]["active_params"] / 1e9, 1) == 12.9
    assert p["comm"]["ep"]["crosses_nodes"] is False and p["comm"]["edp"]["crosses_nodes"] is True
    assert crosses_nodes(Layout(dp_shard=16, ep=16), 8)["ep"] is True
    assert p["time"]["moe_s"] > 0
    # top-2 experts as wide as the dense MLP time_model.py priced: about one more MLP's matmuls a layer
    assert 0 < p["time"]["moe_matmul_s"] < p["time"]["compute_s"]
    # balanced token exchange: 4 calls a layer, n k d e bytes each (bf16, 4096 tokens, top-2)
    calls, nbytes = p["comm"]["ep"]["ops"]["all_to_all_uneven"]["calls"], \
        p["comm"]["ep"]["ops"]["all_to_all_uneven"]["bytes"]
    assert (calls, nbytes) == (4 * 32, 4 * 32 * 4096 * 2 * 4096 * 2)


def test_moe_layouts_refused_by_name(capsys):
    model = ModelShape.from_dict(MIXTRAL_8X7B)
    problems = check(model, Layout(dp_shard=4, ep=3), Batch(4, 1, 128))
    assert any("expert_parallel_size=3" in p for p in problems)
    assert any("does not divide the 8 experts" in p for p in problems)
    dense = dict(MIXTRAL_8X7B, model_type="qwen3_moe", num_experts=8, mlp_only_layers=[0])
    problems = check(ModelShape.from_dict(dense), Layout(), Batch(1, 1, 128))
    assert any("dense layers [0]" in p for p in problems)
    assert plan_main(["configs/moe.yaml", "--search"]) == 2
    assert "--search" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["configs/moe.yaml"], ["configs/moe.yaml", "--ep", "4", "--json"]])
def test_report_prints_the_moe_lines(flags, capsys):
    assert plan_main(flags) == 0
    out = capsys.readouterr().out
    assert ("active per token" in out and "ep 2" in out) if "--json" not in flags else '"ep": 4' in out
