"""Axolotl's `model_type` and `tokenizer_type` (the transformers classes its loader instantiates),
checked against the checkpoint they would load, since minipar builds the model from config.json
itself and loads the tokenizer with AutoTokenizer:

    model_type       AutoModelForCausalLM, or the family's class of config.json's model_type
                     (llama -> LlamaForCausalLM, mistral -> MistralForCausalLM, ...: FAMILIES)
    tokenizer_type   AutoTokenizer, PreTrainedTokenizerFast, the tokenizer_class its
                     tokenizer_config.json names, or the family's tokenizer (TOKENIZERS), each in its
                     slow or Fast form

Anything else names another model than the one base_model holds (model_type: MistralForCausalLM on
a Llama checkpoint): Axolotl would load the weights into the wrong class, and minipar refuses it in
the file's one message, naming both. Without base_model the model is the `model` section's (a
model_type is checked against its family, and noted); without a tokenizer directory the tokenizer
is the byte tokenizer (tokenizer_type noted). Reads two small JSON files; no torch, no transformers.
"""
from __future__ import annotations

import json
import os
from typing import List, Optional

from models.hf_config import FAMILIES

AUTO_MODELS = ("AutoModelForCausalLM",)
AUTO_TOKENIZERS = ("AutoTokenizer", "PreTrainedTokenizerFast")
# model_type -> the tokenizer classes its checkpoints ship (Mistral, Mixtral and Phi-3 use Llama's;
# Gemma 2 and 3 ship GemmaTokenizer)
TOKENIZERS = {"llama": "LlamaTokenizer", "mistral": "LlamaTokenizer", "mixtral": "LlamaTokenizer",
              "phi3": "LlamaTokenizer", "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer",
              "qwen3_moe": "Qwen2Tokenizer", "gemma2": "GemmaTokenizer", "gemma3_text": "GemmaTokenizer"}


def _both(name: str) -> List[str]:
    """A tokenizer class in its slow and Fast forms."""
    base = name[:-len("Fast")] if name.endswith("Fast") else name
    return [base, base + "Fast"]


def tokenizer_class(directory: Optional[str]) -> Optional[str]:
    """tokenizer_config.json's tokenizer_class in `directory` (None: no file, or it names none)."""
    path = os.path.join(directory, "tokenizer_config.json") if directory else None
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def model_classes(kind: str) -> List[str]:
    return [*AUTO_MODELS, FAMILIES.get(kind, "LlamaForCausalLM")]


def tokenizer_classes(kind: str, declared: Optional[str]) -> List[str]:
    names = list(AUTO_TOKENIZERS) + _both(TOKENIZERS.get(kind, "LlamaTokenizer"))
    return list(dict.fromkeys(names + (_both(declared) if declared else [])))


def class_problems(cfg, notes: List[str]) -> List[str]:
    """The refusals of model_type / tokenizer_type that do not fit the model and tokenizer the run
    loads (one line each, naming both); a note where there is nothing to check them against."""
    out = []
    kind = cfg.model.model_type
    base, tok_dir = cfg.base_model, cfg.tokenizer_config or cfg.base_model
    if cfg.model_type:
        what = f"base_model {base!r} (config.json: {FAMILIES.get(kind)}, model_type {kind!r})" if base else \
            f"the `model` section (model_type {kind!r}: {FAMILIES.get(kind)})"
        if cfg.model_type not in model_classes(kind):
            out.append(f"model_type: {cfg.model_type} does not match {what}: write model_type: "
                       f"{' or '.join(model_classes(kind))}, or remove it")
        elif not base:
            notes.append(f"model_type: {cfg.model_type!r} has no effect here: no base_model; the model is "
                         f"minipar's decoder built from the `model` section ({FAMILIES.get(kind)})")
    if cfg.tokenizer_type:
        if not tok_dir:
            notes.append(f"tokenizer_type: {cfg.tokenizer_type!r} has no effect here: no tokenizer_config or "
                         f"base_model, so the run reads bytes (256 ids)")
        else:
            declared = tokenizer_class(tok_dir)
            accepted = tokenizer_classes(kind, declared)
            if cfg.tokenizer_type not in accepted:
                said = f"declares {declared}" if declared else "declares no tokenizer_class"
                out.append(f"tokenizer_type: {cfg.tokenizer_type} does not match the tokenizer of "
                           f"{tok_dir!r} (its tokenizer_config.json {said}; model_type {kind!r}): write "
                           f"tokenizer_type: {' or '.join(accepted)}, or remove it")
    return out
