"""Ring attention and zigzag sharding against single-process attention, on forked gloo worlds."""
import pytest
import torch
import torch.nn.functional as F
from harness import run_world

import minipar
from minipar import ParallelismConfig, comm, comm_ledger
from minipar import tensor_parallel as tpl
from minipar.context_parallel import (
    BlockKernel,
    RingKnobs,
    ring_attention,
    ring_schedule,
    schedule_score_elements,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from minipar.mesh import MeshDim, ProcessGroupManager


def _dim(size, rank=0):
    """A cp MeshDim with no process group: enough for pure functions, and anything that tried to
    communicate on it would crash instead of raising the ValueError a test expects."""
    return MeshDim("cp", list(range(size)), rank, None)


def _reference(q, k, v, causal):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)      # GQA, materialised in the reference only
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _attention_cases(cp_size, cases, tp_size=1, chunk=4):
    """On every rank: for each case, ring attention of this rank's zigzag share against the full
    sequence attended in one process; returns a list of failure messages (empty = all passed)."""
    pgm = minipar.init(ParallelismConfig(cp_size=cp_size, tp_size=tp_size))
    cp, failures = pgm.cp, []
    for n, (causal, hq, hkv, d, impl, dtype, overlap) in enumerate(cases):
        # the tp rank changes the data: a ring that crossed into another cp group would mix them
        g = torch.Generator().manual_seed(100 * n + pgm.tp.rank)
        b, t = 2, 2 * cp_size * chunk
        q, k, v = (torch.randn(b, h, t, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        dout = torch.randn(b, hq, t, d, generator=g).to(dtype)
        full = [x.float().clone().requires_grad_() for x in (q, k, v)]
        ref = _reference(*full, causal)
        ref.backward(dout.float())
        local = [zigzag_shard(x, 2, cp).clone().requires_grad_() for x in (q, k, v)]
        stats = {}
        with comm_ledger.ledger() as led:
            out = ring_attention(*local, cp, BlockKernel(impl), causal,
                                 knobs=RingKnobs(overlap=overlap, stats=stats))
            out.backward(zigzag_shard(dout, 2, cp))
        name = f"case {n} (causal={causal}, Hq={hq}, Hkv={hkv}, D={d}, {impl}, {dtype}, overlap={overlap})"
        want = [zigzag_shard(x, 2, cp) for x in [ref.detach()] + [x.grad for x in full]]
        got = [out] + [x.grad for x in local]
        if dtype == torch.float32:
            bound = [None] * 4
        else:
            # bf16 tolerance: no worse than twice the error of one process attending in bf16
            same = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            ref16 = _reference(*same, causal)
            ref16.backward(dout)
            bound = [2 * (zigzag_shard(a, 2, cp).float() - w).abs().max().item() + 1e-3
                     for a, w in zip([ref16.detach()] + [x.grad for x in same], want)]
        try:
            assert out.shape == local[0].shape
            for g_, w, bnd, what in zip(got, want, bound, ("out", "dq", "dk", "dv")):
                assert g_.dtype == dtype, f"{name} {what} dtype {g_.dtype}"
                if bnd is None:
                    torch.testing.assert_close(g_, w, atol=1e-5, rtol=1e-5, msg=f"{name} {what}")
                else:
                    err = (g_.float() - w).abs().max().item()
                    assert err <= bnd, f"{name} {what}: error {err:.4f} > bound {bnd:.4f}"
            assert stats["score_elements"] == schedule_score_elements(t, cp_size, cp.rank, causal), name
            # forward: cp-1 hops of K/V; backward: cp-1 hops of K/V and cp-1 of fp32 dK/dV
            kv = 2 * k.numel() // cp_size * k.element_size()
            dkv = 2 * k.numel() // cp_size * 4
            hops = [r.bytes for r in led.filter("send_recv", "cp")]
            assert sorted(hops) == sorted([kv] * (2 * (cp_size - 1)) + [dkv] * (cp_size - 1)), (name, hops)
        except AssertionError as err:
            failures.append(f"rank {pgm.global_rank}: {err}")
    return failures


FP32 = torch.float32
BF16 = torch.bfloat16
SHAPES = [(4, 2, 16), (4, 1, 32)]        # GQA 2:1 and 4:1, two head dims


def _cases(shapes, impls=("fused", "torch"), causals=(True, False), dtype=FP32, overlap=True):
    return [(c, *s, i, dtype, overlap) for c in causals for s in shapes for i in impls]


@pytest.mark.parametrize("cp_size,tp_size,cases", [
    # cp = 2 inside a cp x tp world of 4, so the cp groups are [0, 2] and [1, 3], not neighbours
    (2, 2, _cases(SHAPES) + _cases([(2, 2, 16)], causals=(True,), overlap=False)),
    (4, 1, _cases(SHAPES)),
    (8, 1, _cases(SHAPES[:1]) + _cases(SHAPES[1:], impls=("fused",), causals=(True,))),
], ids=["cp2xtp2", "cp4", "cp8"])
def test_ring_attention_matches_full_attention_fp32(cp_size, tp_size, cases):
    results = run_world(_attention_cases, cp_size * tp_size, cp_size, cases, tp_size, timeout=180)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:4])


