"""Step time by operation: GEMMs on a roofline, attention at its own fraction, memory-bound work at HBM speed.

One efficiency for every FLOP made the planner 1.3-2x too optimistic against published H100 runs: a
step is not only large matmuls. This model prices each kind of work on one rank by what limits it.

GEMMs. Every Linear of a decoder layer (per rank, per micro-batch; m = micro-batch x seq / cp rows,
the tp rank's slice of the columns; hd the head dim, F the intermediate size, V the vocabulary):

    qkv     (m, d) x (d, (Hq + 2 Hkv) hd / tp)      o     (m, Hq hd / tp) x (Hq hd / tp, d)
    gate/up (m, d) x (d, 2 F / tp)                   down  (m, F / tp) x (F / tp, d)
    lm_head (m, d) x (d, V / tp)  (last stage only)

each timed on a roofline, t = max(2 m k n / (peak x gemm_efficiency), (m k + k n + m n) x e / hbm):
large GEMMs run at `--efficiency` of peak (cuBLAS reaches 0.6-0.8 of the dense bf16 peak on H100 at
the sizes of an 8B layer), and a GEMM whose per-rank slice is thin (large tp, short micro-batches)
becomes bound by the bytes it reads, which is why heavy TP runs slower per FLOP. The backward is two
GEMMs of the forward's size (dX and dW), 2x its time; checkpointing runs the forward again.

Attention (FlashAttention-style, causal): its FLOPs (model.py's flops, causal half) at
`--attention-efficiency` of peak (0.5: FlashAttention-2/3's published H100 throughput is 50-75 % of
peak forward and less backward).

Memory-bound work, bytes read + written per token of one layer forward (activation dtype e; under
SP the norms and residual adds see m / tp tokens, without SP every tp rank repeats them):

    RMSNorm x2      2 x 2 d e               residual adds x2   2 x 3 d e
    RoPE            2 (Hq + Hkv) hd / tp x e                SwiGLU     3 F / tp x e
    backward 2x the forward; the loss: logits (m, V / tp) written in e, softmax in fp32, read back
    and its gradient written: (2 e + 12) bytes per logit
    optimizer       AdamW reads p, g, m, v and writes p, m, v (fp32): 28 B per local parameter
                    element, + 4 (the clip's norm) + 6 under bf16 (the cast of the master to compute)

all at `--hbm-bandwidth` (H100 SXM: 3.35 TB/s HBM3, NVIDIA's data sheet).

Collectives (estimate.py adds the wire bytes / bandwidth): a latency of `steps x alpha` per call,
steps = p - 1 for all-gather, reduce-scatter and all-to-all, 2 (p - 1) for all-reduce, 1 for a send,
alpha `--intra-latency-us` (1 us per hop over NVLink) or `--inter-latency-us` (5 us over IB), the
order of nccl-tests' small-message times. Nothing here communicates or touches a tensor.
"""
from __future__ import annotations

from typing import Dict

from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options
from .model import recompute_shares

HOPS = {"all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1, "all_to_all": lambda p: p - 1,
        "all_reduce": lambda p: 2 * (p - 1), "send": lambda p: 1, "send_recv": lambda p: 1}


def gemm_seconds(m: float, k: float, n: float, e: int, cluster) -> float:
    """One (m, k) x (k, n) GEMM on the roofline: compute-bound at the stated efficiency, or byte-bound."""
    compute = 2 * m * k * n / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    traffic = (m * k + k * n + m * n) * e / (cluster.hbm_gbps * 1e9)
    return max(compute, traffic)


def layer_gemms(model: ModelShape, layout: Layout, rows: float):
    d, hd, tp = model.hidden_size, model.head_dim, layout.tp
    q, kv, f = model.num_attention_heads * hd, model.num_key_value_heads * hd, model.intermediate_size
    return [(rows, d, (q + 2 * kv) / tp), (rows, q / tp, d), (rows, d, 2 * f / tp), (rows, f / tp, d)]


def compute_seconds(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster, layers: int,
                    last: bool, attention_flops: float, local_elements: float) -> Dict[str, float]:
    """The compute of one rank's step, by kind: gemm, attention, memory-bound, optimizer (seconds)."""
    e = DTYPE_BYTES[opts.dtype]
    M = batch.micro_steps(layout)
    rows = batch.micro(layout) * batch.sequence_len / layout.cp
    again, again_cheap = recompute_shares(model, opts)          # the share of the forward run again
    passes = 3 + again                                          # forward, 2x backward, recompute
    layer = sum(gemm_seconds(m, k, n, e, cluster) for m, k, n in layer_gemms(model, layout, rows))
    gemm = M * layers * passes * layer
    if last:
        gemm += M * 3 * gemm_seconds(rows, model.hidden_size, model.vocab_size / layout.tp, e, cluster)
    attention = attention_flops / (cluster.peak_tflops * 1e12 * cluster.attention_efficiency)
    d, hd, tp = model.hidden_size, model.head_dim, layout.tp
    norm_rows = rows / tp if layout.sequence_parallel else rows
    rope = 2 * (model.num_attention_heads + model.num_key_value_heads) * hd
    per_layer = (norm_rows * (2 * 2 * d + 2 * 3 * d) + rows * (rope + 3 * model.intermediate_size) / tp) * e
    hbm = cluster.hbm_gbps * 1e9
    memory_bound = M * layers * per_layer * (3 + again_cheap) / hbm
    if last:
        memory_bound += M * rows * model.vocab_size / tp * (2 * e + 12) / hbm
    optimizer = local_elements * (32 + (6 if e == 2 else 0)) / hbm
    return dict(gemm_s=gemm, attention_s=attention, memory_bound_s=memory_bound, optimizer_s=optimizer,
                compute_s=gemm + attention + memory_bound + optimizer)


def latency_seconds(op: str, group_size: int, calls: int, crosses_nodes: bool, cluster) -> float:
    """The fixed cost of `calls` collectives: hops x per-hop latency at the group's placement."""
    alpha = (cluster.inter_latency_us if crosses_nodes else cluster.intra_latency_us) * 1e-6
    return calls * HOPS.get(op, lambda p: p - 1)(group_size) * alpha
