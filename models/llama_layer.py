"""One Llama decoder layer, written for one process (nn.Linear, a plain RMSNorm, HF's names): the
unit that ZeRO-3 gathers, activation checkpointing recomputes and a pipeline stage holds a run of
(models/llama.py stacks them). Tensor parallelism is applied to it from outside, by
minipar/tensor_parallel/parallelize.py, which swaps its Linear layers for column- and row-parallel
ones and divides its head counts; this file imports nothing of it. The shapes below are one
process's; under tp each rank keeps heads/tp heads and intermediate/tp columns (parallelize.py
says what each swap costs).

    h (b, s, d)
      n = input_layernorm(h)         RMSNorm, in fp32
      q, k, v = q_proj(n), ...       Linear: heads query heads, kv_heads KV heads; the three through
                                     input_projections (x, layers) -> their outputs, one call, so
                                     that tp can enter its region once for the three
      q, k = q_norm(q), k_norm(k)    Qwen3 and Gemma 3 only: an RMSNorm over each head, before RoPE
      attention                      RoPE at the true positions (Phi-3: on the first rotary_dim
                                     channels), then causal attention of the local heads: plain
                                     (cp 1), ring attention over pgm.cp, Ulysses' two all-to-alls,
                                     or both (USP) -> (b, s, local_heads * head_dim)
      h = h + o_proj(attention)      Linear
      n = post_attention_layernorm(h)
      h = h + down_proj(silu(gate_proj(n)) * up_proj(n))     gate and up through input_projections
          or h + moe(n), the mixture of experts (models/moe.py), in Mixtral's and Qwen3-MoE's layers

Gemma's layer ("sandwich" norms: every sublayer's output normed too, before its residual add):
      h = h + post_attention_layernorm(o_proj(attention(input_layernorm(h))))
      h = h + post_feedforward_layernorm(down_proj(gelu_tanh(gate_proj(n)) * up_proj(n)))
                                     n = pre_feedforward_layernorm(h)                  (GeGLU)
  its norms scale by (1 + weight) in fp32 (the weight starts at 0), its q is scaled by
  sqrt(head_dim / query_pre_attn_scalar) after RoPE (so every kernel's 1/sqrt(head_dim) gives
  Gemma's 1/sqrt(query_pre_attn_scalar), one multiply instead of a scale through every path),
  and Gemma 3's local layers read their own RoPE table (rope_local_base_freq).

The layers take their attention settings when built (LayerSettings: the cp implementation and
layout, the attention kernel), read once from the ParallelismConfig by the model's constructor
(models/llama.py); a forward never reads the config. Of the process-group manager the attention
reads the cp groups only.

Two seams let parallelize.py change a layer without this file knowing tp: `input_projections`
(attention, MLP; here a loop over the layers) and a norm's `weight_through` (how its weight enters
the product; here the identity, under sequence parallelism f, so that the weight's gradient is
summed over the ranks that each normed part of the tokens). The stream has the parameters' dtype:
fp32 under autocast (bf16 matmul outputs), bf16 when ZeRO-3 gathers bf16 weights. With
document_ids (b, s) the causal mask is block-diagonal: a packed row computes what its examples
alone do.

The families differ in small named ways, read from the config at build (models/llama_config.py):
q/k/v biases (Qwen2's qkv_bias), q/k norms (Qwen3, Gemma 3), partial RoPE (Phi-3), a sliding
window (Mistral, Phi-3, Qwen2's and Gemma's windowed layers: `attention_window`), Gemma's norms,
GeGLU, query scale and Gemma 2's attention-logit soft-cap (`attention_softcap`). A window W lets
query i see keys max(0, i-W+1)..i: a band of the causal mask. It binds only when the sequence is
longer than W; then one process and tp (whose ranks hold whole sequences of some heads) run it as
a dense (s, s) band mask in SDPA, packed documents at cp 1 as the band AND the block-diagonal
mask, and context parallelism (whatever cp_impl) as the all-gather of K/V over cp with the band of
the true positions (minipar/context_parallel/window_attention.py). A window that does not bind changes
nothing: every path runs as without one. A soft-capped layer (Gemma 2) always takes the masked
path, whatever the window: its scores are computed explicitly (the dense mask's SDPA call becomes
minipar/context_parallel/masked_attention.py's capped scores), at cp 1 with or without packed
documents, and under cp (any cp_impl) as window_attention's all-gather of K/V with the causal
(or band) mask of the true positions: no fused, ring or Ulysses kernel can hold the cap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from minipar.context_parallel import BlockKernel, Documents, choose_kernel, ring_attention, ulysses_attention
from minipar.context_parallel.masked_attention import masked_attention
from minipar.context_parallel.window_attention import window_attention
from minipar.mesh import MeshDim, ProcessGroupManager

from .llama_config import LlamaConfig
from .moe import MoEFeedForward
from .rope import apply_rotary


@dataclass(frozen=True)
class LayerSettings:
    """How attention runs on the mesh, fixed when the model is built (defaults: one process)."""
    cp_impl: str = "ring"               # ring | ulysses | usp: how attention spans the cp ranks
    cp_layout: str = "zigzag"           # zigzag | contiguous: which tokens a cp rank holds
    attention_backend: str = "auto"     # the attention kernel asked for (kernel_choice.py)

    @classmethod
    def of(cls, parallel_config) -> "LayerSettings":
        """The settings of a ParallelismConfig (pgm.config), read once at build."""
        c = parallel_config
        return cls(c.cp_impl, c.cp_layout, getattr(c, "attention_backend", "auto"))


def each_linear(x, layers):
    """The outputs of `layers` that read the same x, one call each (the seam `input_projections`)."""
    return tuple(layer(x) for layer in layers)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in fp32 (as HF). offset (Gemma): x / rms(x) * (1 + weight), the product
    in fp32 before the cast back, the weight starting at 0."""

    weight_through = staticmethod(lambda weight: weight)   # the seam of the module docstring

    def __init__(self, hidden_size, eps, offset=False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if offset else torch.ones(hidden_size))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))   # fp32 at least, as HF
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight_through(self.weight)
        if self.offset:                      # Gemma: (x * (1 + w)) in fp32, then x's dtype
            return (x * (1.0 + weight.float())).to(dtype)
        return weight * x.to(dtype)


_SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                  "math": "MATH"}


def causal_attention(q, k, v, document_ids=None, backend: str = "auto", log=None, window=None, softcap=None):
    """Plain causal attention of one full (local) sequence, grouped-query: q (b, H, s, d), k/v
    (b, Hkv, s, d). K/V are repeated to the query heads (enable_gqa needs torch >= 2.5). backend
    (attention_backend) other than auto forces SDPA's kernel (torch.nn.attention.sdpa_kernel); the
    choice is noted in `log`. With document_ids (b, s) the mask is block-diagonal causal: a token
    sees the earlier tokens of its own document only (every row still sees itself, so no row is
    empty). That dense (b, 1, s, s) mask is the reference the packed path (LlamaAttention with
    `Documents`) is tested against; the model never builds it, but for a sliding `window` W that
    binds (W < s): then the mask also keeps keys i-W+1..i only (the band), with or without ids;
    and for soft-capped logits (`softcap`, Gemma 2), which take explicit scores under that mask
    (minipar/context_parallel/masked_attention.py) whatever the window and documents."""
    s = q.shape[2]
    band = window is not None and window < s
    if document_ids is None and not band and softcap is None:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        kind, reason = choose_kernel(backend, q.device, q.dtype, q.shape[-1], path="sdpa")
        if log is not None:
            log.note("cp 1", kind, reason)
        if backend == "auto":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel  # torch >= 2.3
        with sdpa_kernel(getattr(SDPBackend, _SDPA_BACKENDS[backend])):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril_()
    if band:
        mask = mask.triu_(1 - window)          # j > i - W: the window's band
    mask = mask[None]
    if document_ids is not None:
        mask = mask & (document_ids[:, :, None] == document_ids[:, None, :])
    if softcap is not None and log is not None:
        log.note("cp 1", "explicit", f"attention logits soft-capped at {softcap}: no fused kernel "
                                      f"takes the cap")
    return masked_attention(q, k, v, mask[:, None], softcap)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, pgm: ProcessGroupManager, settings: LayerSettings,
                 layer_idx: int = 0):
        super().__init__()
        self.pgm, self.head_dim = pgm, config.head_dim
        # the attention across cp ranks and its kernel: fixed at build
        self.cp_impl, self.cp_layout, self.backend = settings.cp_impl, settings.cp_layout, \
            settings.attention_backend
        # the heads this rank computes: all of them here (parallelize.py divides them by tp)
        self.local_heads, self.local_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.input_projections = each_linear
        d, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.window = config.attention_window(layer_idx)   # this layer's sliding window (None: full causal)
        self.softcap = config.attention_softcap             # Gemma 2's logit cap (None: none)
        self.query_scale = config.query_scale               # Gemma's query_pre_attn_scalar, on q
        self.rope_table = config.rope_table(layer_idx)      # Gemma 3: the global (0) or local (1) RoPE
        qkv_bias = config.qkv_bias                           # Qwen2: q/k/v only
        self.q_proj = nn.Linear(d, config.num_attention_heads * hd, bias=qkv_bias)
        self.k_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=qkv_bias)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=qkv_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, d, bias=bias)
        if config.qk_norm:          # Qwen3, Gemma 3: RMSNorm over each head of q and k, before RoPE
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, offset=config.norm_offset)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, offset=config.norm_offset)
        self.qk_norm = config.qk_norm
        self.attention_log = None          # LlamaModel's AttentionLog, shared by the layers

    def project(self, x, cos, sin):
        """q (b, local_heads, s, d), k and v (b, local_kv_heads, s, d): the projections (one
        input_projections call for the three), the q/k norms of a family that has them, RoPE (cos,
        sin: the model's tables, stacked per kind for Gemma 3, of which this layer reads its own),
        Gemma's query scale.
        Generation's cache reuses it."""
        q, k, v = self.input_projections(x, (self.q_proj, self.k_proj, self.v_proj))
        b, s, _ = q.shape
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_table is not None:
            cos, sin = cos[self.rope_table], sin[self.rope_table]
        q = apply_rotary(q, cos, sin)
        if self.query_scale != 1.0:           # the kernels' 1/sqrt(head_dim) -> 1/sqrt(query_pre_attn_scalar)
            q = q * self.query_scale
        return q, apply_rotary(k, cos, sin), v

    def forward(self, x, cos, sin, document_ids=None):
        q, k, v = self.project(x, cos, sin)
        b, s = q.shape[0], q.shape[2]
        pgm, log, backend = self.pgm, self.attention_log, self.backend
        band = self.window is not None and self.window < s * pgm.cp.size     # the window binds
        masked = band or self.softcap is not None     # a dense mask (capped logits: explicit scores)
        window = self.window if band else None
        if masked and pgm.cp.size > 1:       # K/V all-gathered over cp, one mask (any cp_impl)
            out = window_attention(q, k, v, pgm.cp, window, self.cp_layout, document_ids, self.softcap)
        elif masked:                         # the band mask (and the documents', if packed)
            ids = document_ids.local if isinstance(document_ids, Documents) else document_ids
            out = causal_attention(q, k, v, ids, backend, log, window=window, softcap=self.softcap)
        elif pgm.cp.size > 1 and self.cp_impl == "ring":      # the ring runs the block kernel chosen here
            out = ring_attention(q, k, v, pgm.cp, BlockKernel(backend, document_ids, log=log), causal=True,
                                 layout=self.cp_layout)
        elif pgm.cp.size > 1:                # Ulysses over cp_ulysses, the ring over cp_ring (USP)
            out = ulysses_attention(q, k, v, pgm.cp_ulysses, pgm.cp_ring, layout=self.cp_layout,
                                    document_ids=document_ids, impl=backend, log=log)
        elif isinstance(document_ids, Documents):
            # packed documents at cp 1: the whole sequence as the one causal block of a ring of one
            # rank, which runs per document (or one varlen call): no (s, s) mask
            alone = MeshDim("cp_alone", [pgm.global_rank], pgm.global_rank, None)
            out = ring_attention(q, k, v, alone, BlockKernel(backend, document_ids, log=log), causal=True)
        else:
            out = causal_attention(q, k, v, document_ids, backend, log)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): SwiGLU (silu), or Gemma's GeGLU (tanh GELU)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.tanh_gelu = config.activation == "gelu_pytorch_tanh"
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)
        self.input_projections = each_linear

    def forward(self, x):
        gate, up = self.input_projections(x, (self.gate_proj, self.up_proj))
        act = F.gelu(gate, approximate="tanh") if self.tanh_gelu else F.silu(gate)
        return self.down_proj(act * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, pgm: ProcessGroupManager, layer_idx: int,
                 settings: LayerSettings):
        super().__init__()
        self.layer_idx = layer_idx

        def norm():
            return RMSNorm(config.hidden_size, config.rms_norm_eps, offset=config.norm_offset)
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(config, pgm, settings, layer_idx)
        self.post_attention_layernorm = norm()   # Gemma: the attention's output; else the MLP's input
        self.sandwich = config.sandwich_norms
        if self.sandwich:                        # Gemma: the MLP's input and output norms
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.is_moe = config.is_moe_layer(layer_idx)     # the mixture of experts, or the dense MLP
        self.mlp = MoEFeedForward(config, getattr(pgm, "ep", None)) if self.is_moe else LlamaMLP(config)

    def forward(self, h, cos, sin, document_ids=None):
        h = self.add_attention(h, self.self_attn(self.input_layernorm(h), cos, sin, document_ids))
        return self.add_feed_forward(h)

    def add_attention(self, h, attention_out):
        """The residual add of the attention's output (normed first in a sandwich family).
        Generation's cache (models/kv_cache.py) calls it and add_feed_forward with its own attention."""
        if self.sandwich:
            return h + self.post_attention_layernorm(attention_out)
        return h + attention_out

    def add_feed_forward(self, h):
        """h + the MLP (or MoE) of h's norm; in a sandwich family its output normed too."""
        if self.sandwich:
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h + self.mlp(self.post_attention_layernorm(h))
