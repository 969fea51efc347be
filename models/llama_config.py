"""LlamaConfig: the decoder's shape, with Hugging Face's config.json keys, read and written.

The fields are transformers' config names, so `from_dict(json.load(config.json))` reads a real
checkpoint's config (transformers 4 writes rope_theta and rope_scaling, 5 rope_parameters) and
`to_hf_dict()` writes one that transformers loads. Checked on construction: heads divide the
hidden size (or head_dim is given), query heads are a multiple of KV heads (GQA), token ids are
integers, and rope_scaling is None or Llama 3.1's (models/rope.py applies it).

One config, nine families (`model_type`), because they share one decoder (models/llama.py); each
differs from Llama's by a few named properties, read by the layers (models/llama_layer.py):

    llama       the dense decoder
    qwen2       + biases on q/k/v_proj (never on o_proj: `qkv_bias`); Qwen2.5 too. A sliding window
                only with use_sliding_window, on the layers from max_window_layers on (layer_types)
    mistral     Llama's layer; sliding_window W (or null) on every layer: query i sees keys
                max(0, i-W+1)..i (`attention_window`)
    phi3        Llama's layer (Phi-3, Phi-4); its checkpoint fuses qkv_proj and gate_up_proj (cut on
                load, fused on export: models/hf_names.py); RoPE on the first head_dim *
                partial_rotary_factor channels only (`rotary_dim`); sliding_window as Mistral's
    qwen3       + q_norm / k_norm (RMSNorm over each head, before RoPE) and its own head_dim
    gemma2      the embeddings times sqrt(hidden_size) (`embedding_scale`); every RMSNorm scales by
                (1 + weight) (`norm_offset`); sandwich norms: the attention's and the MLP's outputs
                normed too before their residual add (`sandwich_norms`); GeGLU (gelu tanh,
                `activation`); scores scaled by query_pre_attn_scalar^-1/2, not head_dim^-1/2
                (`query_scale`); attention logits soft-capped, cap * tanh(s / cap)
                (attn_logit_softcapping: `attention_softcap`), and the final logits
                (final_logit_softcapping); local (sliding_window) and global layers alternating
                (layer_types); tied embeddings
    gemma3_text gemma2's, but q_norm / k_norm as qwen3's (with (1 + weight)), no attention
                soft-cap (transformers' Gemma 3 never applies the key), one global layer in six
                (sliding_window_pattern), and the local layers' own RoPE base rope_local_base_freq
                (`rope_theta_of`); rope_scaling (linear, in Gemma 3 4B+) on the global layers only
    mixtral     the feed-forward of every layer is a mixture of experts (models/moe.py):
                num_local_experts E SwiGLU experts of intermediate_size, num_experts_per_tok k
                of them per token, weights renormalised over the k (always)
    qwen3_moe   qwen3's attention; MoE layers as Mixtral's, with moe_intermediate_size experts,
                HF's key num_experts for E, renormalised only if norm_topk_prob; the layers in
                mlp_only_layers, or not at a multiple of decoder_sparse_step, keep the dense MLP
                of intermediate_size

router_aux_loss_coef weighs the load-balancing loss in the objective (0 leaves it out; unlike
transformers, output_router_logits is not needed to train with it). moe_capacity_factor is a
training option, not a config.json key: None is dropless; c caps each expert at
ceil(c * T * k / E) of a forward's T tokens (models/moe.py). What the families allow and minipar
does not (a sliding window outside qwen2/mistral/phi3/gemma, router jitter noise, shared experts,
longrope and other RoPE scalings, dropout, Gemma's keys on another family) is refused by name.
config.json's spellings of all this (transformers 4 and 5) are models/hf_config.py's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Union

from .config_checks import check_family, check_moe, check_rope_scaling
from .hf_config import GEMMA, LAYER_TYPED, from_hf_dict, to_hf_dict  # the family tables, config.json's keys


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: Optional[int] = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    head_dim: Optional[int] = None
    attention_bias: bool = False          # biases on q/k/v/o_proj (HF's key)
    mlp_bias: bool = False                # biases on gate/up/down_proj
    rope_scaling: Optional[dict] = None   # None (default RoPE), {"rope_type": "llama3", "factor": ...}
                                          # or {"rope_type": "linear", "factor": f}
    # the tokenizer's special ids, as config.json records them (HF's keys; eos may be a list, as in
    # Llama 3's); read from a base model's config.json, filled from the run's tokenizer, exported
    bos_token_id: Optional[Union[int, List[int]]] = None
    eos_token_id: Optional[Union[int, List[int]]] = None
    pad_token_id: Optional[Union[int, List[int]]] = None
    # the family, and the mixture of experts (see the module docstring); 0 experts is dense
    model_type: str = "llama"
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: Optional[int] = None   # qwen3_moe's expert width; Mixtral's is intermediate_size
    norm_topk_prob: Optional[bool] = None         # None: the family's (Mixtral always, Qwen3-MoE false)
    router_aux_loss_coef: float = 0.001
    decoder_sparse_step: int = 1
    mlp_only_layers: List[int] = dataclasses.field(default_factory=list)
    moe_capacity_factor: Optional[float] = None   # not in config.json: a training option
    # sliding-window attention (WINDOWED families only; see attention_window) and Phi-3's partial RoPE
    sliding_window: Optional[int] = None
    use_sliding_window: Optional[bool] = None     # qwen2's switch (transformers' default false)
    max_window_layers: Optional[int] = None       # qwen2: layers i >= this are windowed (default 28)
    layer_types: Optional[List[str]] = None       # qwen2: "sliding_attention" | "full_attention" per layer
    partial_rotary_factor: float = 1.0            # phi3: RoPE on the first head_dim * factor channels
    original_max_position_embeddings: Optional[int] = None   # phi3: kept for the export only
    # Gemma 2 / 3 (see the module docstring); None is off (a config.json's absent key: hf_config.py)
    query_pre_attn_scalar: Optional[float] = None  # scores times this ** -0.5 (None: transformers' 256)
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None  # gemma2 only (gemma3_text keeps the key, unused)
    rope_local_base_freq: Optional[float] = None   # gemma3_text: the local layers' RoPE base (10000)

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                                 f"{self.num_attention_heads}: change one, or set head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            ids = getattr(self, key)
            if ids is not None and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                           for i in (ids if isinstance(ids, list) else [ids])):
                raise ValueError(f"{key}={ids!r}: a token id is an integer >= 0 "
                                 f"(or, for eos, a list of them), or null")
        check_moe(self)            # the per-family checks and defaults: models/config_checks.py
        check_family(self)
        check_rope_scaling(self)

    def attention_window(self, i: int) -> Optional[int]:
        """The sliding window W of decoder layer i (None: full causal attention): every layer of a
        mistral or phi3 model with sliding_window set, the "sliding_attention" layers of qwen2 and
        Gemma."""
        if self.sliding_window is None:
            return None
        if self.model_type in LAYER_TYPED:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window

    def rope_theta_of(self, i: int) -> float:
        """Layer i's RoPE base: rope_theta, but rope_local_base_freq on Gemma 3's local layers."""
        if self.model_type == "gemma3_text" and self.layer_types[i] == "sliding_attention":
            return self.rope_local_base_freq
        return self.rope_theta

    @property
    def rope_kinds(self) -> int:
        """How many RoPE tables a forward builds: 2 for Gemma 3 (global, then local), else 1."""
        return 2 if self.model_type == "gemma3_text" else 1

    def rope_table(self, i: int) -> Optional[int]:
        """Which of the rope_kinds tables layer i reads (None: the one table of a 1-table family)."""
        if self.rope_kinds == 1:
            return None
        return 1 if self.layer_types[i] == "sliding_attention" else 0

    @property
    def qkv_bias(self) -> bool:
        """Biases on q/k/v_proj: attention_bias (which also biases o_proj), or always for Qwen2."""
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def rotary_dim(self) -> int:
        """The channels of each head RoPE rotates (the first ones; Phi-3's partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_norm(self) -> bool:
        """Qwen3's (and Gemma 3's) RMSNorm of each query and key head before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe", "gemma3_text")

    # ---- Gemma's named differences (all off for the other families)
    @property
    def norm_offset(self) -> bool:
        """RMSNorm scales by (1 + weight), the weight starting at 0 (Gemma), not by weight from 1."""
        return self.model_type in GEMMA

    @property
    def sandwich_norms(self) -> bool:
        """post_attention_layernorm norms the attention's output, and pre_/post_feedforward_layernorm
        the MLP's input and output (Gemma); else post_attention_layernorm is the MLP's input norm."""
        return self.model_type in GEMMA

    @property
    def activation(self) -> str:
        """The MLP's gate activation: silu (SwiGLU), or Gemma's tanh-approximated GELU (GeGLU)."""
        return "gelu_pytorch_tanh" if self.model_type in GEMMA else "silu"

    @property
    def embedding_scale(self) -> Optional[float]:
        """Gemma multiplies the embeddings by sqrt(hidden_size) (in the embedding's dtype); else None."""
        return self.hidden_size ** 0.5 if self.model_type in GEMMA else None

    @property
    def query_scale(self) -> float:
        """What q is multiplied by after RoPE so that the kernels' own 1/sqrt(head_dim) becomes
        Gemma's 1/sqrt(query_pre_attn_scalar): sqrt(head_dim / query_pre_attn_scalar), 1.0 else."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return (self.head_dim / self.query_pre_attn_scalar) ** 0.5

    @property
    def attention_softcap(self) -> Optional[float]:
        """Gemma 2's attention-logit cap c (scores -> c tanh(scores / c)), or None. Gemma 3 keeps the
        key but transformers' Gemma 3 attention never applies it, so neither does minipar."""
        return self.attn_logit_softcapping if self.model_type == "gemma2" else None

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has the mixture of experts (else the dense MLP), as transformers
        decides it: every layer for Mixtral; for Qwen3-MoE not in mlp_only_layers and
        (i + 1) % decoder_sparse_step == 0."""
        if self.model_type not in ("mixtral", "qwen3_moe"):
            return False
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """From a Hugging Face config.json (either transformers; each family's keys and defaults:
        models/hf_config.py)."""
        return from_hf_dict(cls, d)

    def to_hf_dict(self) -> dict:
        """The config.json transformers loads into this family's class (models/hf_config.py)."""
        return to_hf_dict(self)
