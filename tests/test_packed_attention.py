"""Packed documents from host boundaries (documents.py, document_attention.py) against the dense
mask they replace, in fp64; the kernel choice and its report (kernel_choice.py); the CUDA calls
checked on meta tensors (the real aten schemas) and with the varlen kernel emulated on CPU."""
import io
from contextlib import redirect_stdout

import pytest
import torch
from harness import run_world

import minipar
from minipar import ParallelismConfig
from minipar.context_parallel import (
    BlockKernel,
    Documents,
    choose_kernel,
    ring_attention,
    ring_schedule,
    zigzag_shard,
)
from minipar.context_parallel import document_attention as da
from minipar.context_parallel.block_attention import reference_backward, reference_forward
from minipar.context_parallel.documents import classify_block, cumulative_lengths, runs
from minipar.context_parallel.kernel_choice import AttentionLog, is_unsupported, may_fall_back
from minipar.mesh import ProcessGroupManager

F64 = torch.float64


# ------------------------------------------------------------------------------- the host side
def test_runs_and_cumulative_lengths():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 7]])
    assert runs(ids[0]) == [(0, 0, 3), (1, 3, 5), (2, 5, 8)]
    assert runs(torch.tensor([0, 1, 0])) is None                     # an id in two runs: not packed
    assert cumulative_lengths(ids).tolist() == [0, 3, 5, 8, 15, 16]
    assert cumulative_lengths(ids).dtype == torch.int32
    with pytest.raises(ValueError, match="two runs"):
        cumulative_lengths(torch.tensor([[0, 1, 0]]))


def test_classify_block():
    a = torch.tensor([[0, 0, 1, 1, 2]])
    cls = classify_block(a, a, True)
    assert cls.kind == "segments" and cls.segments == ((0, 0, 2, 0, 2), (0, 2, 4, 2, 4), (0, 4, 5, 4, 5))
    one = torch.full((2, 4), 3)
    assert classify_block(one, one, True).kind == "plain"
    assert classify_block(one, torch.full((2, 3), 3), False).kind == "plain"
    assert classify_block(torch.tensor([[0, 0]]), torch.tensor([[1, 1]]), False).kind == "empty"
    # off the diagonal: the rows of document 1 see the columns of document 1 only
    cls = classify_block(torch.tensor([[1, 1, 2]]), torch.tensor([[0, 1, 1, 1]]), False)
    assert cls.kind == "segments" and cls.segments == ((0, 0, 2, 1, 4),)
    assert classify_block(torch.tensor([[0, 1, 0]]), torch.tensor([[0, 1, 0]]), True).kind == "dense"
    with pytest.raises(ValueError, match="square diagonal"):
        classify_block(a, a[:, :4], True)


def test_varlen_layout():
    qi, ki, cu_q, cu_k, mq, mk = da.varlen_layout(((0, 0, 2, 1, 4), (1, 1, 3, 0, 1)), 3, 4)
    assert qi.tolist() == [0, 1, 4, 5] and ki.tolist() == [1, 2, 3, 4]
    assert cu_q.tolist() == [0, 2, 4] and cu_k.tolist() == [0, 3, 4] and (mq, mk) == (2, 3)
    assert cu_q.dtype == torch.int32


