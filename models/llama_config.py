"""LlamaConfig: the decoder's shape, with Hugging Face's config.json keys, read and written.

The fields are transformers' config names, so `from_dict(json.load(config.json))` reads a real
checkpoint's config (transformers 4 writes rope_theta and rope_scaling, 5 rope_parameters) and
`to_hf_dict()` writes one that transformers loads. Checked on construction: heads divide the
hidden size (or head_dim is given), query heads are a multiple of KV heads (GQA), token ids are
integers, and rope_scaling is None or Llama 3.1's (models/rope.py applies it).

One config, seven families (`model_type`), because they share one decoder (models/llama.py); each
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
does not (a sliding window outside qwen2/mistral/phi3, router jitter noise, shared experts,
longrope and other RoPE scalings, dropout) is refused by name.
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
    # sliding-window attention (WINDOWED families only; see attention_window) and Phi-3's partial RoPE
    sliding_window: Optional[int] = None
    use_sliding_window: Optional[bool] = None     # qwen2's switch (transformers' default false)
    max_window_layers: Optional[int] = None       # qwen2: layers i >= this are windowed (default 28)
    layer_types: Optional[List[str]] = None       # qwen2: "sliding_attention" | "full_attention" per layer
    partial_rotary_factor: float = 1.0            # phi3: RoPE on the first head_dim * factor channels
    original_max_position_embeddings: Optional[int] = None   # phi3: kept for the export only

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
        self._check_family()
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

    def _check_family(self):
        """The per-family settings: a window only where the family has one, qwen2's layer_types."""
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
            n = self.num_hidden_layers
            if self.layer_types is None:
                self.layer_types = ["sliding_attention" if self.sliding_window is not None
                                    and i >= self.max_window_layers else "full_attention" for i in range(n)]
            kinds = ("sliding_attention", "full_attention")
            if len(self.layer_types) != n or any(t not in kinds for t in self.layer_types):
                raise ValueError(f"layer_types={self.layer_types}: one of {kinds} per layer ({n} layers)")
        else:
            self.use_sliding_window = self.max_window_layers = self.layer_types = None
            if W is not None and kind not in ("mistral", "phi3"):
                raise ValueError(f"model_type {kind!r} has no sliding window here (sliding_window={W}): "
                                 f"set it to null, or use model_type mistral, phi3 or qwen2")
        rotary = self.head_dim * self.partial_rotary_factor
        if self.partial_rotary_factor != 1.0 and (kind != "phi3" or not 0 < rotary <= self.head_dim
                                                 or int(rotary) % 2):
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor}: only phi3 rotates part of "
                             f"each head, an even number of channels of head_dim={self.head_dim}")

    def attention_window(self, i: int) -> Optional[int]:
        """The sliding window W of decoder layer i (None: full causal attention): every layer of a
        mistral or phi3 model with sliding_window set, qwen2's "sliding_attention" layers."""
        if self.sliding_window is None:
            return None
        if self.model_type == "qwen2":
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window

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
        if kind not in WINDOWED:
            if d.get("sliding_window") is not None and d.get("use_sliding_window", kind != "qwen3_moe"):
                unsupported.append(f"sliding_window={d['sliding_window']} (attention here is full causal)")
            for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"):
                d.pop(key, None)                  # off (use_sliding_window false): ignored, as transformers
        elif kind == "mistral":
            d.setdefault("sliding_window", 4096)  # transformers' MistralConfig default
        if kind in WINDOWED:                      # minipar trains without dropout
            unsupported += [f"{key}={d[key]} (set it to 0)" for key in ("attention_dropout", "resid_pdrop",
                                                                          "embd_pdrop") if d.get(key)]
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
        if "partial_rotary_factor" in rope:      # transformers 5 keeps it in rope_parameters
            d.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", None, "llama3"):
            raise ValueError(f"rope_type {kind!r} is not supported: only default RoPE and 'llama3' "
                             f"(Phi-3's longrope / su / yarn: use a checkpoint with rope_scaling null)")
        d["rope_scaling"] = (dict({k: v for k, v in rope.items()
                                   if k not in ("rope_theta", "type", "partial_rotary_factor")},
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
        family_keys = {"qwen2": ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types"),
                       "mistral": ("sliding_window",),
                       "phi3": ("sliding_window", "partial_rotary_factor",
                                "original_max_position_embeddings")}
        for key in ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                    "partial_rotary_factor", "original_max_position_embeddings"):
            if key not in family_keys.get(self.model_type, ()) or d[key] is None and key != "sliding_window":
                del d[key]
        if self.model_type in WINDOWED:               # biases fixed by the family, not config keys
            del d["attention_bias"], d["mlp_bias"]
        if self.model_type == "phi3":                 # transformers 5 reads it from rope_parameters
            d["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
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
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
            "phi3": "Phi3ForCausalLM"}
# the families whose attention may have a sliding window (LlamaConfig.attention_window)
WINDOWED = ("qwen2", "mistral", "phi3")
# model_type -> transformers' decoder-layer class: what Axolotl's transformer_layer_cls_to_wrap
# names; every one is minipar's LlamaDecoderLayer (models/llama_layer.py), the ZeRO-3 unit
DECODER_LAYERS = {kind: arch.replace("ForCausalLM", "DecoderLayer") for kind, arch in FAMILIES.items()}
