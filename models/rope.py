"""Rotary position embeddings (RoPE), with Llama 3.1's and linear frequency scaling, in Hugging Face's layout.

Su et al., "RoFormer" (2021): a position p rotates each pair of a query's (and key's) channels by
the angle p x theta^(-2i/d), so the score q_p . k_t depends on p - t only. HF's "rotate half" layout
pairs channel i with channel i + d/2 (not 2i with 2i + 1), which is what checkpoints expect:

    inv_freq (d/2,)        theta ** (-arange(0, d, 2) / d)   (llama3: long wavelengths stretched;
                                                             linear: every one divided by factor)
    cos, sin (b, s, d)     of position_ids (b, s) x inv_freq, repeated for both halves
    rope(x)                x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1]

Partial RoPE (Phi-3's partial_rotary_factor f): the tables are built for r = head_dim * f channels
(theta ** (-arange(0, r, 2) / r)), and only the first r channels of each head rotate; the other
head_dim - r pass through unchanged (apply_rotary reads r from the tables' width).

Gemma 3 builds two sets of tables per forward: its global layers rotate with rope_theta (and
rope_scaling), its local (sliding-window) layers with rope_local_base_freq and no scaling
(models/llama.py stacks them; each layer reads its own: LlamaConfig.rope_table).

The tables are built from the TRUE positions: under context parallelism a rank holds chunks of
the sequence out of order (zigzag), under packing positions restart at each example, and the
pipeline's stages rebuild the same tables from the same position_ids. No communication.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama3_inv_freq(inv_freq, scaling: dict):
    """Llama 3.1's RoPE scaling (as transformers' _compute_llama3_parameters): wavelengths longer
    than original_max_position_embeddings / low_freq_factor are stretched by `factor`, those
    shorter than .../ high_freq_factor are kept, and the band between is interpolated smoothly."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(position_ids, head_dim, theta, dtype, rope_scaling: Optional[dict] = None):
    """cos, sin of shape (b, s, head_dim) at the given (true) positions, HF's rotate-half layout
    (head_dim: the rotated channels, models/llama_config.py rotary_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    if rope_scaling and rope_scaling.get("rope_type") == "linear":   # positions / factor
        inv_freq = inv_freq / rope_scaling["factor"]
    elif rope_scaling:
        inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
    freqs = position_ids.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x, cos, sin):
    """x (b, heads, s, d); cos/sin (b, s, r), r <= d: the first r channels rotate, the rest pass."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    if r < x.shape[-1]:                  # partial RoPE
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat([(rot * cos + _rotate_half(rot) * sin).to(x.dtype), rest], dim=-1)
    return (x * cos + _rotate_half(x) * sin).to(x.dtype)   # keep bf16 under autocast
