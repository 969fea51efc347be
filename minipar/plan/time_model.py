"""Step time by operation: GEMMs on a roofline, attention at its own fraction, memory-bound work at HBM speed.

One efficiency for every FLOP made the planner 1.3-2x too optimistic against published H100 runs: a
step is not only large matmuls. This model prices each kind of work on one rank by what limits it.
Every constant is a Cluster field and a flag of `python -m minipar.plan` (estimate.py's Cluster
names the defaults and where each comes from).

GEMMs. Every Linear of a decoder layer (per rank, per micro-batch; m = micro-batch x seq / cp rows,
the tp rank's slice of the columns; hd the head dim, F the intermediate size, V the vocabulary):

    qkv     (m, d) x (d, (Hq + 2 Hkv) hd / tp)      o     (m, Hq hd / tp) x (Hq hd / tp, d)
    gate/up (m, d) x (d, 2 F / tp)                   down  (m, F / tp) x (F / tp, d)
    lm_head (m, d) x (d, V / tp)  (last stage only)

each timed on a roofline, t = max(2 m k n / (peak x gemm_efficiency), (m k + k n + m n) x e / hbm):
large GEMMs run at `--efficiency` of peak, and a GEMM whose per-rank slice is thin (large tp, short
micro-batches) becomes bound by the bytes it reads, which is why heavy TP runs slower per FLOP. The
backward is two GEMMs of the forward's size (dX and dW), 2x its time; checkpointing runs the
forward again: all of it (full), only the memory-bound ops (selective per op: the matmul and attention
outputs are kept), or every n-th layer's (activation_bytes.py's recompute_shares).

Attention (FlashAttention-style, causal): per layer and micro-batch the forward does
2 b (s / cp) s (Hq / tp) hd FLOPs (QK^T and PV, half the score matrix), the backward twice that,
all at `--attention-efficiency` of peak (the backward's own recompute of the scores is in that
fraction, as it is in FlashAttention's published throughput).

A layer whose attention takes a dense mask (a sliding window that binds, Gemma 2's capped logits:
ModelShape.masked; models/llama_layer.py) runs as minipar runs it, not as a window-aware kernel would:
SDPA with the mask computes every score of its (s / cp, s) block, 4 b (s / cp) s (Hq / tp) hd
FLOPs forward (twice a causal layer's: the window's saving is not taken, context_parallel/
window_attention.py says why), at `--attention-efficiency`, and reads the (s / cp, s) mask it makes
(e bytes a score). Gemma 2's capped scores are explicit (masked_attention.py): QK^T and PV as batched
GEMMs per row and head on the roofline, and the elementwise passes over the (b, Hq / tp, s / cp, s)
scores at HBM speed: the scale, / cap, tanh, * cap and masked_fill (2 e each), the fp32 softmax
(e + 4) and its cast back (4 + e, none in fp32), and K/V repeated to the query heads. MFU's model
FLOPs count what a window needs instead (models/flops.py: at most W keys a query).

Memory-bound work: the bytes read + written by the eager kernels of minipar's decoder
(models/llama.py, models/rope.py, tensor_parallel/vocab_parallel_loss.py), per element, activation
dtype e; under SP the norms and residual adds see m / tp tokens, without SP every tp rank repeats them:

    RMSNorm x2     (28 + 4 e) d     to fp32 (e + 4), pow (8), mean (4), x * rsqrt (8), to e (4 + e),
                                    x weight (2 e)
    residual x2    3 e d            read two, write one
    RoPE, q and k  12 e hd per head  x cos (3 e), -x2 and cat (2 e), x sin (3 e), the sum (3 e) and the
                                    half-rotation's reads (e)
    GQA repeat     2 e (Hq + Hkv) hd / tp   K/V repeated to the query heads (no cp, Hq != Hkv)
    attention out  2 e Hq hd / tp   the transpose back to (b, s, heads x hd), a copy
    SwiGLU         5 e F / tp       silu(gate) (2 e), x up (3 e)
    backward 2x the forward; the loss (48 + 2 e) bytes per logit of (m, V / tp): to fp32 (e + 4), max
    (4), subtract (8), exp (8), sum (4), divide (8); backward multiply (8) and back to e (4 + e)
    optimizer      AdamW reads p, g, m, v and writes p, m, v (fp32): 28 B per local parameter
                   element, + 4 (the clip's norm) + 6 under bf16 (the cast of the master to compute)

all at `--hbm-bandwidth`.

Fused kernels (Options.fused_kernels: torch.compile, as torchtitan's `--compile` runs; Transformer
Engine's fused norm, RoPE, activation and cross-entropy kernels, which Megatron-LM uses by default:
megatron/core/transformer/transformer_config.py in Megatron-LM, transformer_impl "transformer_engine"):
each fused region reads its inputs once and writes its outputs once, and nothing else. The rule
sets every figure below; none is fitted to a run:

    add + RMSNorm x2   4 e d          read the residual and the branch, write the sum and the norm
    RoPE, q and k      2 e hd per head  read and write each once
    SwiGLU             3 e F / tp     read gate and up, write the product
    GQA repeat, attention out   0     the attention kernel reads K/V per group and writes (b, s, H hd)
    the loss           3 e per logit  read the logits (forward), read them and write their gradient
                                      (backward); the backward is still 2x the forward elsewhere

torchtitan's per-op selective AC (Options.sac_every_other_matmul; torchtitan/distributed/
activation_checkpoint.py, `_get_custom_policy`: "Save all compute/comm ops, except every second
mm/linear") recomputes the 2nd, 4th and 6th of a Llama layer's seven matmuls (wq, wk, wv, wo, w1,
w3, w2): k, o and the up projection run again in the backward, on top of the cheap ops.

compile: true (minipar/regional_compile.py, Options.compile): the compute of the step (GEMMs,
attention, memory-bound work; not the optimizer, not the communication) divided by COMPILE_SPEEDUP =
1.16, the gain torchtitan measured from torch.compile alone (Llama 3 8B on 8 H100s, FSDP, bf16:
+16 % tokens/s; Liang et al., "TorchTitan", 2024, and issue 40 of this project, which quotes it).
A factor, not a model: it is an end-to-end figure of one run, stated where it is applied;
benchmarks/bench_compile.py measures minipar's own on the machine at hand. fused_kernels (above) is
the first-principles alternative for another trainer's fused kernels.

Collectives: wire bytes (collective_counts.py's wire_bytes: the ring algorithms' (p - 1) / p factors) over the
group's bandwidth (`--intra-bw` inside a node, `--inter-bw` across), plus a latency of `hops x alpha`
per call: hops = p - 1 for all-gather, reduce-scatter and all-to-all, 2 (p - 1) for all-reduce, 1 for
a point-to-point message, alpha `--intra-latency-us` or `--inter-latency-us`. What of it hides behind
compute is overlap.py's. Nothing here communicates or touches a tensor.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

from .activation_bytes import recompute_shares
from .collective_counts import wire_bytes
from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options

COMPILE_SPEEDUP = 1.16    # torchtitan: torch.compile, Llama 3 8B, 8 H100s (module docstring)

HOPS = {"all_gather": lambda p: p - 1, "reduce_scatter": lambda p: p - 1, "all_to_all": lambda p: p - 1,
        "all_reduce": lambda p: 2 * (p - 1), "send": lambda p: 1, "send_recv": lambda p: 1,
        "all_to_all_uneven": lambda p: p - 1}     # expert parallelism's token exchange (moe.py)


def latency_seconds(op: str, group_size: int, calls: int, crosses_nodes: bool, cluster) -> float:
    """The fixed cost of `calls` collectives: hops x per-hop latency at the group's placement."""
    alpha = (cluster.inter_latency_us if crosses_nodes else cluster.intra_latency_us) * 1e-6
    return calls * HOPS[op](group_size) * alpha


