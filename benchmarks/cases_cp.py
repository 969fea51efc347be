"""Context-parallel variants: ring attention, Ulysses and USP over cp ranks against one process
attending the whole sequence with torch's SDPA and `enable_gqa=True` (no repeated K/V heads: the
fair baseline).

What is timed: one attention forward + backward, q (1, 8, T, 64), k and v (1, 4, T, 64), fp32,
causal, at T = the size's cp_seq (2048, 4096, 8192; --quick: 512). Ring attention: each of the cp
ranks holds its zigzag share (T/cp tokens) and K/V blocks (and dK/dV in backward) hop round the
ring; two more variants show what zigzag balancing and the overlap of the next hop with this
block's compute are worth (contiguous chunks; overlap off). Ulysses (cp_impl ulysses): two
all-to-alls over the cp ranks turn the sequence split into a head split and back around local
attention. USP (cp_impl usp, u = 2): Ulysses inside groups of 2 consecutive cp ranks, ring
attention over the cp/2 groups; at cp 2 it would be Ulysses itself, so it runs at cp >= 4 only
(`runs_at`). torch < 2.5 has no `enable_gqa`: the baseline then repeats the K/V heads and says so
in its result ("gqa": "repeat_interleave").

Bytes per rank per step from the comm ledger (minipar/comm.py), as handed to the collectives
("comm": send_recv, all_to_all) and as put on the wire ("wire": an all-to-all keeps 1/u of its
buffer). With L = T/cp, e = 4, Hq = 8, Hkv = 4, D = 64 (context_parallel/ulysses.py's docstring):

    ring      send_recv   forward (cp-1) x 2 L Hkv D e, backward twice that
    ulysses   all_to_all  8 buffers (q, k, v, out; dout, dq, dk, dv): 4 L Hq D e + 4 L f Hkv D e,
                          f = u / gcd(Hkv, u) KV repeats (1 here for u <= 4); wire (u-1)/u of it
    usp       both: the all-to-alls over u, and the ring over cp/u groups on u L tokens and
              f Hkv / u heads (the same bytes per hop as the cp ring, cp/u - 1 hops)
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import timed_world

CP = ["SDPA 1 process (enable_gqa)", "ring attention", "ring attention, no overlap",
      "ring attention, contiguous", "ulysses attention", "usp attention (ulysses 2 x ring)"]
HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64
USP_ULYSSES = 2


def planner_bytes(variant, seq, ranks):
    """What the planner (minipar/plan/collective_counts.py, cp_attention) counts for this cell's one attention
    forward + backward, {op: bytes}, to print beside the ledger's; {} for the one-process baseline."""
    from minipar.plan.collective_counts import cp_attention
    from minipar.plan.inputs import Batch, Layout, ModelShape, Options
    if variant.startswith("SDPA"):
        return {}
    impl = variant.split()[0]
    model = ModelShape(vocab_size=256, hidden_size=HEADS * HEAD_DIM, intermediate_size=HEADS * HEAD_DIM,
                       num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM)
    layout = Layout(cp=ranks, cp_impl=impl, cp_ulysses_size=USP_ULYSSES if impl == "usp" else None)
    u, out = layout.ulysses_size(), {}
    sizes = {"cp": ranks, "cp_ulysses": u, "cp_ring": ranks // u}    # a group of one sends nothing

    def add(op, group, calls, nbytes):
        if calls and sizes[group] > 1:
            out[op] = out.get(op, 0) + calls * nbytes
    cp_attention(add, model, layout, Batch(1, 1, seq), Options(dtype="float32"), layers=1, recomputed=0)
    return out


def runs_at(variant, ranks):
    """USP with u = 2 needs a ring of at least 2 groups: cp >= 4 (at cp 2 it is Ulysses)."""
    return not variant.startswith("usp") or ranks >= 2 * USP_ULYSSES


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
    from minipar.context_parallel import BlockKernel, RingKnobs, ring_attention, zigzag_shard
    from minipar.context_parallel.ulysses import ulysses_attention
    state = {}

    def build():
        q, k, v, dout = _inputs(size.cp_seq)
        if variant.startswith("SDPA"):
            def attend(x):
                out, state["gqa"] = sdpa_gqa(*x)
                return out
        else:
            impl = variant.split()[0]                       # ring, ulysses or usp
            u = {"ring": None, "ulysses": None, "usp": USP_ULYSSES}[impl]
            pgm = minipar.init(ParallelismConfig(cp_size=dist.get_world_size(), cp_impl=impl,
                                                 cp_ulysses_size=u))
            cp = pgm.cp
            layout = "contiguous" if variant.endswith("contiguous") else "zigzag"
            overlap = not variant.endswith("no overlap")
            if layout == "zigzag":
                q, k, v, dout = (zigzag_shard(t, 2, cp) for t in (q, k, v, dout))
            else:
                q, k, v, dout = (t.chunk(cp.size, 2)[cp.rank].contiguous() for t in (q, k, v, dout))

            if impl == "ring":
                def attend(x):
                    return ring_attention(*x, cp, BlockKernel(), causal=True, layout=layout,
                                          knobs=RingKnobs(overlap=overlap))
            else:                                           # the groups the trainer's attention uses
                def attend(x):
                    return ulysses_attention(*x, pgm.cp_ulysses, pgm.cp_ring, layout=layout, causal=True)

        def step():
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            attend(x).backward(dout)
        state["step"] = step
        return step, extras

    def extras():
        with comm_ledger.ledger() as led:
            state["step"]()
        out = {}
        if not variant.startswith("SDPA"):               # bytes handed per op, and put on the wire
            out["comm"] = {op: led.total_bytes(op) for op in ("send_recv", "all_to_all", "all_gather")
                           if led.count(op)}
            out["wire"] = led.wire_bytes()
        if "gqa" in state:
            out["gqa"] = state["gqa"]
        return out

    return timed_world(build, steps)
