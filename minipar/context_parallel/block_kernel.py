"""The block kernel: what attends one query block to one visiting K/V block, chosen by the caller
and handed to the ring (ring_attention.py moves K/V and merges (o, lse); it never asks which
kernel runs, nor whether documents cut a block).

    kernel = BlockKernel(impl="auto", documents=None, scale=None, log=None)     the caller's choice
    out = ring_attention(q, k, v, cp, kernel, causal=True, layout="zigzag")

Inside the call (a graph boundary under torch.compile, so the host-side choice is never traced)
the ring binds it to its tensors and group once, `blocks = kernel.bind(q, cp, layout)`, and asks,
for each block b = Block(q0, q1, k0, k1, causal) of the K/V of rank src:

    blocks.travelling                        (B, L) ids that travel round the ring with K/V, or None
    blocks.forward(q, k, v, b, src, ids)     -> (o_b, l_b, ctx), or (None, None, ctx): no pair attends
    blocks.backward(ctx, dout, q, k, v, out, lse, b, src, ids)  -> (dq, dk, dv), or None
                                             (q, k, v, out, lse, dout: the block's slices; ids: the
                                             travelling ids of src's share, as they arrived)

Its kinds, by `documents`:
    None         plain: the dense kernel (fused_attention.py) on every block, chosen once per call
                 from impl, device, dtype and head_dim (kernel_choice.py) and noted in `log`
    Documents    packed documents by their boundaries (documents.py, on the host): each block
                 classified without communication, then skipped, run whole, cut into per-document
                 sub-blocks, or one varlen flash call on CUDA (document_attention.py); nothing travels
                 and no (L, L) mask exists
    a tensor     this rank's (B, L) integer ids on the device: they travel with K/V (one more small
                 message per hop, B * L ids) and each block is masked densely; the reference the
                 Documents path is tested against

Bad input raises a ValueError, on every rank before any communication: impl not one of
kernel_choice.IMPLS (at construction), Documents that do not cover the sequence (B, L * cp) or were
cut in another layout, device ids that are not (B, L) integers (at bind).
"""
from __future__ import annotations

from typing import Optional

import torch

from .document_attention import block_backward, block_forward
from .documents import Documents
from .fused_attention import _choose, default_scale
from .kernel_choice import IMPLS, AttentionLog


class BlockKernel:
    """The caller's choice of block kernel: impl (kernel_choice.IMPLS), the documents (None, a
    `Documents`, or device ids), the softmax scale (None: 1/sqrt(head_dim)), the log the kernel
    used is noted in. Plain settings: making one runs no torch op."""

    def __init__(self, impl: str = "auto", documents=None, scale: Optional[float] = None,
                 log: Optional[AttentionLog] = None):
        if impl not in IMPLS:
            raise ValueError(f"ring attention: impl (the attention_backend) must be one of {IMPLS}, "
                             f"got impl={impl!r}")
        self.impl, self.documents, self.scale, self.log = impl, documents, scale, log

    def bind(self, q: torch.Tensor, cp, layout: str) -> "BoundBlocks":
        """This call's blocks: q (B, Hq, L, D) this rank's queries, cp the ring's group, layout the
        sequence split (layouts.py). Checks the documents against them (ValueError)."""
        b, n = q.shape[0], q.shape[2]
        host, ids = None, self.documents
        if isinstance(ids, Documents):
            host, ids = ids, None
            if tuple(host.shape) != (b, n * cp.size):
                raise ValueError(f"ring_attention: Documents of shape {tuple(host.shape)} do not cover the "
                                 f"sequence (B, L * cp) = {(b, n * cp.size)}")
            if cp.size > 1 and host.layout != layout:
                raise ValueError(f"ring_attention: Documents cut in the {host.layout} layout, the ring runs "
                                 f"{layout}: build them with the layout the data was sharded in")
        if ids is not None:
            if tuple(ids.shape) != (b, n) or ids.dtype.is_floating_point:
                raise ValueError(f"ring_attention: document_ids must be integer ids of shape (B, L) = "
                                 f"{(b, n)}, got {ids.dtype} {tuple(ids.shape)}")
            ids = ids.to(q.device).contiguous()
        kind = _choose(self.impl, q, self.log)               # once per call: every block the same
        return BoundBlocks(self, cp, kind, default_scale(q.shape[-1], self.scale), host, ids)


class BoundBlocks:
    """One call's blocks (BlockKernel.bind): the kernel kind, the scale, the documents."""

    def __init__(self, kernel: BlockKernel, cp, kind: str, scale: float, host, ids):
        self.impl, self.log, self.cp, self.kind, self.scale = kernel.impl, kernel.log, cp, kind, scale
        self.host = host                        # Documents, or None
        self.travelling = ids                   # this rank's device ids, sent round with K/V, or None

    def forward(self, q, k, v, b, src: int, ids):
        q_doc, k_doc, cls = self._documents(b, src, ids)
        return block_forward(q, k, v, b.causal, self.scale, self.impl, q_doc, k_doc, docs=cls,
                             kind=self.kind, log=self.log)

    def backward(self, ctx, dout, q, k, v, out, lse, b, src: int, ids):
        q_doc, k_doc, cls = self._documents(b, src, ids)
        return block_backward(dout, q, k, v, out, lse, b.causal, self.scale, ctx, q_doc, k_doc, docs=cls,
                              log=self.log)

    def _documents(self, b, src: int, ids):
        """The documents of block b (the K/V of rank src) as block_forward takes them: (q_doc, k_doc,
        classification). Host `Documents`: the block's classification, made once per micro-batch (and
        the device ids only for a "dense" one); device ids: this rank's rows and the travelling columns."""
        host, cp = self.host, self.cp
        if host is not None:
            cls = host.block(cp.rank, src, cp.size, b.q0, b.q1, b.k0, b.k1, b.causal)
            if cls.kind != "dense":
                return None, None, cls
            device = host.local.device if host.local is not None else "cpu"
            return (host.device_share(cp.rank, cp.size, device)[:, b.q0:b.q1],
                    host.device_share(src, cp.size, device)[:, b.k0:b.k1], None)
        if self.travelling is None:
            return None, None, None
        return self.travelling[:, b.q0:b.q1], ids[:, b.k0:b.k1], None
