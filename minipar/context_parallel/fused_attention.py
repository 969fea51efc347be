"""Which kernel attends a block: torch's fused attention kernels, or the reference math.

block_attention.py holds the math of one block (out, lse, and the six-step backward) in plain
torch. This file sends a block to torch's own kernels that also return the log-sum-exp, where the
device and dtype have one, and keeps the two calls the ring makes:

    block_forward(q, k, v, causal, scale, impl, q_doc, k_doc)  -> out, lse, ctx   (out None: empty)
    block_backward(dout, q, k, v, out, lse, causal, scale, ctx, q_doc, k_doc) -> dq, dk, dv

Implementations (`impl`):
    "fused"  on CPU aten._scaled_dot_product_flash_attention_for_cpu (+ _backward); on CUDA
             aten._scaled_dot_product_flash_attention (fp16/bf16) or _efficient_attention (fp32).
    "torch"  the reference math of block_attention.py (fp32, materialises the block's scores).
    "auto"   fused where the device and dtype have a kernel, torch otherwise.

Document masks (packed sequences). With document ids, each block is first classified: no pair
allowed -> the block is skipped (nothing computed, nothing merged); every pair the causal rule
allows is also same-document -> the kernel runs as without documents; otherwise the block runs
the reference math with its mask (the fused kernels here take no such mask).

The private aten ops are checked against the argument layout minipar passes before the first call
(`_signature_ok`), so a torch release that changes one falls back to the reference ("auto")
instead of calling it with shifted arguments. A fused kernel's `is_causal` on a non-square block
means different things in different kernels (upper-left vs lower-right), so the ring schedule
never asks for one.

GQA without copies where possible: an unmasked block folds the G query heads of a group into the
row dimension, (B, Hkv, G*Tq, D), and attends the Hkv heads as they are; only the causal square
block (whose mask depends on the row) expands K/V to Hq heads, inside this call, and sums the
key/value gradients of a group back.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .block_attention import acc_dtype, allowed, reference_backward, reference_forward

IMPLS = ("auto", "fused", "torch")
_CPU_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# The private aten ops each kernel calls, with the number of positional arguments we pass and of
# results we read. These layouts hold from torch 2.4 to 2.13 (2.7 renamed flash's philox_seed /
# philox_offset results to rng_state / unused, same positions, so we pass them on positionally,
# never by name); `scale` is keyword-only in all of them.
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


# ------------------------------------------------------------------------------- the aten calls
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


# ------------------------------------------------------------------------------- the two calls
def document_mask(tq: int, tk: int, causal: bool, q_doc, k_doc, device=None):
    """-> ("empty", None): no pair may attend; ("plain", None): the documents cut nothing the causal
    rule allows (a kernel may run as without them); ("masked", mask (B, Tq, Tk) bool)."""
    if q_doc is None:
        return "plain", None
    mask = allowed(tq, tk, causal, q_doc, k_doc, device)
    if not bool(mask.any()):
        return "empty", None
    if bool(mask.all()) or (causal and torch.equal(mask,
                                                   allowed(tq, tk, True, device=device).expand_as(mask))):
        return "plain", None
    return "masked", mask


def block_forward(q, k, v, causal: bool, scale: float, impl: str = "auto",
                  q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None):
    """-> (out (B, Hq, Tq, D), lse (B, Hq, Tq) in fp32 (fp64 for fp64 q), ctx), or (None, None, ctx)
    when the documents leave no pair in the block. out is fp32 on the reference path, q.dtype on the
    fused one; ctx is what block_backward needs besides the tensors (which path ran, its rng state)."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"block attention: a causal block must be square, got {q.shape[2]} queries and "
                         f"{k.shape[2]} keys")
    kind = _choose(impl, q)
    docs, mask = document_mask(q.shape[2], k.shape[2], causal, q_doc, k_doc, q.device)
    if docs == "empty":
        return None, None, ("empty", None, impl)
    if docs == "plain" and kind != "torch":
        try:
            out, lse, extra = _fused_block_forward(kind, q, k, v, causal, scale)
            return out, lse, (kind, extra, impl)
        except RuntimeError as err:
            if impl == "fused" or isinstance(err, torch.cuda.OutOfMemoryError):
                raise
            # "auto": a kernel that exists but refuses this shape or GPU falls back to the reference
    if mask is None:
        mask = allowed(q.shape[2], k.shape[2], causal, device=q.device)
    out, lse = reference_forward(q, k, v, scale, mask)
    return out, lse.to(acc_dtype(q)), ("torch", None, impl)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float, ctx,
                   q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None
                   ) -> Optional[Tuple[torch.Tensor, ...]]:
    """Gradients of this block for the FINAL out and lse of its query rows: (dq, dk, dv), dk and dv
    with Hkv heads (a group's G query heads summed); None for an empty block. `ctx` is what
    block_forward returned, and q_doc / k_doc the same document ids."""
    kind, extra, impl = ctx
    if kind == "empty":
        return None
    if kind != "torch":
        try:
            return _fused_block_backward(kind, extra, dout, q, k, v, out, lse, causal, scale)
        except RuntimeError as err:
            if impl == "fused" or isinstance(err, torch.cuda.OutOfMemoryError):
                raise
            # "auto": the reference backward needs nothing from the forward kernel but the final lse
    mask = allowed(q.shape[2], k.shape[2], causal, q_doc, k_doc, q.device)
    return reference_backward(dout, q, k, v, out, lse, scale, mask)


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
