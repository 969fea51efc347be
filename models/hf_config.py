"""config.json <-> LlamaConfig: each family's keys as transformers reads and writes them.

A Hugging Face config.json names its family (`model_type`, `architectures`) and spells a few
settings its own way; `from_hf_dict` turns one into LlamaConfig's fields (models/llama_config.py)
and `to_hf_dict` writes the config.json that transformers loads back into the same class:

    RoPE      transformers 4: rope_theta, rope_scaling {rope_type llama3 | linear, ...}
              transformers 5: rope_parameters {rope_type, rope_theta, ...} -- and for Gemma 3 one
              such dict per layer kind: {"full_attention": {...}, "sliding_attention": {...}}
              (transformers 4: rope_theta for the global layers, rope_local_base_freq for the local)
    windows   qwen2: use_sliding_window + max_window_layers (or layer_types); mistral / phi3:
              sliding_window alone (absent: 4096); gemma2 / gemma3_text: layer_types, or Gemma 2's
              every-other-layer default, Gemma 3's sliding_window_pattern (every 6th layer global)
    activation  hidden_act "silu" (Llama's SwiGLU), but Gemma's hidden_activation
              "gelu_pytorch_tanh" (GeGLU)
    defaults  a key the file leaves out takes transformers' default of that family (Gemma's head_dim
              256, its soft-caps, its tied embeddings, ...), not Llama's

What a family allows and minipar does not is refused here, by name, before any process group
exists: dropout, router jitter, shared experts, RoPE scalings other than llama3 / linear, Gemma's
bidirectional attention (EmbeddingGemma's), another activation. A key minipar ignores (use_cache,
torch_dtype, ...) is dropped.
"""
from __future__ import annotations

import dataclasses

# model_type -> the transformers class a config.json of that family names
FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
            "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# the families whose attention may have a sliding window (LlamaConfig.attention_window)
