"""A block under packed documents: skipped, run whole, per document, or in one varlen call.

documents.py classifies every attention block from the host's document boundaries (empty, plain,
segments, dense). This file runs a block by its class, and keeps the two calls the ring makes:

    block_forward(q, k, v, causal, scale, impl, q_doc, k_doc, docs=, kind=, log=) -> out, lse, ctx
    block_backward(dout, q, k, v, out, lse, causal, scale, ctx, q_doc, k_doc, docs=, log=) -> dq, dk, dv

    empty     nothing computed; out None, and the ring merges nothing
    plain     the dense kernel (fused_attention.py) on the whole block, as without documents
    segments  the documents of the block, each its own dense sub-block, rows [qs, qe) x columns
              [ks, ke) (causal on the diagonal block):
                CUDA flash (fp16/bf16): ONE varlen flash-attention call for all of them,
                  aten._flash_attention_forward with cumulative lengths cu_q / cu_k (what
                  torch.nn.attention.varlen.varlen_attn calls), the rows of every segment packed
                  (total, H, D); its lse (H, total) is the log-sum-exp the ring merge needs, and
                  its backward takes the FINAL out and lse, as the ring's backward must
                elsewhere: the block's dense kernel once per document (the CPU flash kernel, the
                  efficient kernel, or the reference math on the document's own scores)
              rows of no segment keep lse = -inf and out = 0: they see no key of this block
    dense     ids that are not runs (not packed data), or device ids (q_doc, k_doc) instead of a
              classification: the (B, Tq, Tk) mask and the reference math, as before documents.py

Memory: a segments block holds scores of one document at a time (per document) or none (varlen),
so attention over T tokens of d-token documents is O(T d), not O(T^2). The segments of a block
are disjoint in rows and in columns, so their gradients are written, never summed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .block_attention import acc_dtype, allowed, reference_forward
from .documents import BlockDocuments
from .fused_attention import _choose, dense_backward, dense_forward, signature_ok
from .kernel_choice import may_fall_back, note

__all__ = ["block_forward", "block_backward", "document_mask", "segments_forward", "segments_backward",
           "varlen_layout"]


# ------------------------------------------------------------------------------- per document
def _per_document_forward(kind, q, k, v, causal, scale, segments, impl, log):
    acc = acc_dtype(q)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    ran = []
    for b, qs, qe, ks, ke in segments:
        o, l, r = dense_forward(kind, q[b:b + 1, :, qs:qe], k[b:b + 1, :, ks:ke], v[b:b + 1, :, ks:ke],
                                causal, scale, impl, log)
        out[b:b + 1, :, qs:qe] = o
        lse[b:b + 1, :, qs:qe] = l
        ran.append(r)
    return out, lse, ran


def _per_document_backward(ran, dout, q, k, v, out, lse, causal, scale, segments, impl, log):
    acc = acc_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for (b, qs, qe, ks, ke), r in zip(segments, ran):
        rows = (slice(b, b + 1), slice(None), slice(qs, qe))
        cols = (slice(b, b + 1), slice(None), slice(ks, ke))
        g = dense_backward(r, dout[rows], q[rows], k[cols], v[cols], out[rows], lse[rows], causal, scale,
                           impl, log)
        dq[rows], dk[cols], dv[cols] = g[0], g[1], g[2]
    return dq, dk, dv


# ------------------------------------------------------------------------------- varlen (CUDA)
def varlen_layout(segments, tq: int, tk: int):
    """The packed layout of a block's segments (host tensors): q_index / k_index, the rows of the
    flattened (B*Tq) queries and (B*Tk) keys each segment takes, in order; cu_q / cu_k (n+1,) int32
    the cumulative lengths over them; max_q, max_k the longest segment."""
    q_index, k_index, cu_q, cu_k = [], [], [0], [0]
    for b, qs, qe, ks, ke in segments:
        q_index.extend(range(b * tq + qs, b * tq + qe))
        k_index.extend(range(b * tk + ks, b * tk + ke))
        cu_q.append(cu_q[-1] + qe - qs)
        cu_k.append(cu_k[-1] + ke - ks)
    max_q = max(qe - qs for _, qs, qe, _, _ in segments)
    max_k = max(ke - ks for _, _, _, ks, ke in segments)
    as_long = dict(dtype=torch.long)
    return (torch.tensor(q_index, **as_long), torch.tensor(k_index, **as_long),
            torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32), max_q, max_k)


class VarlenUnsupported(RuntimeError):
    """The varlen kernel returned a layout minipar does not read (an older torch): not supported."""


def _packed(x, index):
    """(B, H, T, D) -> (len(index), H, D): the rows `index` of the row-major flattened (B*T)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, h, d).index_select(0, index)


