"""Which kernel attends a dense block: torch's fused attention kernels, or the reference math.

block_attention.py holds the math of one block (out, lse, and the six-step backward) in plain
torch. This file sends a block without documents to torch's own kernels that also return the
log-sum-exp, where the device and dtype have one (kernel_choice.py picks and reports it):

    dense_forward(kind, q, k, v, causal, scale, impl, log)  -> out, lse, ran
    dense_backward(ran, dout, q, k, v, out, lse, causal, scale, impl, log) -> dq, dk, dv

Kernels (`kind`):
    "cpu"             aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)
    "cuda_flash"      aten._scaled_dot_product_flash_attention (fp16/bf16)
    "cuda_efficient"  aten._scaled_dot_product_efficient_attention (fp32, or forced)
    "torch"           the reference math of block_attention.py (materialises the block's scores)

A kernel that refuses a call falls back to the reference math only where kernel_choice's
may_fall_back allows it (auto; on CUDA only "not supported" refusals), and the log says so.
document_attention.py runs blocks with packed documents on top of these two calls.

The private aten ops are checked against the argument layout minipar passes before the first call
(`signature_ok`), so a torch release that changes one falls back to the reference ("auto")
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
from typing import Optional

import torch

from .block_attention import acc_dtype, allowed, reference_backward, reference_forward
from .kernel_choice import IMPLS, choose_kernel, may_fall_back, note

__all__ = ["IMPLS", "dense_forward", "dense_backward", "default_scale"]



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
    # the varlen flash-attention ops under torch.nn.attention.varlen.varlen_attn (document_attention.py);
    # their results: (out, lse, philox_seed, philox_offset, debug) before 2.7, (out, lse, rng_state,
    # unused, debug) since: passed on positionally
    "cuda_varlen": (("_flash_attention_forward", 10, 5),
                    ("_flash_attention_backward", 14, 3)),
}


def signature_ok(kind: str) -> bool:
    """Whether torch's ops for `kind` take the arguments minipar passes (positional count, results,
    keyword `scale`)."""
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


def _choose(impl: str, q: torch.Tensor, log=None, path: str = "ring") -> str:
    """The kernel kind for this call (kernel_choice.choose_kernel), "torch" when the aten op's layout
    is not the one minipar calls (a forced kernel is then refused)."""
    kind, reason = choose_kernel(impl, q.device, q.dtype, q.shape[-1])
    if kind != "torch" and not signature_ok(kind):
        if impl != "auto":
            raise ValueError(f"attention_backend {impl}: torch {torch.__version__} lacks the {kind} "
                             f"attention kernel, or its signature differs from the one minipar calls; use "
                             f"auto or math")
        kind, reason = "torch", (f"torch {torch.__version__}: the {kind} op's signature differs; the "
                                 f"reference math")
    note(log, path, kind, reason)
    return kind


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


# ------------------------------------------------------------------------------- one dense block
def dense_forward(kind, q, k, v, causal: bool, scale: float, impl: str, log=None, path: str = "ring"):
    """One block without documents on `kind`'s kernel, or the reference math (kind "torch", or a
    fallback kernel_choice.may_fall_back allows, noted in `log`). -> out, lse, (kind ran, extra)."""
    if kind != "torch":
        try:
            out, lse, extra = _fused_block_forward(kind, q, k, v, causal, scale)
            return out, lse, (kind, extra)
        except RuntimeError as err:
            if not may_fall_back(err, q.device, impl):
                raise
            note(log, path, "torch", f"{kind} refused a ({q.shape[2]} x {k.shape[2]}) block: "
                                     f"{str(err).splitlines()[0][:120]}", fallback=True)
    mask = allowed(q.shape[2], k.shape[2], True, device=q.device) if causal else None
    out, lse = reference_forward(q, k, v, scale, mask)
    return out, lse.to(acc_dtype(q)), ("torch", None)


def dense_backward(ran, dout, q, k, v, out, lse, causal: bool, scale: float, impl: str, log=None,
                   path: str = "ring", mask=None):
    """The gradients of one dense block (dense_forward's `ran` says which kernel made it)."""
    kind, extra = ran
    if kind != "torch":
        try:
            return _fused_block_backward(kind, extra, dout, q, k, v, out, lse, causal, scale)
        except RuntimeError as err:
            if not may_fall_back(err, q.device, impl):
                raise
            # the reference backward needs nothing from the forward kernel but the final lse
            note(log, path, "torch", f"{kind} backward refused a ({q.shape[2]} x {k.shape[2]}) block: "
                                     f"{str(err).splitlines()[0][:120]}", fallback=True)
    if mask is None and causal:
        mask = allowed(q.shape[2], k.shape[2], True, device=q.device)
    return reference_backward(dout, q, k, v, out, lse, scale, mask)


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