def collective_seconds(op: str, group_size: int, nbytes: float, crosses_nodes: bool, cluster,
                       calls: int = 1) -> float:
    """`calls` collectives of `nbytes` buffer bytes in all: wire bytes / bandwidth + latency."""
    if group_size <= 1 or not calls:
        return 0.0
    bw = (cluster.inter_gbps if crosses_nodes else cluster.intra_gbps) * 1e9
    wire = nbytes if op == "send" else wire_bytes(op, group_size, nbytes)
    return wire / bw + latency_seconds(op, group_size, calls, crosses_nodes, cluster)


def gemm_seconds(m: float, k: float, n: float, e: int, cluster) -> float:
    """One (m, k) x (k, n) GEMM on the roofline: compute-bound at the stated efficiency, or byte-bound."""
    compute = 2 * m * k * n / (cluster.peak_tflops * 1e12 * cluster.efficiency)
    traffic = (m * k + k * n + m * n) * e / (cluster.hbm_gbps * 1e9)
    return max(compute, traffic)


def layer_gemms(model: ModelShape, layout: Layout, rows: float):
    """(m, k, n) of the four GEMMs of one decoder layer's forward on one rank."""
    d, hd, tp = model.hidden_size, model.head_dim, layout.tp
    q, kv, f = model.num_attention_heads * hd, model.num_key_value_heads * hd, model.intermediate_size
    return [(rows, d, (q + 2 * kv) / tp), (rows, q / tp, d), (rows, d, 2 * f / tp), (rows, f / tp, d)]