def _docs(case, t):
    """(1, t) ids: 1, 3 or 7 documents, one crossing the cp shards, documents of one token."""
    cuts = {"1 doc": [], "3 docs": [t // 4, t // 2 + 3], "7 docs": [2, 5, 9, 14, 20, 25],
            "crosses shards": [3, t - 3], "one-token docs": [1, 2, 7, 8, t - 1]}[case]
    ids = torch.zeros(1, t, dtype=torch.long)
    for c in cuts:
        ids[:, c:] += 1
    return ids


CASES = ["1 doc", "3 docs", "7 docs", "crosses shards", "one-token docs"]


@pytest.mark.parametrize("impl", ["auto", "math"])
@pytest.mark.parametrize("case", CASES)
def test_blocks_equal_the_dense_mask_fp64(case, impl):
    """Every block of a cp 4 zigzag ring (and of cp 1): the host classification's out, lse, dq, dk,
    dv equal the dense document mask's (today's path), in fp64."""
    t, hq, hkv, d = 32, 4, 2, 8
    g = torch.Generator().manual_seed(3)
    other = case if case == "1 doc" else CASES[(CASES.index(case) + 2) % len(CASES)]
    ids = torch.cat([_docs(case, t), _docs(other, t)])       # B = 2
    host, kinds = Documents(ids, "zigzag"), set()
    for n in (1, 4):
        L = t // n
        for rank in range(n):
            for i, blocks in enumerate(ring_schedule(L, n, rank)):
                src = (rank - i) % n
                for b in blocks:
                    tq, tk = b.q1 - b.q0, b.k1 - b.k0
                    q, dout = (torch.randn(2, hq, tq, d, generator=g, dtype=F64) for _ in range(2))
                    k, v = (torch.randn(2, hkv, tk, d, generator=g, dtype=F64) for _ in range(2))
                    q_doc = host.share(rank, n)[:, b.q0:b.q1]
                    k_doc = host.share(src, n)[:, b.k0:b.k1]
                    cls = host.block(rank, src, n, b.q0, b.q1, b.k0, b.k1, b.causal)
                    kinds.add(cls.kind)
                    o1, l1, c1 = da.block_forward(q, k, v, b.causal, 0.3, impl, q_doc, k_doc)
                    o2, l2, c2 = da.block_forward(q, k, v, b.causal, 0.3, impl, docs=cls)
                    where = f"{case} cp {n} rank {rank} step {i} {b} {cls.kind}"
                    assert (o1 is None) == (o2 is None), where
                    if o1 is None:
                        continue
                    torch.testing.assert_close(l2, l1, atol=1e-12, rtol=1e-12, msg=where)
                    torch.testing.assert_close(o2.to(F64), o1.to(F64), atol=1e-12, rtol=1e-12, msg=where)
                    # the backward with the block's own out and lse as the "final" ones
                    g1 = da.block_backward(dout, q, k, v, o1, l1, b.causal, 0.3, c1, q_doc, k_doc)
                    g2 = da.block_backward(dout, q, k, v, o1, l1, b.causal, 0.3, c2, docs=cls)
                    for x, y, what in zip(g2, g1, ("dq", "dk", "dv")):
                        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12, msg=f"{where} {what}")
    assert kinds == {"plain"} if case == "1 doc" else "segments" in kinds, kinds


def test_one_process_packed_equals_dense_sdpa_fp64():
    """cp 1: the whole sequence as a one-rank ring with Documents equals SDPA with the (s, s) mask."""
    from minipar.mesh import MeshDim
    from models.llama_layer import causal_attention
    t, g = 32, torch.Generator().manual_seed(5)
    ids = torch.cat([_docs("7 docs", t), _docs("one-token docs", t)])
    q, k, v, dout = (torch.randn(2, h, t, 8, generator=g, dtype=F64) for h in (4, 2, 2, 4))
    alone = MeshDim("cp_alone", [0], 0, None)
    got_x = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_x = [x.clone().requires_grad_() for x in (q, k, v)]
    got = ring_attention(*got_x, alone, BlockKernel(documents=Documents(ids)))
    ref = causal_attention(*ref_x, ids)
    got.backward(dout)
    ref.backward(dout)
    for a, b in zip([got] + [x.grad for x in got_x], [ref] + [x.grad for x in ref_x]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def _ring_fp64(cp_size, cp_impl):
    pgm = minipar.init(ParallelismConfig(cp_size=cp_size, cp_impl=cp_impl,
                                         cp_ulysses_size=2 if cp_impl == "usp" else None).resolve(cp_size))
    from minipar.context_parallel import ulysses_attention
    t, failures = 8 * cp_size, []
    for case in CASES:
        g = torch.Generator().manual_seed(11)
        ids = torch.cat([_docs(case, t), _docs("3 docs", t)])
        q, k, v, dout = (zigzag_shard(torch.randn(2, h, t, 8, generator=g, dtype=F64), 2, pgm.cp)
                         for h in (4, 2, 2, 4))
        results = []
        for docs in (zigzag_shard(ids, 1, pgm.cp), Documents.gather(zigzag_shard(ids, 1, pgm.cp), pgm.cp)):
            x = [y.clone().requires_grad_() for y in (q, k, v)]
            if cp_impl == "ring":
                out = ring_attention(*x, pgm.cp, BlockKernel(documents=docs))
            else:
                out = ulysses_attention(*x, pgm.cp_ulysses, pgm.cp_ring, document_ids=docs)
            out.backward(dout)
            results.append([out] + [y.grad for y in x])
        try:
            for a, b, what in zip(results[1], results[0], ("out", "dq", "dk", "dv")):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12, msg=f"{case} {what}")
        except AssertionError as err:
            failures.append(f"rank {pgm.global_rank} {cp_impl}: {err}")
    return failures


@pytest.mark.parametrize("cp_size,cp_impl", [(4, "ring"), (4, "usp")])
def test_ring_and_usp_with_documents_equal_the_dense_path_fp64(cp_size, cp_impl):
    failures = [f for r in run_world(_ring_fp64, cp_size, cp_size, cp_impl, timeout=180) for f in r]
    assert not failures, "\n".join(failures[:4])