@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_attention_bf16(cp_size):
    cases = _cases(SHAPES[:1], causals=(True,), dtype=BF16) + _cases(SHAPES[1:], impls=("fused",), dtype=BF16)
    results = run_world(_attention_cases, cp_size, cp_size, cases, timeout=180)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:4])


def _packed_document_ids(rows, t, g):
    """(len(rows), t) ids of packed examples: a "packed" row has documents of random lengths (some of
    one token), a "one" row is a single document. Both rows packed: distant blocks share no document
    (skipped); both one: no block is cut (the kernel runs unmasked); mixed: masked blocks."""
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    for r, kind in enumerate(rows):
        if kind == "packed":
            for c in sorted(set(torch.randint(1, t, (t // 3,), generator=g).tolist()) | {1, t - 1}):
                ids[r, c:] += 1
    return ids


def _document_cases(cp_size, tp_size, impls=("fused", "torch")):
    """Ring attention with document_ids against one process attending with the block-diagonal
    causal mask; returns failure messages."""
    pgm = minipar.init(ParallelismConfig(cp_size=cp_size, tp_size=tp_size)) if cp_size * tp_size > 1 \
        else ProcessGroupManager.local()
    cp, failures = pgm.cp, []
    layouts = [("packed", "one"), ("packed", "packed"), ("one", "one")]
    for n, (impl, rows) in enumerate([(i, r) for i in impls for r in layouts]):
        g = torch.Generator().manual_seed(7 + 100 * n + pgm.tp.rank)
        b, t, hq, hkv, d = 2, 2 * cp_size * 4, 4, 2, 16
        q, k, v, dout = (torch.randn(b, h, t, d, generator=g) for h in (hq, hkv, hkv, hq))
        docs = _packed_document_ids(rows, t, g)
        full = [x.clone().requires_grad_() for x in (q, k, v)]
        mask = torch.ones(t, t, dtype=torch.bool).tril() & (docs[:, :, None] == docs[:, None, :])
        ref = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(2, 1),
                                             full[2].repeat_interleave(2, 1), attn_mask=mask[:, None])
        ref.backward(dout)
        local = [zigzag_shard(x, 2, cp).clone().requires_grad_() for x in (q, k, v)]
        with comm_ledger.ledger() as led:
            out = ring_attention(*local, cp, BlockKernel(impl, zigzag_shard(docs, 1, cp)), causal=True)
            out.backward(zigzag_shard(dout, 2, cp))
        try:
            for got, want, what in zip([out] + [x.grad for x in local], [ref] + [x.grad for x in full],
                                       ("out", "dq", "dk", "dv")):
                torch.testing.assert_close(got, zigzag_shard(want.detach(), 2, cp), atol=1e-5, rtol=1e-5,
                                           msg=f"{impl} {rows} {what}")
            # the ids travel with K/V: cp-1 more hops of (B, L) ids forward and backward
            ids_bytes = b * (t // cp_size) * 8
            hops = [r.bytes for r in led.filter("send_recv", "cp")]
            assert hops.count(ids_bytes) == 2 * (cp_size - 1), hops
        except AssertionError as err:
            failures.append(f"rank {pgm.global_rank}: {err}")
    return failures


@pytest.mark.parametrize("cp_size,tp_size", [(1, 1), (2, 2), (4, 1)], ids=["cp1", "cp2xtp2", "cp4"])
def test_ring_attention_masks_by_document(cp_size, tp_size):
    if cp_size * tp_size == 1:
        failures = _document_cases(1, 1)
    else:
        failures = [f for r in run_world(_document_cases, cp_size * tp_size, cp_size, tp_size, timeout=180)
                    for f in r]
    assert not failures, "\n".join(failures[:4])


def test_block_document_mask_classification():
    """A block with no same-document pair is skipped, one the documents do not cut runs unmasked."""
    from minipar.context_parallel.document_attention import document_mask
    a, b = torch.tensor([[0, 0, 1, 1]]), torch.tensor([[2, 2, 2, 2]])
    assert document_mask(4, 4, False, a, b)[0] == "empty"
    assert document_mask(4, 4, True, b, b)[0] == "plain"
    kind, mask = document_mask(4, 4, True, a, a)
    assert kind == "masked"
    assert mask[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_ring_attention_cp1_is_local_causal_attention():
    cp = ProcessGroupManager.local().cp                  # size 1, no process group at all
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 16, generator=g).requires_grad_() for h in (4, 2, 2))   # odd halves ok
    for impl in ("fused", "torch"):
        with comm_ledger.ledger() as led:
            out = ring_attention(q, k, v, cp, BlockKernel(impl), causal=True)
            grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert led.count() == 0, "cp size 1 must not communicate"
        qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
        ref = _reference(qr, kr, vr, True)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        for got, want in zip(grads, torch.autograd.grad(ref.sum(), (qr, kr, vr))):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _zigzag_roundtrip(cp_size):
    pgm = minipar.init(ParallelismConfig(cp_size=cp_size))
    cp, t = pgm.cp, 4 * cp_size
    x = torch.arange(2 * t * 3).reshape(2, t, 3)
    local = zigzag_shard(x, 1, cp)
    pos = zigzag_positions(t, cp)
    assert torch.equal(local, x[:, pos]), "the share holds the tokens at the positions zigzag_positions names"
    c = t // (2 * cp_size)
    assert pos.tolist() == list(range(cp.rank * c, (cp.rank + 1) * c)) + \
        list(range((2 * cp_size - 1 - cp.rank) * c, (2 * cp_size - cp.rank) * c))
    assert torch.equal(zigzag_unshard(local, 1, cp), x)
    return pos


def test_zigzag_shard_unshard_positions():
    positions = run_world(_zigzag_roundtrip, 4, 4, timeout=120)
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(16)), "shares partition the sequence"
    assert positions[0].tolist() == [0, 1, 14, 15]


def test_bad_lengths_raise_before_communicating():
    cp = _dim(4, 1)
    with pytest.raises(ValueError, match=r"sequence length 10 .* 2 \* cp_size = 8 .* 8 or 16"):
        zigzag_shard(torch.zeros(1, 10), 1, cp)
    with pytest.raises(ValueError, match="sequence length 10"):
        zigzag_positions(10, cp)
    with pytest.raises(ValueError, match="odd"):
        zigzag_unshard(torch.zeros(1, 5), 1, cp)
    q, k = torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match="local length 5 is odd"):
        ring_attention(q, k, k, cp, BlockKernel())
    with pytest.raises(ValueError, match=r"kv heads \(3\) must divide q heads \(4\)"):
        ring_attention(torch.zeros(1, 4, 4, 8), torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8), cp,
                       BlockKernel())
    with pytest.raises(ValueError, match="impl"):
        ring_attention(torch.zeros(1, 4, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8), cp,
                       BlockKernel(impl="x"))
    assert zigzag_shard(torch.zeros(1, 7), 1, _dim(1)).shape == (1, 7), "cp size 1 takes any length"


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_zigzag_balances_causal_work(cp_size):
    t = 16 * cp_size
    zig = [schedule_score_elements(t, cp_size, r) for r in range(cp_size)]
    contiguous = [schedule_score_elements(t, cp_size, r, zigzag=False) for r in range(cp_size)]
    assert len(set(zig)) == 1, zig
    unmasked = [schedule_score_elements(t, cp_size, r, count_masked=False) for r in range(cp_size)]
    assert len(set(unmasked)) == 1 and cp_size * unmasked[0] == t * (t + 1) // 2, "exactly the causal pairs"
    mean = sum(contiguous) / cp_size
    assert contiguous[-1] / mean == pytest.approx(2 * cp_size / (cp_size + 1)), contiguous
    assert contiguous[0] < contiguous[-1]
    # the zigzag schedule computes every causal (query, key) pair exactly once, and an unmasked
    # block never holds a pair from the future
    seen = torch.zeros(t, t, dtype=torch.long)
    for r in range(cp_size):
        qpos = zigzag_positions(t, _dim(cp_size, r))
        for i, blocks in enumerate(ring_schedule(t // cp_size, cp_size, r)):
            kpos = zigzag_positions(t, _dim(cp_size, (r - i) % cp_size))
            for b in blocks:
                qq, kk = qpos[b.q0:b.q1, None], kpos[None, b.k0:b.k1]
                allowed = (kk <= qq) if b.causal else torch.ones_like(kk <= qq)
                assert b.causal or bool((kk <= qq).all()), (r, i, b)
                seen[qq.expand_as(allowed)[allowed], kk.expand_as(allowed)[allowed]] += 1
    assert torch.equal(seen, torch.ones(t, t, dtype=torch.long).tril())


# ------------------------------------------------------------------------------- the decoder under cp
CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


def _batch(step, b=2, t=16):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 64, (b, t + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, :3] = -100
    return ids[:, :-1], labels


def _decoder(cp_size, tp_size, steps=5):
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    pgm = minipar.init(ParallelismConfig(cp_size=cp_size, tp_size=tp_size)) if cp_size * tp_size > 1 else None
    cfg = LlamaConfig(**CFG)
    out = {"losses": []}
    for dtype, n_steps in ((torch.float32, 1), (torch.float64, steps)):   # grads in fp32, AdamW in fp64
        model = LlamaForCausalLM(cfg, pgm, seed=1).to(dtype)
        cp = model.pgm.cp
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(n_steps):
            opt.zero_grad()
            ids, labels = _batch(step)
            count = (labels != -100).sum()
            loss = model(zigzag_shard(ids, 1, cp), labels=zigzag_shard(labels, 1, cp),
                         num_items_in_batch=count)
            loss.backward()
            total = comm.all_reduce(loss.detach().clone(), cp)          # the per-rank losses sum to the loss
            for p in model.parameters():                                 # params are replicated over cp
                comm.all_reduce(p.grad, cp)
            if dtype == torch.float32:
                out["loss"] = total
                out["grads"] = {n: tpl.gather_tensor(p.grad, p.tp_split_dim, model.pgm.tp)
                                for n, p in model.named_parameters()}
            else:
                out["losses"].append(total)
                opt.step()
        if dtype == torch.float64:
            out["params"] = model.full_state_dict()
    return out


@pytest.mark.parametrize("cp_size,tp_size", [(2, 1), (4, 1), (2, 2)], ids=["cp2", "cp4", "cp2xtp2"])
def test_decoder_under_cp_equals_one_process(cp_size, tp_size):
    ref = _decoder(1, 1)
    for got in run_world(_decoder, cp_size * tp_size, cp_size, tp_size, timeout=180):
        torch.testing.assert_close(got["loss"], ref["loss"], atol=1e-5, rtol=1e-5)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, atol=1e-5, rtol=1e-4, msg=name)
        torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(ref["losses"]), atol=1e-10,
                                   rtol=1e-10)
        for name, p in ref["params"].items():
            torch.testing.assert_close(got["params"][name], p, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("kind,dtype", [("cuda_flash", BF16), ("cuda_efficient", FP32)])
def test_cuda_kernel_calls_fit_torch_schemas(kind, dtype):
    """No GPU here: the meta device runs the CUDA kernels' shape functions, which checks the
    argument lists and the lse layout (padded by the efficient kernel) of the fused CUDA path."""
    from minipar.context_parallel import fused_attention as ba
    for hq, hkv, causal, tq, tk in [(4, 2, True, 24, 24), (4, 2, False, 12, 24), (4, 4, False, 24, 12)]:
        q = torch.empty(2, hq, tq, 64, device="meta", dtype=dtype)
        k = v = torch.empty(2, hkv, tk, 64, device="meta", dtype=dtype)
        out, lse, extra = ba._fused_block_forward(kind, q, k, v, causal, 0.125)
        assert out.shape == q.shape and lse.shape == q.shape[:3]
        grads = ba._fused_block_backward(kind, extra, torch.empty_like(out), q, k, v, out, lse.float(),
                                         causal, 0.125)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