def masked_attention_seconds(model: ModelShape, layout: Layout, batch: Batch, opts: Options,
                             cluster) -> Tuple[float, float]:
    """(attention's seconds, memory-bound bytes) of one forward of a layer whose attention takes a
    dense mask (ModelShape.masked; the module docstring): every score of the (s / cp, s) block."""
    e, tp = DTYPE_BYTES[opts.dtype], layout.tp
    b, S, D = batch.micro(layout), batch.sequence_len, model.head_dim
    s = S / layout.cp
    H, K = model.num_attention_heads / tp, model.num_key_value_heads / tp
    if not model.capped_attention:        # SDPA with the mask: no block skipped, 4 b s S H D FLOPs
        return 4 * b * s * S * H * D / (cluster.peak_tflops * 1e12 * cluster.attention_efficiency), \
            e * s * S                     # the mask made from the boolean one
    # Gemma 2's explicit scores: two batched GEMMs per (row, head), and the elementwise passes over
    # the (b, H, s, S) scores: scale, / cap, tanh, * cap, masked_fill (2 e each), the fp32 softmax
    # (e + 4) and its cast back (4 + e, none in fp32); K/V repeated to the query heads
    gemms = b * H * (gemm_seconds(s, D, S, e, cluster) + gemm_seconds(s, S, D, e, cluster))
    per_score = 11 * e + 4 + (4 + e if e != 4 else 0)
    return gemms, b * H * s * S * per_score + 2 * e * b * (H + K) * S * D