WINDOWED = ("qwen2", "mistral", "phi3", "gemma2", "gemma3_text")
# the Gemma families: (1 + weight) norms, sandwich norms, GeGLU, scaled embeddings, soft-capping
GEMMA = ("gemma2", "gemma3_text")
# the families whose layers say their kind ("sliding_attention" | "full_attention") in layer_types
LAYER_TYPED = ("qwen2",) + GEMMA
# model_type -> transformers' decoder-layer class: what Axolotl's transformer_layer_cls_to_wrap
# names; every one is minipar's LlamaDecoderLayer (models/llama_layer.py), the ZeRO-3 unit
DECODER_LAYERS = {kind: arch.replace("ForCausalLM", "DecoderLayer") for kind, arch in FAMILIES.items()}
GELU_TANH = "gelu_pytorch_tanh"
# transformers' defaults (Gemma2Config, Gemma3TextConfig) for the keys a config.json may leave out
GEMMA_DEFAULTS = {
    "gemma2": dict(head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   rope_theta=10000.0),
    "gemma3_text": dict(head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256,
                        sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
}
# keys only some families write: (the families that keep it, drop it if None)
FAMILY_KEYS = {
    "sliding_window": (WINDOWED, False), "use_sliding_window": (("qwen2",), True),
    "max_window_layers": (("qwen2",), True), "layer_types": (LAYER_TYPED, True),
    "partial_rotary_factor": (("phi3",), True), "original_max_position_embeddings": (("phi3",), True),
    "query_pre_attn_scalar": (GEMMA, True), "final_logit_softcapping": (GEMMA, False),
    "attn_logit_softcapping": (GEMMA, False), "rope_local_base_freq": (("gemma3_text",), True),
}
MOE_KEYS = ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers")


def activation_problem(d: dict) -> str:
    """Why config.json `d`'s MLP activation is not its family's here ('' if it is): SwiGLU's silu,
    or Gemma's GeGLU with the tanh-approximated GELU (hidden_activation; transformers 4 also wrote
    hidden_act)."""
    if d.get("model_type") in GEMMA:
        act = d.get("hidden_activation") or d.get("hidden_act") or GELU_TANH
        return "" if act == GELU_TANH else \
            f"hidden_activation {act!r}; Gemma's MLP here is GeGLU with {GELU_TANH!r}"
    act = d.get("hidden_act", "silu")
    return "" if act == "silu" else f"hidden_act {act!r}; the Llama MLP here is SwiGLU (silu)"


def _rope(d: dict, kind: str) -> None:
    """rope_parameters / rope_scaling (either transformers) -> rope_theta, rope_scaling (None,
    llama3's or linear's dict) and, for Gemma 3, rope_local_base_freq: in place."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if kind == "gemma3_text" and "full_attention" in rope:      # transformers 5: one dict per kind
        local = dict(rope.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"model_type {kind!r}: rope_type {local['rope_type']!r} on the local "
                             f"(sliding_attention) layers is not supported: only default RoPE there")
        if "rope_theta" in local:
            d["rope_local_base_freq"] = local["rope_theta"]
        rope = rope.get("full_attention") or {}
        if d.get("rope_scaling"):                              # transformers 4's key, for the global layers
            rope = {**rope, **d["rope_scaling"]}
    rope = dict(rope)
    if "rope_theta" not in d and "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:      # transformers 5 keeps it in rope_parameters
        d.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None, "llama3", "linear"):
        raise ValueError(f"rope_type {rope_type!r} is not supported: only default RoPE, 'linear' and "
                         f"'llama3' "
                         f"(Phi-3's longrope / su / yarn: use a checkpoint with rope_scaling null)")
    d["rope_scaling"] = (dict({k: v for k, v in rope.items()
                               if k not in ("rope_theta", "type", "partial_rotary_factor")},
                              rope_type=rope_type) if rope_type in ("llama3", "linear") else None)


def from_hf_dict(cls, d: dict):
    """A `cls` (LlamaConfig) from a Hugging Face config.json's dict (see the module docstring)."""
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
    if kind in GEMMA and d.get("use_bidirectional_attention"):
        unsupported.append("use_bidirectional_attention=true (EmbeddingGemma's encoder; this decoder "
                           "is causal)")
    problem = activation_problem(d)
    if problem:
        unsupported.append(problem)
    if d.get("router_jitter_noise"):
        unsupported.append(f"router_jitter_noise={d['router_jitter_noise']} (set it to 0)")
    if d.get("shared_expert_intermediate_size"):
        unsupported.append("shared experts (shared_expert_intermediate_size)")
    if unsupported:
        raise ValueError(f"model_type {kind!r}: minipar does not support " + "; ".join(unsupported))
    if "num_experts" in d and "num_local_experts" not in d:
        d["num_local_experts"] = d["num_experts"]          # Qwen3-MoE's name for E
    _rope(d, kind)
    for key, value in GEMMA_DEFAULTS.get(kind, {}).items():
        d.setdefault(key, value)
    if kind == "gemma3_text" and d.get("layer_types") is None:
        n = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))   # every n-th layer global
        d["layer_types"] = ["sliding_attention" if (i + 1) % n else "full_attention"
                            for i in range(d["num_hidden_layers"])]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in fields})


def to_hf_dict(config) -> dict:
    """The config.json of `config` (a LlamaConfig) that transformers loads into its family's class."""
    kind = config.model_type
    d = dataclasses.asdict(config)
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    d.update(architectures=[FAMILIES[kind]], hidden_act="silu", torch_dtype="float32", rope_scaling=scaling,
             rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta})
    del d["moe_capacity_factor"]                  # a training option, not the model's
    for key, (families, drop_none) in FAMILY_KEYS.items():
        if kind not in families or drop_none and d[key] is None:
            del d[key]
    if kind in ("qwen2", "mistral", "phi3"):      # biases fixed by the family, not config keys
        del d["attention_bias"], d["mlp_bias"]
    if kind == "phi3":                            # transformers 5 reads it from rope_parameters
        d["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
    if kind in GEMMA:                             # GeGLU; no MLP biases (attention_bias stays a key)
        del d["hidden_act"], d["mlp_bias"]
        d["hidden_activation"] = GELU_TANH
    if kind == "gemma3_text":                     # one RoPE per layer kind (transformers 5's form)
        d["rope_parameters"] = {"full_attention": d["rope_parameters"],
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": config.rope_local_base_freq}}
    if kind == "mixtral":                         # its experts are intermediate_size wide
        for key in ("moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            del d[key]
    elif kind == "qwen3_moe":
        d["num_experts"] = d.pop("num_local_experts")
    else:
        for key in MOE_KEYS:
            del d[key]
    return d
