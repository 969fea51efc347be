"""Attention of one query block against one key/value block, returning the log-sum-exp.

Ring attention (ring_attention.py) never sees the whole score matrix: it attends its queries to
one K/V block at a time and merges the partial results. To merge, each block must hand back not
only its softmax-normalised output but the log of its softmax denominator, per query row:

    q (B, Hq, Tq, D)    k, v (B, Hkv, Tk, D)    Hq = G * Hkv  (grouped-query attention)

    S   = scale * q k^T                       (B, Hq, Tq, Tk)   the scores
    lse = log sum_j exp S[.., j]              (B, Hq, Tq)       fp32
    out = exp(S - lse) v                      (B, Hq, Tq, D)

and the backward of a block, given the FINAL output and lse of the row (after all blocks were
merged), is the flash-attention backward restricted to this block (Dao et al., FlashAttention, 2022):

    P  = exp(S - lse)           the block's slice of the true softmax
    Di = rowsum(dout * out)     (B, Hq, Tq)
    dv = P^T dout      dS = P * (dout v^T - Di)      dq = scale dS k      dk = scale dS^T q

Two masks only, by design of the ring schedule: none, or causal on a square block (Tq == Tk,
query i sees keys 0..i). A fused kernel's `is_causal` on a non-square block means different
things in different kernels (upper-left vs lower-right), so the schedule never asks for one.

Implementations (`impl`):
    "fused"  torch's own kernels that return the lse: on CPU
             aten._scaled_dot_product_flash_attention_for_cpu (+ _backward); on CUDA
             aten._scaled_dot_product_flash_attention (fp16/bf16) or _efficient_attention.
    "torch"  plain matmuls in fp32, the readable reference (materialises the block's scores).
    "auto"   fused where the device and dtype have a kernel, torch otherwise.

GQA without copies where possible: an unmasked block folds the G query heads of a group into the
row dimension, (B, Hkv, G*Tq, D), and attends the Hkv heads as they are; only the causal square
block (whose mask depends on the row) expands K/V to Hq heads, inside this call, and sums the
key/value gradients of a group back. The plain path broadcasts over G and never copies K/V.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

IMPLS = ("auto", "fused", "torch")
_CPU_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# The private aten ops each kernel calls, with the number of positional arguments we pass and of
# results we read. These layouts hold from torch 2.4 to 2.13 (2.7 renamed flash's philox_seed /
# philox_offset results to rng_state / unused, same positions, so we pass them on positionally,
# never by name); `scale` is keyword-only in all of them. A release that changes a layout falls
# back to plain torch ("auto") instead of calling the op with shifted arguments.
_FUSED_OPS = {
    "cpu": (("_scaled_dot_product_flash_attention_for_cpu", 5, 2),
            ("_scaled_dot_product_flash_attention_for_cpu_backward", 8, 3)),
    "cuda_flash": (("_scaled_dot_product_flash_attention", 6, 9),
                   ("_scaled_dot_product_flash_attention_backward", 14, 3)),
    "cuda_efficient": (("_scaled_dot_product_efficient_attention", 7, 4),
                       ("_scaled_dot_product_efficient_attention_backward", 12, 4)),
}


def _signature_ok(kind: str) -> bool:
    for name, n_args, n_returns in _FUSED_OPS[kind]:
        op = getattr(torch.ops.aten, name, None)
        if op is None:
            return False
        schema = op.default._schema
        positional = [a for a in schema.arguments if not a.kwarg_only]
        keywords = {a.name for a in schema.arguments if a.kwarg_only}
        if len(positional) != n_args or len(schema.returns) != n_returns or "scale" not in keywords:
            return False
    return True


def _choose(impl: str, q: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return "torch"
    kind = None
    if q.device.type == "cpu" and q.dtype in _CPU_FUSED_DTYPES:
        kind = "cpu"
    elif q.device.type == "cuda" and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        if q.dtype in (torch.float16, torch.bfloat16):
            kind = "cuda_flash"
        elif q.dtype == torch.float32:
            kind = "cuda_efficient"
    if kind is not None and not _signature_ok(kind):
        if impl == "fused":
            raise ValueError(f"impl='fused': torch {torch.__version__} lacks the {kind} attention kernel, or "
                             f"its signature differs from the one minipar calls; use impl='auto' or 'torch'")
        return "torch"
    if kind is None and impl == "fused":
        raise ValueError(f"no fused attention kernel for device {q.device.type}, dtype {q.dtype}, head_dim "
                         f"{q.shape[-1]}: use impl='torch' or impl='auto'")
    return kind or "torch"


def _fold(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, G*Hkv, T, D) -> (B, Hkv, G*T, D): the G query heads of a group become extra rows."""
    b, h, t = x.shape[:3]
    return x.reshape(b, hkv, (h // hkv) * t, *x.shape[3:])


def _unfold(x: torch.Tensor, hq: int) -> torch.Tensor:
    b, hkv, gt = x.shape[:3]
    return x.reshape(b, hq, gt // (hq // hkv), *x.shape[3:])


def _expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    b, hkv, t, d = x.shape
    return x[:, :, None].expand(b, hkv, hq // hkv, t, d).reshape(b, hq, t, d)


# ------------------------------------------------------------------------------- fused kernels
def _fused_fwd(kind, q, k, v, causal, scale):
    aten = torch.ops.aten
    if kind == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    if kind == "cuda_flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1], (res[2], res[3], res[6], res[7])
    res = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    # the memory-efficient kernel pads the lse rows (to 32 on CUDA, not on ROCm): keep the real
    # ones, and remember the width, since its backward reads the padded layout
    return res[0], res[1][..., : q.shape[2]], (res[2], res[3], res[1].shape[-1])


def _fused_bwd(kind, dout, q, k, v, out, lse, causal, scale, extra):
    aten = torch.ops.aten
    if kind == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if kind == "cuda_flash":
        cum_q, cum_k, seed, offset = extra
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
            scale=scale)
    seed, offset, width = extra
    padded = lse.new_zeros(lse.shape[:-1] + (width,))
    padded[..., : q.shape[2]] = lse
    grads = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return grads[0], grads[1], grads[2]


# ------------------------------------------------------------------------------- plain torch
def _acc_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def _torch_scores(q, k, causal, scale):
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    acc = _acc_dtype(q)
    qg = q.to(acc).reshape(b, hkv, hq // hkv, tq, d)               # (B, Hkv, G, Tq, D)
    s = torch.matmul(qg, k.to(acc)[:, :, None].transpose(-1, -2)) * scale   # (B, Hkv, G, Tq, Tk)
    if causal:
        mask = torch.ones(tq, k.shape[2], dtype=torch.bool, device=q.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _torch_fwd(q, k, v, causal, scale):
    b, hq, tq, d = q.shape
    s = _torch_scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    out = torch.matmul(p, v.to(s.dtype)[:, :, None])                # (B, Hkv, G, Tq, D)
    return out.reshape(b, hq, tq, -1), lse.reshape(b, hq, tq)


def _torch_bwd(dout, q, k, v, out, lse, causal, scale):
    b, hq, tq, d = q.shape
    hkv = k.shape[1]
    s = _torch_scores(q, k, causal, scale)
    acc = s.dtype
    grp = (b, hkv, hq // hkv, tq)
    p = torch.exp(s - lse.to(acc).reshape(grp)[..., None])
    do = dout.to(acc).reshape(*grp, -1)
    delta = (do * out.to(acc).reshape(*grp, -1)).sum(-1, keepdim=True)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)               # (B, Hkv, Tk, D)
    dp = torch.matmul(do, v.to(acc)[:, :, None].transpose(-1, -2))
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, k.to(acc)[:, :, None]).reshape(b, hq, tq, d)
    dk = torch.matmul(ds.transpose(-1, -2), q.to(acc).reshape(*grp, d)).sum(2)
    return dq, dk, dv


# ------------------------------------------------------------------------------- the two calls
def block_forward(q, k, v, causal: bool, scale: float, impl: str = "auto"):
    """-> (out (B, Hq, Tq, D), lse (B, Hq, Tq) in fp32 (fp64 for fp64 q), ctx). out is fp32 on the
    torch path, q.dtype on the fused one; ctx is what block_backward needs besides the tensors
    (which kernel ran, its rng state)."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"block attention: a causal block must be square, got {q.shape[2]} queries and "
                         f"{k.shape[2]} keys")
    kind = _choose(impl, q)
    if kind != "torch":
        try:
            out, lse, extra = _fused_block_forward(kind, q, k, v, causal, scale)
            return out, lse, (kind, extra, impl)
        except RuntimeError as err:
            if impl == "fused" or isinstance(err, torch.cuda.OutOfMemoryError):
                raise
            # "auto": a kernel that exists but refuses this shape or GPU falls back to plain torch
    out, lse = _torch_fwd(q, k, v, causal, scale)
    return out, lse.to(_acc_dtype(q)), ("torch", None, impl)


def _fused_block_forward(kind, q, k, v, causal, scale):
    hq, hkv = q.shape[1], k.shape[1]
    if hq == hkv:
        out, lse, extra = _fused_fwd(kind, q, k, v, causal, scale)
    elif causal:
        out, lse, extra = _fused_fwd(kind, q, _expand_kv(k, hq), _expand_kv(v, hq), causal, scale)
    else:
        out, lse, extra = _fused_fwd(kind, _fold(q, hkv), k, v, False, scale)
        out, lse = _unfold(out, hq), _unfold(lse, hq)
    return out, lse, extra


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, ctx) -> Tuple[torch.Tensor, ...]:
    """Gradients of this block for the FINAL out and lse of its query rows: (dq, dk, dv), dk and dv
    with Hkv heads (a group's G query heads summed). `ctx` is what block_forward returned."""
    kind, extra, impl = ctx
    if kind != "torch":
        try:
            return _fused_block_backward(kind, extra, dout, q, k, v, out, lse, causal, scale)
        except RuntimeError as err:
            if impl == "fused" or isinstance(err, torch.cuda.OutOfMemoryError):
                raise
            # "auto": the plain backward needs nothing from the forward kernel but the final lse
    return _torch_bwd(dout, q, k, v, out, lse, causal, scale)


def _fused_block_backward(kind, extra, dout, q, k, v, out, lse, causal, scale):
    hq, hkv = q.shape[1], k.shape[1]
    out, dout = out.to(q.dtype), dout.to(q.dtype)
    lse = lse.contiguous()        # a sliced lse (second-half queries) is not; the kernels index it flat
    if hq == hkv:
        return _fused_bwd(kind, dout, q, k, v, out, lse, causal, scale, extra)[:3]
    if causal:
        dq, dk, dv = _fused_bwd(kind, dout, q, _expand_kv(k, hq), _expand_kv(v, hq), out, lse, causal, scale,
                                extra)[:3]
        b, _, t, d = dk.shape
        return dq, dk.reshape(b, hkv, hq // hkv, t, d).sum(2), dv.reshape(b, hkv, hq // hkv, t, d).sum(2)
    dq, dk, dv = _fused_bwd(kind, _fold(dout, hkv), _fold(q, hkv), k, v, _fold(out, hkv),
                            _fold(lse, hkv).contiguous(), False, scale, extra)[:3]
    return _unfold(dq, hq), dk, dv


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