def compute_seconds(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster, layers: int,
                    last: bool, local_elements: float,
                    indices: Optional[Sequence[int]] = None) -> Dict[str, float]:
    """The compute of one rank's step through `layers` decoder layers (+ lm_head and the loss when
    `last`) and its optimizer step over `local_elements` parameters, by kind (seconds), and one
    layer's forward, backward and forward attention for one micro-batch (what overlap.py hides
    communication behind). `indices`, the layers' places in the model (default the first `layers`),
    say which attend through a dense mask (a window that binds, capped logits), priced as it runs:
    the averages over the layers make the per-layer figures; `layer_attention_s` is a causal
    layer's, beside which the ring's hops run."""
    e = DTYPE_BYTES[opts.dtype]
    M = batch.micro_steps(layout)
    b, s, tp = batch.micro(layout), batch.sequence_len, layout.tp
    rows = b * s / layout.cp
    hbm, peak = cluster.hbm_gbps * 1e9, cluster.peak_tflops * 1e12
    gemm_f = sum(gemm_seconds(m, k, n, e, cluster) for m, k, n in layer_gemms(model, layout, rows))
    attn_flops = 2 * rows * s * model.num_attention_heads / tp * model.head_dim    # causal: half of 4 m s H D
    causal_f = attn_flops / (peak * cluster.attention_efficiency)
    d, hd, H, K = model.hidden_size, model.head_dim, model.num_attention_heads, model.num_key_value_heads
    norm_rows = rows / tp if layout.sp else rows
    per_token = 12 * e * (H + K) * hd + 5 * e * model.intermediate_size + 2 * e * H * hd
    repeat = 2 * e * (H + K) * hd * rows / tp if layout.cp == 1 and H != K else 0.0  # SDPA's GQA repeat
    index = list(range(layers) if indices is None else indices)
    n_masked = sum(model.masked(i, s) for i in index)
    masked_f, masked_bytes = masked_attention_seconds(model, layout, batch, opts, cluster) if n_masked \
        else (0.0, 0.0)
    share = n_masked / max(1, len(index))            # a layer's average: causal and masked layers
    attn_f = (1 - share) * causal_f + share * masked_f
    mem_f = (norm_rows * 2 * (28 + 4 * e + 3 * e) * d + rows * per_token / tp
             + (1 - share) * repeat + share * masked_bytes) / hbm
    loss_bytes = 48 + 2 * e                                  # per logit, eager (the docstring)
    if opts.fused_kernels:
        mem_f = (norm_rows * 2 * 4 * e * d + rows * (2 * e * (H + K) * hd + 3 * e * model.intermediate_size)
                 / tp) / hbm
        loss_bytes = 3 * e
    forward = gemm_f + attn_f + mem_f
    # the share of the forward run again in backward: of the matmuls and attention, of the cheap ops
    # (full checkpointing 1 and 1; selective per op 0 and 1; every n-th layer its share of layers)
    again, again_cheap = recompute_shares(model, opts)
    heavy, cheap = 3 + again, 3 + again_cheap               # forward, 2x backward, the recompute
    gemm, attention = M * layers * heavy * gemm_f, M * layers * heavy * attn_f
    redo = 0.0                 # torchtitan's every second matmul (k, o, up), where nothing else reruns
    if opts.sac_every_other_matmul and again == 0 and again_cheap:
        redo = sum(gemm_seconds(rows, k, n, e, cluster) for k, n in
                   ((d, K * hd / tp), (H * hd / tp, d), (d, model.intermediate_size / tp)))
        gemm += M * layers * redo
    memory_bound = M * layers * cheap * mem_f
    if last:
        gemm += M * 3 * gemm_seconds(rows, d, model.vocab_size / tp, e, cluster)
        memory_bound += M * rows * model.vocab_size / tp * loss_bytes / hbm
    if opts.distributed_optimizer and not layout.sharded:     # Megatron's: each dp rank steps its 1/dp
        local_elements /= layout.sizes()["dp_cp"]
    optimizer = local_elements * (32 + (6 if e == 2 else 0)) / hbm
    if opts.compile:                     # torchtitan's measured gain (the module docstring)
        gemm, attention, memory_bound = (x / COMPILE_SPEEDUP for x in (gemm, attention, memory_bound))
    return dict(gemm_s=gemm, attention_s=attention, memory_bound_s=memory_bound, optimizer_s=optimizer,
                compute_s=gemm + attention + memory_bound + optimizer, layer_forward_s=forward,
                layer_backward_s=(heavy - 1) * (gemm_f + attn_f) + (cheap - 1) * mem_f + redo,
                layer_attention_s=causal_f)