# ------------------------------------------------------------------------------- CUDA, without a GPU
def _emulated_varlen():
    """A CPU stand-in for aten._flash_attention_forward / _backward (their varlen layout: q (total,
    Hq, D), k (total, Hkv, D), lse (Hq, total)), from the reference math per segment."""
    def segments(cu_q, cu_k):
        return zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())

    def mask(n, causal):
        return torch.ones(n, n, dtype=torch.bool).tril()[None] if causal else None

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, p, causal, debug, scale=None):
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
        for qs, qe, ks, ke in segments(cu_q, cu_k):
            o, lo = reference_forward(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
                                      v[ks:ke].transpose(0, 1)[None], scale, mask(qe - qs, causal))
            out[qs:qe], lse[:, qs:qe] = o[0].transpose(0, 1), lo[0]
        return out, lse, torch.zeros(2), torch.zeros(()), torch.empty(0)

    def bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, p, causal, rng, unused, scale=None):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qs, qe, ks, ke in segments(cu_q, cu_k):
            def h(x, s, e):
                return x[s:e].transpose(0, 1)[None]
            gq, gk, gv = reference_backward(h(dout, qs, qe), h(q, qs, qe), h(k, ks, ke), h(v, ks, ke),
                                            h(out, qs, qe), lse[:, qs:qe][None], scale, mask(qe - qs, causal))
            dq[qs:qe], dk[ks:ke] = gq[0].transpose(0, 1), gk[0].transpose(0, 1)
            dv[ks:ke] = gv[0].transpose(0, 1)
        return dq, dk, dv
    return fwd, bwd


def test_varlen_dispatch_with_the_kernel_emulated(monkeypatch):
    """kind cuda_flash: a cut block goes to ONE varlen call; the packing of its rows, the lse layout,
    the -inf rows and the gradients equal the per-document path (fp64, the kernel emulated)."""
    calls = []
    fwd, bwd = _emulated_varlen()
    monkeypatch.setattr(da, "_varlen_ops", lambda: (lambda *a, **k: calls.append(1) or fwd(*a, **k), bwd))
    monkeypatch.setattr(da, "signature_ok", lambda kind: True)
    g = torch.Generator().manual_seed(2)
    for causal, qd, kd in ((True, [0, 0, 1, 1, 1, 2], None), (False, [1, 1, 2, 3, 3, 3], [0, 1, 1, 1, 3, 3])):
        q_ids = torch.tensor([qd, [4] * 6])
        k_ids = q_ids if kd is None else torch.tensor([kd, [4] * 6])
        cls = classify_block(q_ids, k_ids, causal)
        q, dout = (torch.randn(2, 4, 6, 8, generator=g, dtype=F64) for _ in range(2))
        k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=F64) for _ in range(2))
        log = AttentionLog(echo=False)
        o1, l1, c1 = da.block_forward(q, k, v, causal, 0.3, "auto", docs=cls, kind="cuda_flash", log=log)
        o2, l2, c2 = da.block_forward(q, k, v, causal, 0.3, "math", docs=cls)
        assert c1[1][0] == "varlen" and len(calls) == 1 and log.kernels("packed documents") == ["cuda_varlen"]
        torch.testing.assert_close(l1, l2, atol=1e-12, rtol=0)
        torch.testing.assert_close(o1, o2, atol=1e-12, rtol=0)
        g1 = da.block_backward(dout, q, k, v, o2, l2, causal, 0.3, c1, docs=cls)
        g2 = da.block_backward(dout, q, k, v, o2, l2, causal, 0.3, c2, docs=cls)
        for x, y in zip(g1, g2):
            torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
        calls.clear()


def test_cuda_calls_match_the_aten_schemas_on_meta():
    """The CUDA kernels' calls as minipar makes them, run on meta tensors against this torch's real
    aten schemas: argument layout, result count, shapes (GQA folded, expanded, varlen)."""
    from minipar.context_parallel.fused_attention import dense_backward, dense_forward, signature_ok
    for kind in ("cuda_flash", "cuda_efficient", "cuda_varlen"):
        assert signature_ok(kind), kind
    meta = dict(device="meta", dtype=torch.bfloat16)
    for kind in ("cuda_flash", "cuda_efficient"):
        for causal, tk in ((True, 16), (False, 8)):
            q, k = torch.empty(2, 4, 16, 64, **meta), torch.empty(2, 2, tk, 64, **meta)
            out, lse, ran = dense_forward(kind, q, k, k, causal, 0.125, "fused")
            assert ran[0] == kind and out.shape == q.shape and lse.shape == (2, 4, 16), (kind, lse.shape)
            dq, dk, dv = dense_backward(ran, out, q, k, k, out, lse.float(), causal, 0.125, "fused")
            assert dq.shape == q.shape and dk.shape == k.shape == dv.shape, kind
    cls = classify_block(torch.tensor([[0] * 5 + [1] * 11]), torch.tensor([[0] * 5 + [1] * 11]), True)
    q, k = torch.empty(1, 4, 16, 64, **meta), torch.empty(1, 2, 16, 64, **meta)
    out, lse, ctx = da.block_forward(q, k, k, True, 0.125, "flash", docs=cls, kind="cuda_flash")
    assert ctx[0] == "segments" and ctx[1][0] == "varlen"
    assert lse.shape == (1, 4, 16) and lse.dtype == torch.float32
    dq, dk, dv = da.block_backward(out, q, k, k, out, lse, True, 0.125, ctx, docs=cls)
    assert dq.shape == q.shape and dk.shape == k.shape


