"""minipar's tensor parallelism against torch's DTensor tensor parallelism, same model, same run.

    python benchmarks/bench_tp.py [--hidden 256] [--layers 4] [--seq 256] [--batch 4] [--rounds 4]

Two forked gloo ranks (tests/harness.py), one torch thread each, tp = 2. Every variant is the same
Llama (minipar's LlamaForCausalLM, initialised from one seed) trained with AdamW on the same
batches:

    minipar TP        ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding + vocab-parallel loss
    minipar TP + SP   the same, sequence_parallel=True
    DTensor TP        the plain model, its q/k/v/gate/up wrapped by ColwiseParallel, o/down by
                      RowwiseParallel, embedding RowwiseParallel, lm_head ColwiseParallel(Shard(-1))
                      + loss_parallel(): torch.distributed.tensor.parallel.parallelize_module
    DTensor TP + SP   torchtitan's plan: SequenceParallel norms, PrepareModuleInput all-gathers
    1 process         the plain model on one rank (the other waits): the speed-up baseline

A step is zero_grad + forward + backward + AdamW; its time is the slowest rank's; variants are
interleaved round by round so machine noise hits them alike; the best and the median step are
reported, and the ratios use the best (on a shared machine it is the least disturbed).

Communication per step, from minipar's ledger, against theory (N = batch x seq tokens, h = hidden,
L = layers, fp32 so 4 bytes an element; "act" = an all-reduce/gather/scatter of N x h):

    without SP  forward   2L + 1 all-reduces of act   (o_proj, down_proj per block; the embedding)
                          2 all-reduces of N and 2N   (the loss: max; sum of exp + target logit)
                backward  2L + 1 all-reduces of act   (f before q/k/v and gate/up per block; lm_head)
    with SP     the same act bytes as 2L + 1 reduce-scatters + 2L + 1 all-gathers each way,
                + 2L + 1 all-reduces of h in backward (the norm weights, each seeing a sequence shard)

An all-reduce puts 2(n-1)/n of its buffer on the wire, a reduce-scatter or all-gather (n-1)/n, so
the two schemes move the same bytes. DTensor's collectives are counted with CommDebugMode (which
also counts minipar's, as a cross-check of the ledger).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import minipar  # noqa: E402
from minipar import ParallelismConfig, comm  # noqa: E402
from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from harness import run_world  # noqa: E402

try:                                               # torch >= 2.5; 2.4 keeps DTensor in a private module
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode
except ImportError:                                # pragma: no cover
    from torch.distributed._tensor import Replicate, Shard
    from torch.distributed._tensor.debug import CommDebugMode
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module)

VARIANTS = ["1 process", "minipar TP", "DTensor TP", "minipar TP + SP", "DTensor TP + SP"]


class Linear(nn.Linear):
    """nn.Linear (so DTensor's styles accept it) that ignores minipar's skip_input_comm keyword."""

    def forward(self, x, skip_input_comm=False):
        return super().forward(x)


def plain_model(cfg):
    """minipar's decoder built for one process, its parallel layers swapped for nn.Linear/nn.Embedding
    with the same weights: the model DTensor parallelizes."""
    model = LlamaForCausalLM(cfg, None, seed=0)

    def linear(old):
        new = Linear(old.in_features, old.out_features, bias=False)
        new.weight = old.weight
        return new
    for layer in model.model.layers:
        for mod, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                           (layer.mlp, ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                setattr(mod, n, linear(getattr(mod, n)))
    emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    emb.weight = model.model.embed_tokens.weight
    model.model.embed_tokens, model.lm_head = emb, linear(model.lm_head)
    return model


def dtensor_model(cfg, mesh, sp):
    model = plain_model(cfg)
    if not sp:     # the plain plan: each Colwise layer takes a replicated input, each Rowwise gives one
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    else:          # torchtitan's: norms on sequence shards, one all-gather before attention and the MLP
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                           use_local_output=False)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + n] = ColwiseParallel()
        for n in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + n] = RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()
        if sp:
            plan[p + "input_layernorm"] = SequenceParallel()
            plan[p + "post_attention_layernorm"] = SequenceParallel()
            plan[p + "self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                       desired_input_layouts=(Replicate(), None, None))
            plan[p + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                 desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, plan)
    for layer in model.model.layers:     # the attention code reshapes by its local head counts
        layer.self_attn.local_heads //= mesh.size()
        layer.self_attn.local_kv_heads //= mesh.size()
    return model


def _batch(args, step):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=g))


def _minipar_loss(model, ids, labels, between=None):
    loss = model(ids, labels=labels)
    if between:
        between()
    loss.backward()
    return loss.detach()


def _dtensor_loss(model, ids, labels, between=None):
    logits = model(ids)                              # (b, s, V) DTensor, sharded on the vocabulary
    with loss_parallel():                            # backward too must run inside
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if between:
            between()
        loss.backward()
    return loss.full_tensor().detach() if hasattr(loss, "full_tensor") else loss.detach()


def _world(args):
    warnings.filterwarnings("ignore")
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads)
    pgm = minipar.init(ParallelismConfig(tp_size=2))
    pgm_sp = minipar.init(ParallelismConfig(tp_size=2, sequence_parallel=True))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    tp, rank = pgm.tp, pgm.tp.rank
    runs = {"minipar TP": (LlamaForCausalLM(cfg, pgm, seed=0), _minipar_loss),
            "minipar TP + SP": (LlamaForCausalLM(cfg, pgm_sp, seed=0), _minipar_loss),
            "DTensor TP": (dtensor_model(cfg, mesh, sp=False), _dtensor_loss),
            "DTensor TP + SP": (dtensor_model(cfg, mesh, sp=True), _dtensor_loss)}
    if rank == 0:
        runs["1 process"] = (LlamaForCausalLM(cfg, None, seed=0), _minipar_loss)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, (m, _) in runs.items()}
    times = {k: [] for k in VARIANTS}
    cpus = {k: [] for k in VARIANTS}
    losses = {k: [] for k in VARIANTS}
    flag = torch.zeros(1)

    def step(name):
        model, loss_fn = runs[name]
        ids, labels = _batch(args, len(losses[name]))
        opts[name].zero_grad(set_to_none=True)
        loss = loss_fn(model, ids, labels)
        opts[name].step()
        losses[name].append(loss.item())

    for rnd in range(args.rounds + 1):               # round 0 warms up every variant
        for name in VARIANTS:
            for _ in range(args.steps):
                comm.all_reduce(flag, tp)            # a barrier: both ranks start the step together
                t0, c0 = time.perf_counter(), time.process_time()
                if name in runs:
                    step(name)
                elapsed = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
                comm.all_reduce(elapsed, tp, op="max")
                if rnd:
                    times[name].append(elapsed[0].item())
                    cpus[name].append(elapsed[1].item())

    # one more step of each tp variant, counted by minipar's ledger (forward | backward) and CommDebugMode
    counted = {}
    for name in VARIANTS[1:]:
        model, loss_fn = runs[name]
        ids, labels = _batch(args, 10_000)
        opts[name].zero_grad(set_to_none=True)
        with CommDebugMode() as cdm, comm.ledger() as led:
            loss_fn(model, ids, labels, between=lambda: comm.mark("backward"))
            opts[name].step()     # DTensor reduces the norm weights' Partial grads only here
        cut = led.events.index("backward")
        fwd, bwd = comm.Ledger(led.events[:cut]).records, comm.Ledger(led.events[cut + 1:]).records
        counted[name] = dict(fwd=[(r.op, r.numel, r.bytes, r.wire_bytes) for r in fwd],
                             bwd=[(r.op, r.numel, r.bytes, r.wire_bytes) for r in bwd],
                             cdm={str(k): v for k, v in cdm.get_comm_counts().items()})
    return dict(times=times, cpus=cpus, losses=losses, counted=counted)


def theory(args, sp):
    """{(phase, op, elements per call): calls} as the module docstrings derive it."""
    L, N, h = args.layers, args.batch * args.seq, args.hidden
    out = {("fwd", "all_reduce", N): 1, ("fwd", "all_reduce", 2 * N): 1}        # the loss
    if not sp:
        out[("fwd", "all_reduce", N * h)] = 2 * L + 1
        out[("bwd", "all_reduce", N * h)] = 2 * L + 1
    else:
        for phase in ("fwd", "bwd"):
            out[(phase, "reduce_scatter", N * h)] = 2 * L + 1
            out[(phase, "all_gather", N * h)] = 2 * L + 1
        out[("bwd", "all_reduce", h)] = 2 * L + 1
    return out


def _group(records, phase):
    out = {}
    for op, numel, nbytes, wire in records:
        calls, b, w = out.get((phase, op, numel), (0, 0, 0.0))
        out[(phase, op, numel)] = (calls + 1, b + nbytes, w + wire)
    return out


def report(args, res):
    mib = 1 / 2 ** 20
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    best = {k: min(v) for k, v in res["times"].items()}
    cpu = {k: min(v) for k, v in res["cpus"].items()}
    first = res["losses"]["minipar TP"]
    lines = ["# Tensor parallelism benchmark (bench_tp.py)", "",
             f"Llama: hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
             f"{args.heads} heads ({args.kv_heads} KV), vocab {args.vocab}; "
             f"batch {args.batch} x seq {args.seq}; "
             f"fp32, AdamW. tp = 2 on 2 forked gloo ranks, 1 torch thread each, {os.cpu_count()} CPU cores, "
             f"torch {torch.__version__}. "
             f"A step = zero_grad + forward + backward + optimizer step, timed on its slowest rank, over "
             f"{args.rounds} interleaved rounds x {args.steps} steps after a warm-up round; the ratios use "
             "the best step (the least disturbed by other processes: load average "
             f"{os.getloadavg()[0]:.1f} at the end). CPU ms: process time of the busier rank, best step. "
             "Every variant trains the same weights on the same batches, so their losses must agree.", "",
             "| variant | best step ms | median step ms | CPU ms | speed-up vs 1 process | minipar / DTensor "
             f"time | loss step 1 | loss step {len(first)} | max loss diff vs minipar TP |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in VARIANTS:
        ratio = {"minipar TP": best["minipar TP"] / best["DTensor TP"],
                 "minipar TP + SP": best["minipar TP + SP"] / best["DTensor TP + SP"]}.get(name)
        ls = res["losses"][name]
        diff = max(abs(a - b) for a, b in zip(ls, first))
        lines.append(f"| {name} | {best[name] * 1e3:.0f} | {med[name] * 1e3:.0f} | {cpu[name] * 1e3:.0f} | "
                     f"{best['1 process'] / best[name]:.2f}x | "
                     f"{f'{ratio:.2f}' if ratio else '-'} | {ls[0]:.6f} | {ls[-1]:.6f} | {diff:.1e} |")
    for sp in (False, True):
        name = "minipar TP + SP" if sp else "minipar TP"
        c = res["counted"][name]
        meas = {**_group(c["fwd"], "fwd"), **_group(c["bwd"], "bwd")}
        want = theory(args, sp)
        lines += ["", f"## {name}: communication per step over tp (ledger vs theory)", "",
                  "| phase | collective | elements per call | calls (theory) | MiB, full buffers (theory) | "
                  "MiB sent per rank |", "|---|---|---|---|---|---|"]
        for key in sorted(set(meas) | set(want), key=lambda k: (k[0] != "fwd", k[1], -k[2])):
            calls, nbytes, wire = meas.get(key, (0, 0, 0.0))
            n_want = want.get(key, 0)
            ok = "=" if (calls, nbytes) == (n_want, n_want * key[2] * 4) else "!="
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {calls} {ok} ({n_want}) | "
                         f"{nbytes * mib:.3f} {ok} ({n_want * key[2] * 4 * mib:.3f}) | {wire * mib:.3f} |")
        total = sum(v[2] for v in meas.values())
        lines.append(f"| all | | | {sum(v[0] for v in meas.values())} | | {total * mib:.3f} |")
    L = args.layers
    ar, ag, rs = "all_reduce", "all_gather", "reduce_scatter"
    expect = {  # what each plan should issue; DTensor's derived from its styles, see the notes below
        "minipar TP": {ar: 4 * L + 4},
        "DTensor TP": {ar: (2 * L + 1) + 3 + (5 * L + 1)},
        "minipar TP + SP": {ag: 4 * L + 2, rs: 4 * L + 2, ar: 2 + 2 * L + 1},
        "DTensor TP + SP": {ag: 4 * L + 2, rs: 4 * L + 2, ar: 3 + 3 * (2 * L + 1)}}
    lines += ["", "## Collectives per step (forward + backward + optimizer), counted by CommDebugMode", "",
              "| variant | collectives (expected) | minipar ledger |", "|---|---|---|"]
    for name in VARIANTS[1:]:
        c = res["counted"][name]
        counts = {}
        for op, v in c["cdm"].items():    # c10d names differ by torch release: keep the kind
            kind = ag if "gather" in op else rs if "scatter" in op else ar if "reduce" in op else op
            counts[kind] = counts.get(kind, 0) + v
        got = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        ok = "=" if counts == expect[name] else "!="
        want = ", ".join(f"{k}: {v}" for k, v in sorted(expect[name].items()))
        ledger = str(len(c["fwd"]) + len(c["bwd"])) if name.startswith("minipar") else "-"
        lines.append(f"| {name} | {got} {ok} ({want}) | {ledger} |")
    lines += ["", "Notes. DTensor TP (the plain plan): each ColwiseParallel layer turns its own input "
              "gradient into a replicated one, so the backward all-reduces 5 activations per block "
              "(q, k, v, gate, up) "
              "+ the lm_head's, where minipar reduces once per shared input (enter_tp_region: 2 per block); "
              "forward: the embedding, 2 per block, 3 for loss_parallel. DTensor TP + SP (torchtitan's plan) "
              "gathers once per shared input like minipar; its norm weights keep Partial gradients, which "
              "AdamW's step reduces 3 times each (minipar: once, in backward, of h numbers)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_tp.md"))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    res = run_world(_world, 2, args, timeout=900)[0]
    text = report(args, res)
    print(text)
    print(f"(ran in {time.perf_counter() - t0:.0f} s)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