def _unpacked(y, index, shape, fill, dtype):
    """The inverse of _packed into a new (B, H, T, D) tensor of `fill` and `dtype`."""
    b, h, t, d = shape
    full = torch.full((b * t, h, d), fill, dtype=dtype, device=y.device)
    full.index_copy_(0, index, y.to(dtype))
    return full.reshape(b, t, h, d).transpose(1, 2)


def _varlen_ops():
    """The varlen flash-attention forward and backward (a seam the tests replace on CPU)."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


def _varlen_forward(q, k, v, causal, scale, layout):
    qi, ki, cu_q, cu_k, max_q, max_k = layout
    forward, _ = _varlen_ops()
    res = forward(_packed(q, qi), _packed(k, ki), _packed(v, ki), cu_q, cu_k, max_q, max_k, 0.0, causal,
                  False, scale=scale)
    out, lse = res[0], res[1]
    n, hq = qi.numel(), q.shape[1]
    if tuple(lse.shape) != (hq, n):
        raise VarlenUnsupported(f"varlen flash lse of shape {tuple(lse.shape)} is not supported (expected "
                                f"(heads, total) = {(hq, n)})")
    acc = acc_dtype(q)
    b, _, t, _ = q.shape
    lse_full = torch.full((hq, b * t), float("-inf"), dtype=acc, device=q.device)
    lse_full.index_copy_(1, qi, lse.to(acc))
    out_full = _unpacked(out, qi, q.shape, 0.0, acc)
    return out_full, lse_full.reshape(hq, b, t).transpose(0, 1), (res[2], res[3])


def _varlen_backward(rng, dout, q, k, v, out, lse, causal, scale, layout):
    qi, ki, cu_q, cu_k, max_q, max_k = layout
    hq = q.shape[1]             # GQA: the kernel reads K/V's Hkv heads and returns dk, dv with them
    b, _, t, _ = q.shape
    lse_packed = lse.transpose(0, 1).reshape(hq, b * t).index_select(1, qi)
    lse_packed = lse_packed.to(torch.promote_types(q.dtype, torch.float32)).contiguous()   # fp32 (kernel)
    _, backward = _varlen_ops()
    dq, dk, dv = backward(
        _packed(dout.to(q.dtype), qi), _packed(q, qi), _packed(k, ki), _packed(v, ki),
        _packed(out.to(q.dtype), qi), lse_packed, cu_q, cu_k, max_q, max_k, 0.0, causal, rng[0], rng[1],
        scale=scale)
    acc = acc_dtype(q)
    return (_unpacked(dq, qi, q.shape, 0.0, acc), _unpacked(dk, ki, k.shape, 0.0, acc),
            _unpacked(dv, ki, v.shape, 0.0, acc))


# ------------------------------------------------------------------------------- a segments block
def _layout_on(docs: BlockDocuments, q, k):
    key = str(q.device)
    if key not in docs.cache:
        host = varlen_layout(docs.segments, q.shape[2], k.shape[2])
        docs.cache[key] = tuple(x.to(q.device, non_blocking=True) if torch.is_tensor(x) else x for x in host)
    return docs.cache[key]


def segments_forward(kind, q, k, v, causal, scale, docs: BlockDocuments, impl, log):
    """A block the documents cut: one varlen flash call (CUDA flash kernel) or one dense call per
    document. -> out, lse (acc dtype), ctx for segments_backward."""
    if kind == "cuda_flash" and signature_ok("cuda_varlen"):
        try:
            out, lse, rng = _varlen_forward(q, k, v, causal, scale, _layout_on(docs, q, k))
            note(log, "packed documents", "cuda_varlen", "flash varlen: one call per block, cumulative "
                                                         "lengths")
            return out, lse, ("varlen", rng)
        except RuntimeError as err:
            if not isinstance(err, VarlenUnsupported) and not may_fall_back(err, q.device, impl):
                raise
            note(log, "packed documents", kind, f"varlen flash refused the block, one call per document: "
                                                f"{str(err).splitlines()[0][:120]}", fallback=True)
    note(log, "packed documents", kind, f"one {kind} call per document of a block")
    out, lse, ran = _per_document_forward(kind, q, k, v, causal, scale, docs.segments, impl, log)
    return out, lse, ("per_document", ran)


def segments_backward(pctx, dout, q, k, v, out, lse, causal, scale, docs: BlockDocuments, impl, log):
    how, extra = pctx
    if how == "varlen":
        return _varlen_backward(extra, dout, q, k, v, out, lse, causal, scale, _layout_on(docs, q, k))
    return _per_document_backward(extra, dout, q, k, v, out, lse, causal, scale, docs.segments, impl, log)


# ------------------------------------------------------------------------------- the two calls
def document_mask(tq: int, tk: int, causal: bool, q_doc, k_doc, device=None):
    """The dense way, from device ids (2-3 host syncs): ("empty", None): no pair may attend;
    ("plain", None): the documents cut nothing the causal rule allows; ("masked", mask (B, Tq, Tk))."""
    if q_doc is None:
        return "plain", None
    mask = allowed(tq, tk, causal, q_doc, k_doc, device)
    if not bool(mask.any()):
        return "empty", None
    if bool(mask.all()) or (causal and torch.equal(mask,
                                                   allowed(tq, tk, True, device=device).expand_as(mask))):
        return "plain", None
    return "masked", mask


def _whole(kind, q, k, v, causal, scale, impl, log):
    out, lse, ran = dense_forward(kind, q, k, v, causal, scale, impl, log)
    return out, lse, ran + (impl,)


def block_forward(q, k, v, causal: bool, scale: float, impl: str = "auto",
                  q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None, *,
                  docs: Optional[BlockDocuments] = None, kind: Optional[str] = None, log=None):
    """-> (out (B, Hq, Tq, D), lse (B, Hq, Tq) in fp32 (fp64 for fp64 q), ctx), or (None, None, ctx)
    when the documents leave no pair in the block. out is fp32 on the reference path, q.dtype on the
    fused one; ctx is what block_backward needs besides the tensors.

    The documents come either as `docs`, the block's host classification (documents.py: no host
    sync, no (Tq, Tk) tensor), or as device ids q_doc / k_doc (the dense mask, as before). `kind`
    is the kernel _choose picked (ring_attention chooses once per call)."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"block attention: a causal block must be square, got {q.shape[2]} queries and "
                         f"{k.shape[2]} keys")
    kind = kind or _choose(impl, q, log)
    if docs is not None:
        if docs.kind == "empty":
            return None, None, ("empty", None, impl)
        if docs.kind == "segments":
            out, lse, pctx = segments_forward(kind, q, k, v, causal, scale, docs, impl, log)
            return out, lse, ("segments", pctx, impl)
        if docs.kind == "plain":
            return _whole(kind, q, k, v, causal, scale, impl, log)
        raise ValueError(f"block_forward: documents of kind {docs.kind!r} need device ids (q_doc, k_doc)")
    state, mask = document_mask(q.shape[2], k.shape[2], causal, q_doc, k_doc, q.device)
    if state == "empty":
        return None, None, ("empty", None, impl)
    if state == "plain":
        return _whole(kind, q, k, v, causal, scale, impl, log)
    out, lse = reference_forward(q, k, v, scale, mask)
    return out, lse.to(acc_dtype(q)), ("torch", None, impl)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, ctx,
                   q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None, *,
                   docs: Optional[BlockDocuments] = None, log=None) -> Optional[Tuple[torch.Tensor, ...]]:
    """Gradients of this block for the FINAL out and lse of its query rows: (dq, dk, dv), dk and dv
    with Hkv heads (a group's G query heads summed); None for an empty block. `ctx` is what
    block_forward returned, and q_doc / k_doc / docs the same documents."""
    kind, extra, impl = ctx
    if kind == "empty":
        return None
    if kind == "segments":
        return segments_backward(extra, dout, q, k, v, out, lse, causal, scale, docs, impl, log)
    mask = None
    if kind == "torch" and q_doc is not None:
        mask = allowed(q.shape[2], k.shape[2], causal, q_doc, k_doc, q.device)
    return dense_backward((kind, extra), dout, q, k, v, out, lse, causal, scale, impl, log, mask=mask)
