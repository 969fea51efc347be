"""The FLOPs of one training step of the decoder, from its shape alone: what MFU divides by.

The trainer (tflops_per_s and mfu in metrics.jsonl, minipar/trainer/throughput.py) and the
planner (minipar/plan/model.py) both read this one count, so a run and its plan say the same.

A matmul of an (n, k) input by a (k, m) weight costs 2 n k m FLOPs forward and twice that
backward (the input's gradient and the weight's): 6 FLOPs per weight element per token.

    matmul weights  per layer q, o (2 d H D), k, v (2 d K D), gate, up, down (3 d f; in a
                    mixture-of-experts layer the k experts a token visits, 3 k d f_moe, and the
                    router, d E: the active weights, as MoE MFU is counted); and the
                    lm_head (V d), counted even when tied to the embedding (the lookup costs no
                    FLOPs, the head's matmul does). Norms and biases are left out (O(d) per token).
    attention       per layer and token, Q K^T and P V against the s keys it attends to:
                    2 x 2 H D s forward, x 3 with backward
                      full     12 H D s: every token against all s keys, as torchtitan and
                               Megatron-LM count it (the kernels skip the masked half, so this
                               overstates the work of causal attention by 6 H D s)
                      causal    6 H D s: on average s / 2 keys, the FLOPs causal attention needs;
                               minipar's `mfu` and the planner's estimate use this one
                      a layer with a sliding window W < s (Mistral, Qwen2's and Gemma's windowed
                               layers: attention_window) attends to at most W keys: on average
                               W - W^2 / (2 s) causal (12 H D of them), W whole
    per step        (6 x matmul weights + attention) x global_batch_size x sequence_len tokens

Activation checkpointing runs forwards again; those are hardware FLOPs, not model FLOPs, and MFU
leaves them out (the planner adds them to a rank's time, not to MFU). Any object with Llama's
config fields (LlamaConfig, the planner's ModelShape) is a shape.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepFlops:
    """Model FLOPs of one optimizer step, the whole job's (divide by the world for one rank)."""
    matmul: float              # 6 x matmul weights x tokens
    attention_causal: float    # 6 L H D s x tokens
    attention_full: float      # 12 L H D s x tokens

    @property
    def causal(self) -> float:
        """The FLOPs the step needs: minipar's `mfu`."""
        return self.matmul + self.attention_causal

    @property
    def full(self) -> float:
        """Attention counted whole, torchtitan's and Megatron-LM's convention: `mfu_full_attention`."""
        return self.matmul + self.attention_full


def layer_matmul_weights(shape, i: int = 0) -> int:
    """Elements of decoder layer i's matmul weights a token goes through (q, k, v, o, and gate, up,
    down, or its experts' and the router): full, not TP-local. A shape without is_moe_layer is dense."""
    d, f, D = shape.hidden_size, shape.intermediate_size, shape.head_dim
    H, K = shape.num_attention_heads, shape.num_key_value_heads
    attention = 2 * d * H * D + 2 * d * K * D
    if getattr(shape, "is_moe_layer", None) is not None and shape.is_moe_layer(i):
        return attention + 3 * d * shape.moe_intermediate_size * shape.num_experts_per_tok \
            + d * shape.num_local_experts
    return attention + 3 * d * f


def layers_matmul_weights(shape) -> int:
    """The decoder layers' matmul weights a token goes through."""
    return sum(layer_matmul_weights(shape, i) for i in range(shape.num_hidden_layers))


def matmul_weights(shape) -> int:
    """Every matmul weight a token goes through: the layers and the lm_head (tied or not)."""
    return layers_matmul_weights(shape) + shape.vocab_size * shape.hidden_size


def attended_keys(shape, i: int, sequence_len: int, causal: bool = True) -> float:
    """The keys a query of layer i attends to, on average over the sequence: s / 2 causal (s whole);
    under a sliding window W < s (the shape's attention_window(i), where it has one) at most W, on
    average W - W^2 / (2 s) (the first W queries see fewer), or W whole."""
    window = shape.attention_window(i) if hasattr(shape, "attention_window") else None
    s = sequence_len
    if window is None or window >= s:
        return s / 2 if causal else s
    return window - window * window / (2 * s) if causal else window


def attention_flops_per_token(shape, sequence_len: int, causal: bool = True) -> float:
    """Q K^T and P V of one token through every layer, forward and backward: 12 H D per key."""
    return sum(12 * shape.num_attention_heads * shape.head_dim * attended_keys(shape, i, sequence_len, causal)
               for i in range(shape.num_hidden_layers))


def step_flops(shape, global_batch_size: int, sequence_len: int) -> StepFlops:
    """Model FLOPs of one step of global_batch_size x sequence_len tokens."""
    tokens = global_batch_size * sequence_len
    return StepFlops(matmul=6.0 * matmul_weights(shape) * tokens,
                     attention_causal=attention_flops_per_token(shape, sequence_len, True) * tokens,
                     attention_full=attention_flops_per_token(shape, sequence_len, False) * tokens)
