"""What one micro-batch keeps for backward, per rank, from the shapes alone (model.py has the
notation), and what activation checkpointing keeps and brings back.

Activations: the bytes autograd saves for backward in one micro-batch's forward, counted
storage by storage (what `torch.autograd.graph.saved_tensors_hooks` sees), parameters excluded:
    per layer, no SP:  2 norms x (4nd + 4n + 2 e nd)      fp32 copy of x, rsqrt, x_hat, output
                       attention  e n (2 H + 2 K') D / T + 4 b H s / T   q, k, v, out; fp32 lse
                                  (K' = H: SDPA gets K/V repeated to the query heads; under cp
                                   ring attention keeps K heads and o_proj's input is a copy: + e n H D / T)
                                  ulysses / usp: the same count with K' = f K, f = u / gcd(K / T, u)
                                  the KV repeat: ring_attention saves the head-split q, k, v, out (u s
                                  tokens of H / u heads: the local elements, f times for k and v) and
                                  its lse; the all-to-alls and repeat_interleave save nothing
                                  a layer with a dense mask (`attention_bytes`: a sliding window W
                                  that binds, W < S the whole sequence, or Gemma 2's capped logits),
                                  measured: q and out e n H D each; K/V of the whole sequence with
                                  their KV heads, 2 e b S K D (cp all-gathers them: the gathered
                                  copy is what SDPA keeps); the lse; SDPA's additive mask, e s S
                                  (broadcast over b and heads). Capped: K/V repeated to the query
                                  heads, 2 e b S H D; tanh's output (e), the fp32 softmax and its
                                  cast (e, none in fp32) over b H s S; the bool mask s S; no lse
                       MLP        4 e n f / T                gate, silu(gate), up, product
    under SP the norms see n / T tokens and save their input's gathered copy (e n d) instead
    of their output; with activation checkpointing a layer keeps only its input, and one layer's
    activations come back during its recompute in backward. Selective checkpointing per op
    (models/activation_checkpoint.py) keeps a layer's input and what its matmuls and attention
    output, everything else recomputed (o and down before their reduction, all n tokens under SP):
        e ns d + e n ((2 H + 2 K) D + 2 d + 2 f) / T + 4 b H s / T      (cp counted as without it)
    (torchtitan's policy, Options.sac_every_other_matmul, keeps neither k, o's output nor up: less
    e n (K D + d + f) / T)
    and selective every n-th layer fully checkpoints layers n-1, 2n-1, ... (`as_configured`: the
    peak of the mode the options name, `kept_per_layer`: what each layer keeps).
    root: ids, cos/sin (2 e n D), final norm, and the vocab-parallel loss's fp32 softmax 4 n V / T;
    an MoE's load-balancing loss, 4 E + 4 (moe.py).
    Gemma's norms multiply the fp32 x_hat by (1 + weight), a (d,) fp32 tensor each call makes: both
    kept (x_hat in 4 bytes whatever e); its sandwich norms' outputs go to a residual add, which keeps
    nothing; its embedding scale is a 0-d tensor in the root. The layers' counts differ where their
    attention does (`layers`, one per layer; `per_layer` the largest, what a recompute brings back).
bf16 without ZeRO-3 runs under autocast: the weights and the residual stream stay fp32 (so the
layer input, cos/sin and the norms' x_hat are 4 bytes an element) and every matmul saves bf16
casts of its input and its weight, the input cast once per reader (autocast caches only the
weights' casts). So a norm keeps 4 ns d + 4 ns + 4 ns d + r e n d for its r readers (q, k, v: 3;
gate, up: 2; lm_head: 1), a layer also its weights e (d (2 H + 2 K) D + 3 d f / T), the root
lm_head's e d V / T (`stream_bytes`: not under Megatron-LM's distributed optimizer, whose bf16
parameters are counted as ZeRO-3's). An MoE feed-forward's router is the post-attention norm's one
reader, and its own casts are moe.py's. Under checkpointing autocast's cache
also holds the weights' casts until the forward ends: a transient, freed before backward, not counted.
"""
from __future__ import annotations

from typing import Dict, Tuple

from minipar.context_parallel.ulysses import kv_repeats

from . import moe
from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options, param_bytes


