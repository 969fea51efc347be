"""The checks (and family defaults) of a LlamaConfig, run on construction (models/llama_config.py).

Every function takes the config (`self`, as the methods they were), fills in what its family
implies when the field is None (transformers' defaults: Qwen2's max_window_layers 28, Gemma's
query_pre_attn_scalar 256, each family's layer_types rule, ...) and raises one ValueError that
names the values and the fix for what minipar cannot build: a window on a family without one,
biases a family fixes, Gemma's keys on another family, a RoPE scaling other than llama3 / linear,
expert counts that cannot route. No torch, no communication: configs are checked on every rank
before any process group exists.
"""
from __future__ import annotations

from .hf_config import FAMILIES, GEMMA, LAYER_TYPED, WINDOWED
from .rope import LLAMA3_ROPE_KEYS


def check_moe(self) -> None:
    """The mixture of experts: its family's defaults (norm_topk_prob, moe_intermediate_size) and
    counts that can route; a dense family with experts refused."""
    if self.model_type not in FAMILIES:
        raise ValueError(f"model_type {self.model_type!r}: minipar builds {', '.join(FAMILIES)}")
    if self.model_type in ("mixtral", "qwen3_moe"):
        if self.model_type == "mixtral":
            self.norm_topk_prob = True          # Mixtral always renormalises the top-k weights
        elif self.norm_topk_prob is None:
            self.norm_topk_prob = False         # transformers' Qwen3MoeConfig default
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        problems = []
        E, k = self.num_local_experts, self.num_experts_per_tok
        if E < 1:
            problems.append(f"num_local_experts={E}: a {self.model_type} model has at least one expert")
        if not 1 <= k <= max(E, 1):
            problems.append(f"num_experts_per_tok={k} must be between 1 and the number of experts {E}")
        if self.decoder_sparse_step < 1:
            problems.append(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        if self.router_aux_loss_coef < 0:
            problems.append(f"router_aux_loss_coef={self.router_aux_loss_coef} must be >= 0")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            problems.append(f"moe_capacity_factor={self.moe_capacity_factor} must be > 0, or null "
                            f"(dropless)")
        if problems:
            raise ValueError("; ".join(problems))
    elif self.num_local_experts:
        raise ValueError(f"model_type {self.model_type!r} is dense but num_local_experts="
                         f"{self.num_local_experts}: use model_type mixtral or qwen3_moe")


def check_family(self) -> None:
    """The per-family settings: a window only where the family has one, the layer kinds
    (layer_types) of qwen2 and Gemma, Gemma's keys on Gemma only."""
    kind, W = self.model_type, self.sliding_window
    if W is not None and (isinstance(W, bool) or not isinstance(W, int) or W < 1):
        raise ValueError(f"sliding_window={W!r}: a window is a number of tokens >= 1, or null")
    if kind in ("qwen2", "mistral", "phi3") and (self.attention_bias or self.mlp_bias):
        fixed = "q/k/v only" if kind == "qwen2" else "none"
        raise ValueError(f"model_type {kind!r} fixes its biases ({fixed}): attention_bias="
                         f"{self.attention_bias}, mlp_bias={self.mlp_bias} must be false")
    if kind == "qwen2":
        if not self.use_sliding_window:
            self.sliding_window = None            # as transformers' Qwen2Config: the switch rules
        if self.max_window_layers is None:
            self.max_window_layers = 28           # transformers' default
    else:
        self.use_sliding_window = self.max_window_layers = None
    if kind in GEMMA:
        check_gemma(self)
    else:
        gemma = {k: getattr(self, k) for k in ("query_pre_attn_scalar", "final_logit_softcapping",
                                               "attn_logit_softcapping", "rope_local_base_freq")
                 if getattr(self, k) is not None}
        if gemma:
            raise ValueError(f"model_type {kind!r}: {gemma} are Gemma's keys: set them to null, or use "
                             f"model_type gemma2 or gemma3_text")
    if kind in LAYER_TYPED:
        check_layer_types(self)
    else:
        self.layer_types = None
        if W is not None and kind not in WINDOWED:
            raise ValueError(f"model_type {kind!r} has no sliding window here (sliding_window={W}): "
                             f"set it to null, or use model_type mistral, phi3, qwen2, gemma2 or "
                             f"gemma3_text")
    rotary = self.head_dim * self.partial_rotary_factor
    if self.partial_rotary_factor != 1.0 and (kind != "phi3" or not 0 < rotary <= self.head_dim
                                             or int(rotary) % 2):
        raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor}: only phi3 rotates part of "
                         f"each head, an even number of channels of head_dim={self.head_dim}")


def check_layer_types(self) -> None:
    """layer_types: one "sliding_attention" | "full_attention" per layer; when absent, the
    family's rule (transformers'): qwen2 windows the layers from max_window_layers on, Gemma 2
    every other layer from the first, Gemma 3 all but every 6th."""
    n, kind = self.num_hidden_layers, self.model_type
    if self.layer_types is None:
        if kind == "qwen2":
            local = [self.sliding_window is not None and i >= self.max_window_layers for i in range(n)]
        else:
            every = 2 if kind == "gemma2" else 6
            local = [(i + 1) % every != 0 for i in range(n)]
        self.layer_types = ["sliding_attention" if w else "full_attention" for w in local]
    kinds = ("sliding_attention", "full_attention")
    if len(self.layer_types) != n or any(t not in kinds for t in self.layer_types):
        raise ValueError(f"layer_types={self.layer_types}: one of {kinds} per layer ({n} layers)")


def check_gemma(self) -> None:
    """Gemma's keys: no MLP biases, positive soft-caps and scalar, the local RoPE base."""
    if self.mlp_bias:
        raise ValueError(f"model_type {self.model_type!r} has no MLP biases: mlp_bias must be false")
    if self.query_pre_attn_scalar is None:
        self.query_pre_attn_scalar = 256          # transformers' Gemma2Config / Gemma3TextConfig default
    if self.model_type == "gemma3_text" and self.rope_local_base_freq is None:
        self.rope_local_base_freq = 10_000.0
    elif self.model_type == "gemma2" and self.rope_local_base_freq is not None:
        raise ValueError(f"rope_local_base_freq={self.rope_local_base_freq}: only gemma3_text has a "
                         f"local RoPE base (Gemma 2's layers share rope_theta): set it to null")
    for key in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
                "rope_local_base_freq"):
        value = getattr(self, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            off = "" if key == "query_pre_attn_scalar" else ", or null (off)"
            raise ValueError(f"{key}={value!r} must be a number > 0{off}")


def check_rope_scaling(self) -> None:
    """rope_scaling: None, Llama 3.1's (models/rope.py) or linear (legacy key 'type' read as rope_type)."""
    if self.rope_scaling is not None:
        kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
        if kind == "linear":                      # positions / factor (Gemma 3 4B+'s global layers)
            missing = [] if "factor" in self.rope_scaling else ["factor"]
            self.rope_scaling = {**{k: v for k, v in self.rope_scaling.items() if k != "type"},
                                 "rope_type": "linear"}
        if kind not in ("llama3", "linear") or missing:
            raise ValueError(f"rope_scaling {self.rope_scaling}: only rope_type 'llama3' (with "
                             f"{', '.join(LLAMA3_ROPE_KEYS)}), 'linear' (with factor) or default RoPE "
                             f"(null) is supported")
