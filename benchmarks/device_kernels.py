"""The device check's kernel steps: the attention block kernels, and the host syncs of a step.

    attention_step(device)  every block shape ring attention produces, through block_forward /
                            block_backward (minipar/context_parallel/fused_attention.py) in the
                            compute dtype, against the fp32 math path (block_attention.py's
                            reference), with the kernel each block took:

        shape             q rows x k columns     mask
        causal square     L x L                  lower triangle            (the diagonal step)
        zigzag, s < r     L x L/2                none (all keys earlier)   q [a b] x k0
        zigzag, s > r     L/2 x L                none                      q [b] x [k0 k1]
        documents         L x L                  causal, within documents  (packed examples)

    syncs_step(device)      (see its docstring)

Tolerances: relative to the reference's largest value, 2e-2 in bf16 (8 bits of mantissa), 1e-5 in
fp32 (a fused kernel sums in another order).
"""
from __future__ import annotations

import torch

from minipar.context_parallel import block_attention as ref
from minipar.context_parallel import fused_attention as fused

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _blocks(L: int):
    """(name, tq, tk, causal, documents?) of every block shape."""
    return [("causal square", L, L, True, False), ("zigzag s<r: q [a b] x k0", L, L // 2, False, False),
            ("zigzag s>r: q [b] x [k0 k1]", L // 2, L, False, False), ("documents", L, L, True, True)]


def _docs(t: int, b: int, device) -> torch.Tensor:
    """Three documents, one of them a single token, cutting the block unevenly."""
    cuts = [1, t // 3 + 1, t]
    ids = torch.zeros(t, dtype=torch.long)
    for i, c in enumerate(cuts[:-1]):
        ids[c:] = i + 1
    return ids.expand(b, t).contiguous().to(device)


def attention_step(device: torch.device, small: bool = False) -> dict:
    b, hq, hkv, L, d = (1, 4, 2, 64, 16) if small else (1, 32, 8, 4096, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = fused.default_scale(d, None)
    rows = []
    for name, tq, tk, causal, packed in _blocks(L):
        g = torch.Generator().manual_seed(tq + tk)
        q = torch.randn(b, hq, tq, d, generator=g).to(device, dtype)
        k, v = (torch.randn(b, hkv, tk, d, generator=g).to(device, dtype) for _ in "kv")
        q_doc = _docs(tq, b, device) if packed else None
        k_doc = q_doc if packed else None
        out, lse, ctx = fused.block_forward(q, k, v, causal, scale, "auto", q_doc, k_doc)
        mask = ref.allowed(tq, tk, causal, q_doc, k_doc, device)
        f32 = [x.float() for x in (q, k, v)]
        want_out, want_lse = ref.reference_forward(*f32, scale, mask)
        dout = torch.randn(out.shape, generator=g).to(device, dtype)
        grads = fused.block_backward(dout, q, k, v, out, lse, causal, scale, ctx, q_doc, k_doc)
        want_grads = ref.reference_backward(dout.float(), *f32, want_out, want_lse, scale, mask)
        err = 0.0
        for got, want in zip((out, lse) + tuple(grads), (want_out, want_lse) + tuple(want_grads)):
            err = max(err, ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
        rows.append(dict(name=f"{name} {str(dtype).replace('torch.', '')}", ok=err <= TOL[dtype], max_err=err,
                         tol=TOL[dtype], kernel=str(ctx[0]), detail=f"kernel {ctx[0]}; q {tq} x k {tk}"))
    return dict(rows=rows)


def syncs_step(device: torch.device, small: bool = False) -> dict:
    raise NotImplementedError("the sync count step is added with the sync counter")
