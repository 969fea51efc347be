"""Multi-rank techniques on one device, ranks as threads (thread_world.py): the device check's
ring-attention and ZeRO-3 steps, each against its single-process twin on the same device.

    ring_step(device)    cp 2 and 4, zigzag, causal, plain and packed documents (a document of one
                         token, documents crossing the cp shards): ring_attention's output and
                         dq/dk/dv against one process's attention over the whole sequence, in the
                         compute dtype (bf16 on CUDA) and in fp32 (the math of the merge)
    zero3_step(device)   dp_shard 2, the tiny Llama's decoder layers as units, prefetch 1: 3 steps
                         of AdamW; the losses and the first step's gradients against one process,
                         and the all-gathers / reduce-scatters each step issued (ledger) against
                         the units' count (one gather per unit in forward, one in backward for the
                         resharded ones, one reduce-scatter per unit)

Each returns a dict of rows {"name", "ok", "max_err", "tol", ...} for the device check's table.
The tolerances: fp32 1e-5 relative to the reference's largest value (sums reordered by the
merge), bf16 2e-2 (8 bits of mantissa: one rounding of an O(1) value is 4e-3, the ring merges
and the reference's rounding can add a few).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import minipar  # noqa: E402
from benchmarks.thread_world import run_threads  # noqa: E402
from minipar import ParallelismConfig, comm, comm_ledger  # noqa: E402
from minipar.context_parallel.block_kernel import BlockKernel  # noqa: E402
from minipar.context_parallel.layouts import zigzag_shard  # noqa: E402
from minipar.context_parallel.ring_attention import ring_attention  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def _documents(seq: int, cp: int) -> torch.Tensor:
    """(1, seq) ids: a one-token document, then documents whose ends fall inside the shards
    (the zigzag chunks are seq / 2cp long, so a length that is not a multiple crosses them)."""
    lengths, total = [1], 1
    step = max(3, seq // (2 * cp) + 3)
    while total < seq:
        lengths.append(min(step, seq - total))
        total += lengths[-1]
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def _reference(q, k, v, docs):
    """Attention over the whole sequence in fp32 (the math path), causal and within documents."""
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if docs is not None:
        d = docs.to(q.device)
        mask = mask & (d[0, :, None] == d[0, None, :])
    rep = q.shape[1] // k.shape[1]
    kk, vv = (x.repeat_interleave(rep, dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)


def _ring_rank(cp, q, k, v, docs, dtype):
    pgm = minipar.init(ParallelismConfig(cp_size=cp))
    local = [zigzag_shard(x.detach(), 2, pgm.cp).to(dtype).requires_grad_() for x in (q, k, v)]
    ids = None if docs is None else zigzag_shard(docs, 1, pgm.cp).to(q.device)
    out = ring_attention(*local, pgm.cp, BlockKernel(documents=ids))
    out.float().pow(2).sum().backward()      # a loss that weighs every output element differently
    return [out.detach().float()] + [x.grad.float() for x in local], pgm.cp


def ring_step(device: torch.device, small: bool = False) -> dict:
    b, hq, hkv, seq, d = (1, 4, 2, 64, 16) if small else (2, 16, 4, 4096, 128)
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    rows = []
    for cp in (2, 4):
        for packed in (False, True):
            g = torch.Generator().manual_seed(cp)
            q = torch.randn(b, hq, seq, d, generator=g).to(device).requires_grad_()
            k, v = (torch.randn(b, hkv, seq, d, generator=g).to(device).requires_grad_() for _ in "kv")
            docs = _documents(seq, cp).expand(b, -1).contiguous() if packed else None
            ref = _reference(q, k, v, docs)
            ref.pow(2).sum().backward()
            want = [ref.detach(), q.grad, k.grad, v.grad]
            for dtype in dtypes:
                got = run_threads(_ring_rank, cp, cp, q, k, v, docs, dtype)
                err = 0.0
                for tensors, cp_dim in got:
                    for g_t, w_t in zip(tensors, want):
                        dim = 2 if w_t.dim() == 4 else 1
                        w_local = zigzag_shard(w_t, dim, cp_dim)
                        err = max(err, ((g_t - w_local).abs().max() / w_local.abs().max()).item())
                rows.append(dict(name=f"ring cp {cp} {'packed' if packed else 'causal'} "
                                      f"{str(dtype).replace('torch.', '')}",
                                 ok=err <= TOL[dtype], max_err=err, tol=TOL[dtype],
                                 shape=f"B {b} Hq {hq} Hkv {hkv} T {seq} D {d}"))
    return dict(rows=rows)


def _zero3_train(device, cfg, steps, shard):
    from minipar.mesh import ProcessGroupManager
    from minipar.optim import build_optimizer
    from minipar.zero3 import ShardedStateDicts, fully_shard
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    pgm = minipar.init(ParallelismConfig(dp_shard_size=2)) if shard else ProcessGroupManager.local()
    model = LlamaForCausalLM(LlamaConfig(**cfg), pgm if shard else None, seed=0).to(device)
    if shard:
        fully_shard(model, pgm, prefetch=1)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    losses, counts, grads = [], [], None
    for step in range(steps):
        ids = torch.randint(0, cfg["vocab_size"], (4, 64), generator=g)
        rows = ids[2 * pgm.dp.rank:2 * pgm.dp.rank + 2] if shard else ids
        rows = rows.to(device)
        n = torch.tensor(4 * 64, device=device)
        with comm_ledger.ledger() as led:
            loss = model(rows, labels=rows, num_items_in_batch=n)
            loss.backward()
        if step == 0:
            grads = (ShardedStateDicts(model.zero3).full_from_shards([p.grad for p in model.zero3.shards])
                     if shard else {name: p.grad.detach().clone() for name, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().double()
        losses.append(comm.all_reduce(total, pgm.dp).item() if shard else total.item())
        if shard:
            counts.append((led.count("all_gather"), led.count("reduce_scatter"), len(model.zero3.units)))
    return losses, {k: v.float().cpu() for k, v in grads.items()}, counts


def zero3_step(device: torch.device, small: bool = False) -> dict:
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2) if small else \
        dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4)
    steps = 3
    want_losses, want_grads, _ = _zero3_train(device, cfg, steps, shard=False)
    ranks = run_threads(_zero3_train, 2, device, cfg, steps, True)
    loss_err = max(abs(a - b) / abs(b) for losses, _, _ in ranks for a, b in zip(losses, want_losses))
    grad_err = max(((got[n] - w).abs().max() / w.abs().max().clamp_min(1e-12)).item()
                   for _, got, _ in ranks for n, w in want_grads.items())
    gathers, scatters, units = ranks[0][2][-1]
    return dict(rows=[
        dict(name="zero3 dp_shard 2: losses, 3 steps", ok=loss_err <= 1e-5, max_err=loss_err, tol=1e-5),
        dict(name="zero3 dp_shard 2: first-step gradients", ok=grad_err <= 1e-4, max_err=grad_err, tol=1e-4),
        # every unit gathered in forward and again in backward (resharded after forward), each
        # gradient reduce-scattered once; the root's (final norm, lm_head) too
        dict(name="zero3 dp_shard 2: collectives per step", ok=scatters >= units and gathers >= units,
             max_err=0.0, tol=0.0,
             detail=f"{gathers} all-gathers, {scatters} reduce-scatters, {units} units"),
    ])
