"""The KV cache: generation's forward, one new position per step instead of the whole sequence again.

A decoder's token t attends to the keys and values of tokens 0..t, and those never change once
computed (causal attention: a later token cannot alter an earlier one's K or V). So generation
keeps them. Per decoder layer, two tensors allocated once for the whole run:

    k, v      (b, Hkv_local, T_max, head_dim)    Hkv_local = num_key_value_heads / tp
    length    how many positions are filled (the same for every row: a batch is left-padded)
    valid     (b, T_max) bool: which filled positions hold a real token (False: left padding)

GQA's KV heads are cached once (Hkv, not H: a group of H / Hkv query heads reads the same cached
head, `enable_gqa`), so the cache is H / Hkv times smaller than the queries' width. Under tensor
parallelism each rank caches its own KV heads, the same split as k_proj / v_proj's weights: the
cache costs no communication; the step's collectives are the forward's own (one in and one out per
attention and MLP, the logits gathered over tp once).

    prefill   the prompt (b, s0) through the layers at once: K, V of every position written to
              [0, s0), logits of the last one
    decode    one token per row (b, 1): its K, V written at `length`, attention of the one query
              against [0, length]: O(length) work a step, where a recompute costs O(length^2)

Memory: 2 * L * b * Hkv_local * T_max * head_dim * bytes, e.g. 128 MiB for Llama-3-8B (L 32, Hkv 8,
head_dim 128) in bf16 at b 1, T_max 1024; 4 GiB at b 32 (and 4x that without GQA's sharing).

`cached_forward` walks the layers of models/llama.py with the layers' own modules (norms,
projections, q/k norms, RoPE, the MLP or MoE, Gemma's sandwich norms through the layer's own
add_attention / add_feed_forward), so the weights and their tp split are the training model's; only
the attention differs: it reads and writes the cache, with a mask that hides padding (and Gemma 2's
capped logits through the same masked_attention as training's).
The training forward (LlamaAttention.forward) is untouched. Left padding: position_ids count real
tokens only (the first real token is at 0, as transformers' generate), and every query also sees
itself, so a padding row never has an empty softmax (its output is never read).

On ZeRO-3 shards (minipar/zero3/) a unit's weights exist only between the hooks of its module's
call; this walk calls a layer's pieces, not the layer, so it opens each unit with
`model.zero3.forward_scope(module)`, the same hooks: the model (the root: norm, lm_head) around
the step, each layer around its two halves, the embedding through its own call. A step then
all-gathers every unit once over dp_shard_cp (the whole model's bytes, as a training forward),
prefetching in the order training learned, and leaves nothing gathered. The attention here never
crosses ranks, so a cp rank runs it whole, as a replica; the experts' all-to-all over ep is the
MoE layer's own, on the step's tokens.
"""
from __future__ import annotations

import contextlib
from typing import List

import torch

from minipar import tensor_parallel as tpl
from minipar.context_parallel.masked_attention import masked_attention


class KVCache:
    """Per layer K and V, pre-allocated (b, Hkv_local, T_max, head_dim); see the module docstring."""

    def __init__(self, model, batch: int, max_len: int, dtype=None, device=None):
        attn = model.model.layers[0].self_attn
        p = attn.k_proj.weight
        dtype, device = dtype or p.dtype, device or p.device
        shape = (batch, attn.local_kv_heads, max_len, attn.head_dim)
        n = len(model.model.layers)
        self.k: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.v: List[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length, self.max_len = 0, max_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _attention(attn, x, cos, sin, cache: KVCache, layer: int):
    """LlamaAttention's projections and RoPE, then attention of the new positions against the cache."""
    q, k, v = attn.project(x, cos, sin)               # the training layer's own projections and RoPE
    b, s = q.shape[0], q.shape[2]
    start, end = cache.length, cache.length + s
    cache.k[layer][:, :, start:end] = k
    cache.v[layer][:, :, start:end] = v
    keys, values = cache.k[layer][:, :, :end], cache.v[layer][:, :, :end]
    # query i (at start + i) sees the real tokens at j <= start + i, and always itself
    j = torch.arange(end, device=q.device)
    i = torch.arange(start, end, device=q.device)
    causal = j[None, :] <= i[:, None]                                       # (s, end)
    if attn.window is not None:                   # a sliding window: keys i-W+1..i only
        causal = causal & (j[None, :] > i[:, None] - attn.window)
    mask = (causal[None] & cache.valid[:, None, :end]) | (j[None, None, :] == i[None, :, None])
    out = masked_attention(q, keys.to(q.dtype), values.to(q.dtype), mask[:, None], attn.softcap)
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, attn.local_heads * attn.head_dim))


def _as_called(module):
    """A model that is not sharded: its parameters are there, nothing to open."""
    return contextlib.nullcontext()


@torch.no_grad()
def cached_forward(model, input_ids, position_ids, valid, cache: KVCache, last_only: bool = True):
    """Full logits (b, s or 1, V) of the new positions `input_ids` (b, s), whose K and V are added
    to `cache` at [length, length + s); `valid` (b, s) marks the real tokens (False: padding).
    model: a LlamaForCausalLM whose ranks hold every layer (pp 1): whole, its tp slices or its
    ZeRO-3 shards; under sequence parallelism called inside tpl.sequence_parallel_off(model) (a
    step's few tokens cannot be split along the sequence: minipar/post/generation.py does it)."""
    body = model.model
    b, s = input_ids.shape
    if cache.length + s > cache.max_len:
        raise ValueError(f"KV cache full: {cache.length} + {s} positions > max_len {cache.max_len}; "
                         f"allocate the cache for the prompt plus max_new_tokens")
    zero3 = getattr(model, "zero3", None)          # ZeRO-3: each unit opened by its hooks (above)
    unit = zero3.forward_scope if zero3 is not None else _as_called
    cache.valid[:, cache.length:cache.length + s] = valid
    with unit(model):
        h = body.embed(input_ids)                   # the embedding's own call gathers it
        cos, sin = body.rotary(position_ids, h.dtype)
        for layer in body.layers:
            with unit(layer):
                h = layer.add_attention(h, _attention(layer.self_attn, layer.input_layernorm(h), cos, sin,
                                                      cache, layer.layer_idx))
                h = layer.add_feed_forward(h)
        cache.length += s
        if last_only:
            h = h[:, -1:]
        return tpl.gather_from_tp_region(body.local_logits(h, model.lm_head), body.pgm.tp, dim=-1)
