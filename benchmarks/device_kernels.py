"""The device check's attention step: every block shape of ring attention through the block kernels.

    attention_step(device)  every block shape ring attention produces, through block_forward /
                            block_backward (minipar/context_parallel/document_attention.py) in the
                            compute dtype, against the fp32 math path (block_attention.py's
                            reference), with the kernel each block took and why (kernel_choice.py):

        shape                  q rows x k columns   mask
        causal square          L x L                lower triangle           (the diagonal step)
        zigzag, s < r          L x L/2              none (all keys earlier)  q [a b] x k0
        zigzag, s > r          L/2 x L              none                     q [b] x [k0 k1]
        documents, causal      L x L                causal, within documents (packed; one of them a
                                                    single token): the varlen call on CUDA in bf16
        documents, s > r       L/2 x L              within documents         (a document crosses
                                                    the block's edge)

Tolerances: relative to the reference's largest value, 2e-2 in bf16 (8 bits of mantissa), 1e-5 in
fp32 (a fused kernel sums in another order).
"""
from __future__ import annotations

import torch

from minipar.context_parallel import AttentionLog, choose_kernel
from minipar.context_parallel import block_attention as ref
from minipar.context_parallel.document_attention import block_backward, block_forward
from minipar.context_parallel.documents import classify_block
from minipar.context_parallel.fused_attention import default_scale

TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _blocks(L: int):
    """(name, tq, tk, causal, packed) of every block shape."""
    return [("causal square", L, L, True, False), ("zigzag s<r: q [a b] x k0", L, L // 2, False, False),
            ("zigzag s>r: q [b] x [k0 k1]", L // 2, L, False, False), ("documents, causal", L, L, True, True),
            ("documents, s>r", L // 2, L, False, True)]


def _docs(t: int, b: int, first: int = 1) -> torch.Tensor:
    """(b, t) host ids of three documents: `first` tokens, then a third of the rest, then the rest."""
    ids = torch.zeros(t, dtype=torch.long)
    ids[first:] = 1
    ids[first + (t - first) // 3:] = 2
    return ids.expand(b, t).contiguous()


def attention_step(device: torch.device, small: bool = False) -> dict:
    b, hq, hkv, L, d = (1, 4, 2, 64, 16) if small else (1, 32, 8, 4096, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    scale = default_scale(d, None)
    rows = []
    for name, tq, tk, causal, packed in _blocks(L):
        g = torch.Generator().manual_seed(tq + tk)
        q = torch.randn(b, hq, tq, d, generator=g).to(device, dtype)
        k, v = (torch.randn(b, hkv, tk, d, generator=g).to(device, dtype) for _ in "kv")
        dout = torch.randn(b, hq, tq, d, generator=g).to(device, dtype)
        # the s > r block's rows are the late half [b] of this rank: their documents continue the keys'
        k_ids = _docs(tk, b) if packed else None
        q_ids = (k_ids if causal else k_ids[:, tk - tq:]) if packed else None
        docs = classify_block(q_ids, k_ids, causal) if packed else None
        log = AttentionLog(echo=False)
        out, lse, ctx = block_forward(q, k, v, causal, scale, "auto", docs=docs, log=log)
        grads = block_backward(dout, q, k, v, out, lse, causal, scale, ctx, docs=docs, log=log)
        mask = ref.allowed(tq, tk, causal, *((q_ids.to(device), k_ids.to(device)) if packed else ()),
                           device=device)
        f32 = [x.float() for x in (q, k, v)]
        want_out, want_lse = ref.reference_forward(*f32, scale, mask)
        want_grads = ref.reference_backward(dout.float(), *f32, want_out, want_lse, scale, mask)
        err = 0.0
        for got, want in zip((out, lse) + tuple(grads), (want_out, want_lse) + tuple(want_grads)):
            seen = torch.isfinite(want)          # rows that see no key: lse -inf on both paths
            zero = torch.zeros_like(want)
            diff = (got.float() - want).where(seen, zero).abs().max()
            err = max(err, (diff / want.where(seen, zero).abs().max().clamp_min(1e-12)).item())
        kernels = "; ".join(f"{path}: {kind} ({why})" for path, kind, why in log.entries) or \
            f"{choose_kernel('auto', device, dtype, d).kind}"
        rows.append(dict(name=f"{name} {str(dtype).replace('torch.', '')}", ok=err <= TOL[dtype], max_err=err,
                         tol=TOL[dtype], kernel=str(ctx[0]), detail=f"q {tq} x k {tk}; {kernels}"))
    return dict(rows=rows)