def activations(model: ModelShape, layout: Layout, batch: Batch, opts: Options) -> Dict[str, int]:
    """Saved-for-backward bytes of one micro-batch (see the module docstring)."""
    m, T, C = model, layout.tp, layout.cp
    e = DTYPE_BYTES[opts.dtype]
    # fp32 under autocast (bf16 without ZeRO-3), where the weights stay fp32 and each matmul saves
    # bf16 casts of its input and its weight
    pe = stream_bytes(layout, opts)
    autocast = pe != e
    b, s = batch.micro(layout), batch.sequence_len // C
    n, d, D, f = b * s, m.hidden_size, m.head_dim, m.intermediate_size
    H, K = m.num_attention_heads // T, m.num_key_value_heads // T
    ns = n // T if layout.sp else n                     # tokens the norms and residuals see

    x_hat = 4 if m.sandwich_norms else pe   # Gemma's norm multiplies the fp32 x_hat by (1 + weight)
    x_hat_qk = 4 if m.sandwich_norms else e  # (q and k are in the compute dtype, under autocast too)

    def norm(readers: int, gathered: bool = True) -> int:     # x, rsqrt, x_hat; the output (or its
        # gathered copy) its readers save: one tensor, or under autocast each reader's own bf16 cast
        # of it; Gemma's (1 + weight), made in fp32 by each call. An MoE's router reads the norm's
        # own n / T tokens under SP (no g before the experts): not gathered
        out = e * (n if gathered else ns) * d * (readers if autocast else min(readers, 1))
        return 4 * ns * d + 4 * ns + x_hat * ns * d + out + 4 * d * m.sandwich_norms

    mlp = moe.mlp_activations(model, layout, batch, e, pe) if model.is_moe else 4 * e * n * f // T
    # autocast's bf16 weight casts: q, k, v, o, and gate, up, down (an MoE's router and experts)
    ffn = moe.weight_casts(model, layout, e) if model.is_moe else e * (3 * d * f // T)
    weights = e * d * (2 * H + 2 * K) * D + ffn if autocast else 0
    norms = norm(3) + (norm(1, gathered=False) if model.is_moe else norm(2)) + \
        (2 * norm(0) if m.sandwich_norms else 0)
    if m.qk_norm:   # Qwen3's and Gemma 3's norms of each q and k head: the fp32 x, rsqrt, x_hat (fp32
        # for Gemma's (1 + weight), else in e) and Gemma's (1 + weight); RoPE keeps neither output
        norms += (4 + x_hat_qk) * n * (H + K) * D + 4 * b * (H + K) * s + 2 * 4 * D * m.sandwich_norms
    # (Gemma's norms of the attention's and the MLP's outputs: their reader, the residual add, saves
    # nothing; counted as a norm's own)
    attention = [attention_bytes(model, layout, batch, opts, i) for i in range(m.num_hidden_layers)]
    layers = [norms + a + mlp + weights for a in attention]
    layer = max(layers)                                 # the largest: what one layer's recompute brings back
    root = 8 * n + 2 * pe * n * D * rope_tables(m)     # ids (int64; under tp the local ids), cos, sin
    root += pe * m.sandwich_norms                       # Gemma's embedding scale, a 0-d tensor
    if T > 1:
        root += n                                       # the mask of ids outside the vocab shard
    root += norm(1) + 4 * n * m.vocab_size // T + 8 * n + 2 * n   # softmax fp32, target, 2 masks
    root += moe.aux_activations(m)                      # an MoE's load-balancing loss
    if autocast:
        root += e * d * m.vocab_size // T               # lm_head's bf16 weight
    layer_input = pe * ns * d
    selective = layer_input + e * n * ((2 * H + 2 * K) * D + 2 * d + 2 * f // T) + 4 * b * H * s
    if opts.sac_every_other_matmul:           # torchtitan's policy recomputes k, o and up (time_model.py)
        selective -= e * n * (K * D + d + f // T)
    L = m.num_hidden_layers
    out = dict(per_layer=layer, layers=layers, root=root, full=sum(layers) + root, layer_input=layer_input,
               selective_layer=selective, checkpointed=L * layer_input + root,
               checkpointed_peak=L * layer_input + root + layer,
               # per_layer by part (the largest layer): what a reader of the plan can hold against
               # another trainer's
               per_layer_parts=dict(norms=norms, attention=max(attention), mlp=mlp, weight_casts=weights))
    kept = sum(kept_per_layer(out, opts, i) for i in range(L))
    out.update(as_configured_kept=kept + root, as_configured=kept + root + recompute_peak(out, opts))
    return out


def rope_tables(model: ModelShape) -> int:
    """The RoPE tables a forward builds and every layer's RoPE keeps (cos and sin each): Gemma 3's
    global and local ones stacked (models/llama.py's rotary), else one."""
    return 2 if model.sandwich_norms and model.qk_norm else 1


def stream_bytes(layout: Layout, opts: Options) -> int:
    """Bytes an element of the residual stream takes: the parameters' dtype. ZeRO-3 gathers them in
    the compute dtype; without it they stay fp32 and bf16 runs under autocast (fp32 stream), as
    collective_counts.py prices minipar's collectives. Megatron-LM's distributed optimizer
    (Options.distributed_optimizer: time and memory as that trainer runs them, estimate.py) keeps the
    parameters themselves in the compute dtype."""
    return DTYPE_BYTES[opts.dtype] if opts.distributed_optimizer else param_bytes(layout, opts)


def kept_per_layer(act: Dict[str, int], opts: Options, i: int) -> int:
    """Bytes decoder layer i (its index in the model) keeps for backward under the options'
    checkpointing, from activations()' per-layer counts."""
    ac = opts.gradient_checkpointing
    if not ac:
        return act["layers"][i]
    if ac == "selective" and opts.selective_ac_option == "op":
        return act["selective_layer"]
    if ac == "selective" and (i + 1) % opts.selective_ac_option:
        return act["layers"][i]                          # not an n-th layer: keeps everything
    return act["layer_input"]


def recompute_peak(act: Dict[str, int], opts: Options) -> int:
    """What a layer's recompute in backward brings back on top of what it kept: all of its
    activations (full, every n-th), or the ones the op policy did not keep."""
    if not opts.gradient_checkpointing:
        return 0
    if opts.gradient_checkpointing == "selective" and opts.selective_ac_option == "op":
        return act["per_layer"] - act["selective_layer"] + act["layer_input"]
    return act["per_layer"]


def attention_bytes(model: ModelShape, layout: Layout, batch: Batch, opts: Options, i: int) -> int:
    """What decoder layer i's attention saves for backward (the module docstring): its kernel's
    path, models/llama_layer.py's choice. Causal (no window that binds, no cap): q, K/V (repeated
    to the query heads at cp 1 without Ulysses), the output (a copy of it under the ring) and the
    fp32 log-sum-exp. A dense mask (a binding window, window_attention.py / causal_attention's
    band): q, K/V with their KV heads, whole over the sequence (all-gathered under cp), the output,
    the log-sum-exp and the mask SDPA makes of the boolean one, in q's dtype, (s, S) over the batch.
    Capped logits (Gemma 2, masked_attention.py): the explicit scores, (b, H, s, S) three times."""
    m, T, C = model, layout.tp, layout.cp
    e = DTYPE_BYTES[opts.dtype]
    b, s = batch.micro(layout), batch.sequence_len // C
    n, D, S = b * s, m.head_dim, batch.sequence_len
    H, K = m.num_attention_heads // T, m.num_key_value_heads // T
    lse = 4 * b * H * s
    if not m.masked(i, S):
        kv_heads = K * kv_repeat(model, layout) if (C > 1 or H == K) else H
        return e * n * (2 * H + 2 * kv_heads) * D + lse + (e * n * H * D if C > 1 else 0)
    if m.capped_attention:    # Gemma 2's explicit scores (masked_attention.py): q and the output;
        # K/V repeated to the query heads over every key of the sequence (all-gathered under cp: the
        # matmuls save the repeated copies, not the gathered ones); tanh's output in e, the fp32
        # softmax and its cast to e (the same tensor in fp32); the boolean mask; no lse
        scores = b * H * s * S * (e + 4 + (e if e != 4 else 0))
        return e * n * 2 * H * D + 2 * e * b * H * S * D + scores + s * S
    return e * n * 2 * H * D + e * b * S * 2 * K * D + lse + e * s * S


def recompute_shares(model: ModelShape, opts: Options) -> Tuple[float, float]:
    """(the share of the layers' matmul and attention work, of their memory-bound work) that runs
    again in backward: full 1 and 1, selective per op 0 and 1 (only the cheap ops), every n-th
    layer the share of layers it checkpoints."""
    ac, L = opts.gradient_checkpointing, model.num_hidden_layers
    if not ac:
        return 0.0, 0.0
    if ac == "selective" and opts.selective_ac_option == "op":
        return 0.0, 1.0
    share = (L // opts.selective_ac_option) / L if ac == "selective" else 1.0
    return share, share


def recomputed_layers(model: ModelShape, opts: Options, layers: int) -> int:
    """Of `layers` decoder layers, how many run (part of) their forward again in backward, and so
    repeat its collectives (the op policy caches no collective: each runs again)."""
    ac = opts.gradient_checkpointing
    if ac == "selective" and opts.selective_ac_option != "op":
        return layers // opts.selective_ac_option
    return layers if ac else 0


def recomputes(opts: Options, i: int) -> bool:
    """Whether decoder layer i (its index in the model) runs (part of) its forward again in
    backward, and so repeats its collectives: recomputed_layers' rule, layer by layer."""
    ac = opts.gradient_checkpointing
    if ac == "selective" and opts.selective_ac_option != "op":
        return (i + 1) % opts.selective_ac_option == 0
    return bool(ac)


def kv_repeat(model: ModelShape, layout: Layout) -> int:
    """f, how often Ulysses repeats each KV head of a tp rank (1 under ring): ulysses.py's rule."""
    T = layout.tp
    return kv_repeats(model.num_attention_heads // T, model.num_key_value_heads // T, layout.ulysses_size())