# ------------------------------------------------------------------------------- choice and report
def test_choose_kernel_table():
    bf, f32 = torch.bfloat16, torch.float32
    assert choose_kernel("auto", "cuda", bf, 128).kind == "cuda_flash"
    assert choose_kernel("auto", "cuda", f32, 128).kind == "cuda_efficient"
    assert choose_kernel("auto", "cuda", bf, 100).kind == "torch"          # head_dim not a multiple of 8
    assert choose_kernel("efficient", "cuda", bf, 64).kind == "cuda_efficient"
    assert choose_kernel("auto", "cpu", f32, 64).kind == "cpu"
    assert choose_kernel("math", "cuda", bf, 64).kind == "torch"
    assert choose_kernel("cudnn", "cuda", bf, 64, path="sdpa").kind == "sdpa"
    for backend, device, dtype, hd, path, match in (
            ("flash", "cuda", f32, 64, "ring", "flash: fp16/bf16"),
            ("efficient", "cpu", f32, 64, "ring", "cpu"),
            ("cudnn", "cuda", bf, 64, "ring", "cp 1 without sample_packing"),
            ("flash", "cuda", bf, 512, "ring", "head_dim"), ("cudnn", "cpu", f32, 64, "sdpa", "needs CUDA"),
            ("bogus", "cpu", f32, 64, "ring", "attention_backend must be one of")):
        with pytest.raises(ValueError, match=match):
            choose_kernel(backend, device, dtype, hd, path=path)


def test_which_failures_fall_back():
    refusal = RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    sticky = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert is_unsupported(refusal) and not is_unsupported(sticky)
    assert may_fall_back(refusal, "cuda", "auto") and not may_fall_back(sticky, "cuda", "auto")
    assert not may_fall_back(RuntimeError("something else broke"), "cuda", "auto")
    assert not may_fall_back(refusal, "cuda", "flash")                      # forced: never
    assert may_fall_back(RuntimeError("something else broke"), "cpu", "auto")
    assert not may_fall_back(torch.cuda.OutOfMemoryError("CUDA out of memory"), "cuda", "auto")


def test_a_fallback_is_said_once(monkeypatch):
    from minipar.context_parallel import fused_attention as fa

    def refuse(*a, **k):
        raise RuntimeError("this kernel does not support this shape")
    monkeypatch.setattr(fa, "_fused_block_forward", refuse)
    q = torch.randn(1, 2, 4, 8)
    log, buf = AttentionLog(echo=False), io.StringIO()
    with redirect_stdout(buf):
        for _ in range(3):
            out, lse, ran = fa.dense_forward("cpu", q, q, q, True, 0.3, "auto", log)
    assert ran[0] == "torch" and buf.getvalue().count("does not support") == 1, buf.getvalue()
    with pytest.raises(RuntimeError, match="does not support"):
        fa.dense_forward("cpu", q, q, q, True, 0.3, "flash", log)


def test_the_model_says_its_kernels(capsys):
    """A packed forward at cp 1 notes the CPU flash kernel per document; unpacked, SDPA."""
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg, ProcessGroupManager.local())
    ids = torch.randint(0, 64, (1, 16))
    model(ids, document_ids=_docs("3 docs", 16))
    model(ids)
    entries = model.model.attention_log.entries
    want = [("ring", "cpu"), ("packed documents", "cpu"), ("cp 1", "sdpa")]
    assert [e[:2] for e in entries] == want, entries
    assert capsys.readouterr().out.count("[minipar] attention") == 3
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        ParallelismConfig(attention_backend="fast")


def test_config_refuses_a_backend_that_cannot_run():
    from minipar.trainer.config.train_config import load_config
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        load_config(None, ["--attention_backend", "fast"])
    with pytest.raises(ValueError, match="cudnn runs only through SDPA"):
        load_config(None, ["--attention_backend", "cudnn", "--context_parallel_size", "2"])
    assert load_config(None, ["--attention_backend", "math"]).attention_backend == "math"


def test_sdpa_forced_backend_equals_auto():
    from models.llama_layer import causal_attention
    q = torch.randn(1, 4, 16, 8)
    torch.testing.assert_close(causal_attention(q, q[:, :2], q[:, :2], backend="math"),
                               causal_attention(q, q[:, :2], q[:, :2]))
