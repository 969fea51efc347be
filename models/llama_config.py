"""LlamaConfig: the decoder's shape, with Hugging Face's config.json keys, read and written.

The fields are transformers' LlamaConfig names, so `from_dict(json.load(config.json))` reads a
real checkpoint's config (transformers 4 writes rope_theta and rope_scaling, 5 rope_parameters)
and `to_hf_dict()` writes one that transformers loads. Checked on construction: heads divide the
hidden size (or head_dim is given), query heads are a multiple of KV heads (GQA), token ids are
integers, and rope_scaling is None or Llama 3.1's (models/rope.py applies it).
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
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if kind != "llama3" or missing:
                raise ValueError(f"rope_scaling {self.rope_scaling}: only rope_type 'llama3' (with "
                                 f"{', '.join(LLAMA3_ROPE_KEYS)}) or default RoPE (null) is supported")

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """From a Hugging Face config.json (transformers 4 writes rope_theta, 5 rope_parameters)."""
        d = dict(d)
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
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 torch_dtype="float32", rope_scaling=scaling,
                 rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": self.rope_theta})
        return d
