"""LlamaConfig: the decoder's shape, with Hugging Face's config.json keys, read and written.

The fields are transformers' config names, so `from_dict(json.load(config.json))` reads a real
checkpoint's config (transformers 4 writes rope_theta and rope_scaling, 5 rope_parameters) and
`to_hf_dict()` writes one that transformers loads. Checked on construction: heads divide the
hidden size (or head_dim is given), query heads are a multiple of KV heads (GQA), token ids are
integers, and rope_scaling is None or Llama 3.1's (models/rope.py applies it).

One config, four families (`model_type`), because they share one decoder (models/llama.py):

    llama       the dense decoder
    qwen3       + q_norm / k_norm (RMSNorm over each head, before RoPE) and its own head_dim
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
does not (a sliding window, router jitter noise, shared experts) is refused by name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Union

from .rope import LLAMA3_ROPE_KEYS


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
    rope_scaling: Optional[dict] = None   # None (default RoPE) or {"rope_type": "llama3", "factor": ...}
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
        self._check_moe()
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if kind != "llama3" or missing:
                raise ValueError(f"rope_scaling {self.rope_scaling}: only rope_type 'llama3' (with "
                                 f"{', '.join(LLAMA3_ROPE_KEYS)}) or default RoPE (null) is supported")

    def _check_moe(self):
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

    @property
    def qk_norm(self) -> bool:
        """Qwen3's RMSNorm of each query and key head before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe")

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has the mixture of experts (else the dense MLP), as transformers
        decides it: every layer for Mixtral; for Qwen3-MoE not in mlp_only_layers and
        (i + 1) % decoder_sparse_step == 0."""
        if self.model_type not in ("mixtral", "qwen3_moe"):
            return False
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """From a Hugging Face config.json (transformers 4 writes rope_theta, 5 rope_parameters)."""
        d = dict(d)
        kind = d.get("model_type", "llama")
        unsupported = []
        if d.get("sliding_window") is not None and d.get("use_sliding_window", kind != "qwen3_moe"):
            unsupported.append(f"sliding_window={d['sliding_window']} (attention here is full causal)")
        if d.get("router_jitter_noise"):
            unsupported.append(f"router_jitter_noise={d['router_jitter_noise']} (set it to 0)")
        if d.get("shared_expert_intermediate_size"):
            unsupported.append("shared experts (shared_expert_intermediate_size)")
        if unsupported:
            raise ValueError(f"model_type {kind!r}: minipar does not support " + "; ".join(unsupported))
        if "num_experts" in d and "num_local_experts" not in d:
            d["num_local_experts"] = d["num_experts"]          # Qwen3-MoE's name for E
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None, "llama3"):
            raise ValueError(f"rope_type {kind!r} is not supported: only default RoPE and 'llama3'")
        d["rope_scaling"] = (dict({k: v for k, v in rope.items() if k not in ("rope_theta", "type")},
                                  rope_type="llama3") if kind == "llama3" else None)
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        scaling = dict(self.rope_scaling) if self.rope_scaling else None
        d.update(architectures=[FAMILIES[self.model_type]], hidden_act="silu",
                 torch_dtype="float32", rope_scaling=scaling,
                 rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta})
        del d["moe_capacity_factor"]                  # a training option, not the model's
        moe_keys = ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                    "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers")
        if self.model_type == "mixtral":              # its experts are intermediate_size wide
            for key in ("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                del d[key]
        elif self.model_type == "qwen3_moe":
            d["num_experts"] = d.pop("num_local_experts")
        else:
            for key in moe_keys:
                del d[key]
        return d


# model_type -> the transformers class a config.json of that family names
FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}
