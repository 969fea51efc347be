"""Context-parallel variants: ring attention over cp ranks against one process attending the whole
sequence with torch's SDPA and `enable_gqa=True` (no repeated K/V heads: the fair baseline).

What is timed: one attention forward + backward, q (1, 8, T, 64), k and v (1, 4, T, 64), fp32,
causal. Ring attention: each of the cp ranks holds its zigzag share (T/cp tokens) and K/V blocks
(and dK/dV in backward) hop round the ring; two more variants show what zigzag balancing and the
overlap of the next hop with this block's compute are worth (contiguous chunks; overlap off).
torch < 2.5 has no `enable_gqa`: the baseline then repeats the K/V heads and says so in its
result ("gqa": "repeat_interleave").

Bytes per rank per step (L = T/cp, fp32): forward (cp-1) x 2 L Hkv D 4, backward twice that.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import timed_world

CP = ["SDPA 1 process (enable_gqa)", "ring attention", "ring attention, no overlap",
      "ring attention, contiguous"]
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def _inputs(seq):
    g = torch.Generator().manual_seed(0)
    shapes = [(1, h, seq, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS)]
    q, k, v = (torch.randn(s, generator=g) for s in shapes)
    return q, k, v, torch.randn(shapes[0], generator=g)


def sdpa_gqa(q, k, v):
    """Causal SDPA with grouped K/V heads: enable_gqa where torch has it (>= 2.5)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), "enable_gqa"
    except TypeError:                                  # pragma: no cover - torch < 2.5
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                              is_causal=True), "repeat_interleave"


def cp_world(variant, size, steps):
    import minipar
    from minipar import ParallelismConfig, comm_ledger
    from minipar.context_parallel import ring_attention, zigzag_shard
    state = {}

    def build():
        q, k, v, dout = _inputs(size.cp_seq)
        if variant.startswith("SDPA"):
            def attend(x):
                out, state["gqa"] = sdpa_gqa(*x)
                return out
        else:
            cp = minipar.init(ParallelismConfig(cp_size=dist.get_world_size())).cp
            layout = "contiguous" if variant.endswith("contiguous") else "zigzag"
            overlap = not variant.endswith("no overlap")
            if layout == "zigzag":
                q, k, v, dout = (zigzag_shard(t, 2, cp) for t in (q, k, v, dout))
            else:
                q, k, v, dout = (t.chunk(cp.size, 2)[cp.rank].contiguous() for t in (q, k, v, dout))

            def attend(x):
                return ring_attention(*x, cp, causal=True, layout=layout, overlap=overlap)

        def step():
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            attend(x).backward(dout)
        state["step"] = step
        return step, extras

    def extras():
        with comm_ledger.ledger() as led:
            state["step"]()
        out = dict(comm={"send_recv": led.total_bytes("send_recv")} if variant.startswith("ring") else {})
        if "gqa" in state:
            out["gqa"] = state["gqa"]
        return out

    return timed_world(build, steps)
