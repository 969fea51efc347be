"""Axolotl's tokenizer keys, applied: special and plain tokens added to the run's tokenizer, added
tokens renamed, the chat template named, and the vocabulary the base model's embedding is resized to.

    special_tokens:                 bos_token, eos_token, pad_token, unk_token: a text each (one the
      eos_token: "<|im_end|>"       tokenizer lacks is added as a special token, never split), and
      pad_token: "<pad>"            additional_special_tokens: [...]; the model config's bos / eos /
                                    pad ids follow the tokenizer's (generation stops at the new eos)
    tokens: ["<|im_start|>"]        plain added tokens (never split; decoded as text)
    added_tokens_overrides:         {id: text}: an added token the tokenizer has (Llama 3's reserved
      {128011: "<|im_start|>"}      ones) renamed, its id and row kept
    chat_template, chat_template_jinja   the template (chat_templates.py), saved with the tokenizer
    resize_token_embeddings_to_32x  a resized vocabulary rounded up to a multiple of 32
    mean_resizing_embeddings        new rows: the old rows' mean (true), or N(0, initializer_range)
                                    (false: Axolotl's default; models/resize_vocab.py)
    shrink_embeddings               a base vocabulary larger than the tokenizer cut down to it

The vocabulary, by Axolotl's rule: a base model's embedding (and untied lm_head) is resized only
when the tokenizer has more tokens than it has rows: to len(tokenizer) (or its multiple of 32); a
base whose vocab_size already covers the new ids (Qwen's padded vocabularies) keeps its rows, and
the new tokens take rows it never trained. Under tp the resized size must divide by tp (the
vocabulary is split in rows); the refusal says to round it (resize_token_embeddings_to_32x).

Under adapter: lora the embedding is frozen, so a new bos / eos / unk token would keep its initial
row forever: Axolotl refuses that unless lora_modules_to_save trains the embedding, which minipar
does not support, so it is refused here (a new pad token, never trained on, and `tokens` are
accepted, as in Axolotl). The export writes the tokenizer with its added tokens and template, the
resized rows in model.safetensors (a LoRA adapter directory: in adapter_model.safetensors under
PEFT's names, which PEFT loads after resizing the base to the saved tokenizer).

Pure Python on the host, before any collective; transformers' tokenizer is the only library used.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import List, Optional

from minipar.trainer.data.chat_templates import choice_problem, resolve
from minipar.trainer.data.tokenizer import HFTokenizer, load_tokenizer, tokenizer_path
from models.hf_checkpoint import TOKENIZER_FILES
from models.resize_vocab import VocabResize

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
ADDITIONAL = "additional_special_tokens"
# the keys of a run's config that change its tokenizer (what export and load_model rebuild it from)
TOKENIZER_KEYS = ("special_tokens", "tokens", "added_tokens_overrides", "chat_template",
                  "chat_template_jinja")


def _get(settings, key):
    """A key of a TrainConfig or of the config dict a checkpoint saved."""
    return settings.get(key) if isinstance(settings, dict) else getattr(settings, key, None)


def key_problems(settings, notes: Optional[list] = None) -> List[str]:
    """What is wrong with the file's tokenizer keys, before any tokenizer is read; a note in `notes`
    for each that has no effect on the byte tokenizer (no tokenizer_config or base_model)."""
    out = []
    if notes is not None and not (_get(settings, "tokenizer_config") or _get(settings, "base_model")):
        for key in ("special_tokens", "tokens", "added_tokens_overrides"):
            if _get(settings, key):
                notes.append(f"{key}: {_get(settings, key)!r} has no effect here: no tokenizer_config or "
                             f"base_model, so the run reads bytes (256 ids, no special tokens)")
    special = _get(settings, "special_tokens")
    if special is not None:
        if not isinstance(special, dict):
            out.append(f"special_tokens must be a mapping of {', '.join(SPECIAL_KEYS)} to texts, "
                       f"got {special!r}")
        else:
            for key, value in special.items():
                if key == ADDITIONAL:
                    if not (isinstance(value, list) and all(isinstance(v, str) and v for v in value)):
                        out.append(f"special_tokens.{ADDITIONAL} must be a list of texts, got {value!r}")
                elif key not in SPECIAL_KEYS:
                    out.append(f"special_tokens.{key} is not a special token; known: "
                               f"{', '.join(SPECIAL_KEYS + (ADDITIONAL,))}")
                elif value is not None and not (isinstance(value, str) and value):
                    out.append(f"special_tokens.{key} must be a token's text, got {value!r}")
    tokens = _get(settings, "tokens")
    if tokens is not None and not all(isinstance(t, str) and t for t in tokens):
        out.append(f"tokens must be a list of texts, got {tokens!r}")
    overrides = _get(settings, "added_tokens_overrides")
    if overrides is not None and not (isinstance(overrides, dict) and all(
            isinstance(_id(k), int) and isinstance(v, str) and v for k, v in overrides.items())):
        out.append(f"added_tokens_overrides must map token ids to texts ({{128011: \"<|im_start|>\"}}), "
                   f"got {overrides!r}")
    problem = choice_problem(_get(settings, "chat_template"), _get(settings, "chat_template_jinja"))
    if problem:
        out.append(problem)
    return out


def _id(key) -> Optional[int]:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


def changes_tokenizer(settings) -> bool:
    return any(_get(settings, k) for k in TOKENIZER_KEYS)


# ------------------------------------------------------------------------------ the tokenizer
def _overridden_copy(path: str, overrides: dict, directory: str) -> None:
    """The tokenizer files of `path` in `directory`, each added token of `overrides` renamed (its id
    kept) in tokenizer.json (added_tokens, the model's vocabulary) and tokenizer_config.json."""
    for name in TOKENIZER_FILES + ("config.json",):   # the tokenizer's files only, never the weights
        if os.path.isfile(os.path.join(path, name)):
            shutil.copyfile(os.path.join(path, name), os.path.join(directory, name))
    want = {_id(k): v for k, v in overrides.items()}
    tj = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tj):
        raise ValueError(f"added_tokens_overrides: {path} has no tokenizer.json to rename tokens in")
    with open(tj, encoding="utf-8") as f:
        data = json.load(f)
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    missing = sorted(i for i in want if i not in added)
    if missing:
        raise ValueError(f"added_tokens_overrides: ids {missing} are no added tokens of {path} (its added "
                         f"tokens: {sorted(added)[:8]}...); only added tokens can be renamed")
    vocab = (data.get("model") or {}).get("vocab")
    renamed = {}
    for i, text in want.items():
        old = added[i]["content"]
        added[i]["content"], renamed[old] = text, text
        if isinstance(vocab, dict) and vocab.get(old) == i:
            vocab[text] = vocab.pop(old)
    with open(tj, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):   # where the old texts are named
        path_ = os.path.join(directory, name)
        if os.path.isfile(path_):
            with open(path_, encoding="utf-8") as f:
                config = json.load(f)
            with open(path_, "w", encoding="utf-8") as f:
                json.dump(_renamed(config, renamed), f, ensure_ascii=False)


def _renamed(value, renamed: dict):
    """A JSON value with every token text of `renamed` (a string, or an AddedToken's "content")
    replaced; the chat template left as written."""
    if isinstance(value, str):
        return renamed.get(value, value)
    if isinstance(value, list):
        return [_renamed(v, renamed) for v in value]
    if isinstance(value, dict):
        return {k: v if k == "chat_template" else _renamed(v, renamed) for k, v in value.items()}
    return value


def _load(path: Optional[str], overrides: Optional[dict]):
    if not overrides:
        return load_tokenizer(path)
    if path is None:
        raise ValueError("added_tokens_overrides needs a tokenizer directory (tokenizer_config or "
                         "base_model)")
    with tempfile.TemporaryDirectory(prefix="minipar-tokenizer-") as tmp:
        _overridden_copy(path, overrides, tmp)
        tok = load_tokenizer(tmp)
    tok.source = path                             # the files it came from (the prepared data's key)
    tok.changes["added_tokens_overrides"] = {str(k): v for k, v in sorted(overrides.items(), key=str)}
    return tok


def lora_problem(tokenizer: HFTokenizer, special: dict) -> Optional[str]:
    """Axolotl's refusal under an adapter: a bos / eos / unk text that is new to the tokenizer (more
    than 2 tokens today) would get a frozen, untrained embedding row."""
    new = [f"{k}: {v}" for k, v in special.items() if k in ("bos_token", "eos_token", "unk_token") and v
           and getattr(tokenizer.tok, k) != v and len(tokenizer.encode(v)) > 2]
    if not new:
        return None
    return (f"special_tokens {', '.join(new)}: new tokens under adapter: lora would keep an untrained "
            f"embedding row (the embedding is frozen; Axolotl asks for lora_modules_to_save: [embed_tokens, "
            f"lm_head], which minipar does not support): use a token the tokenizer has, or a full fine-tune "
            f"(adapter: null)")


def run_tokenizer(settings, notes: Optional[list] = None):
    """The run's tokenizer: tokenizer_config (or base_model) loaded, added_tokens_overrides, special
    tokens and tokens added, the named chat template set. `settings`: a TrainConfig, or the config
    dict a checkpoint saved (export and load_model rebuild the tokenizer the run used)."""
    path = tokenizer_path(settings) if not isinstance(settings, dict) else \
        (settings.get("tokenizer_config") or settings.get("base_model"))
    tok = _load(path, _get(settings, "added_tokens_overrides"))
    special = {k: v for k, v in (_get(settings, "special_tokens") or {}).items() if v}
    tokens = list(_get(settings, "tokens") or [])
    template = _get(settings, "chat_template")
    if not isinstance(tok, HFTokenizer):        # the byte tokenizer: noted at load (key_problems)
        return tok
    if special and _get(settings, "adapter") == "lora":
        problem = lora_problem(tok, special)
        if problem:
            raise ValueError(problem)
    before = len(tok.tok)
    if special:
        extra = special.pop(ADDITIONAL, None)
        tok.tok.add_special_tokens(_added(special))
        if extra:
            _add_extra(tok.tok, extra)
            special[ADDITIONAL] = extra
        tok.changes["special_tokens"] = special
    if tokens:
        tok.tok.add_tokens(_added_list(tokens))
        tok.changes["tokens"] = tokens
    if template:
        text = resolve(template, _get(settings, "chat_template_jinja"), tok.chat_template, "chat_template")
        if text is not None and text != tok.chat_template:
            tok.set_chat_template(text)
    tok.refresh()
    if notes is not None and tok.vocab_size != before:
        notes.append(f"tokenizer: {tok.vocab_size - before} tokens added ({before} -> {tok.vocab_size})")
    return tok


def _add_extra(tok, texts) -> None:
    """additional_special_tokens added to the tokenizer's extra special tokens (transformers 5 names
    them extra_special_tokens; 4 additional_special_tokens), the ones it has kept."""
    import inspect
    params = inspect.signature(tok.add_special_tokens).parameters
    key = "extra_special_tokens" if "replace_extra_special_tokens" in params else ADDITIONAL
    tok.add_special_tokens({key: _added_list(texts, special=True)}, **{f"replace_{key}": False})


def _added(special: dict) -> dict:
    from tokenizers import AddedToken  # as Axolotl adds them: never split, never stripped
    return {k: AddedToken(v, rstrip=False, lstrip=False, normalized=False, special=True)
            for k, v in special.items()}


def _added_list(texts, special: bool = False) -> list:
    from tokenizers import AddedToken
    return [AddedToken(t, rstrip=False, lstrip=False, normalized=False, special=special) for t in texts]


def model_token_ids(model_config, tokenizer, special: Optional[dict]) -> List[str]:
    """The model config's bos / eos / pad ids for the special tokens the file sets (the file's
    tokens win over config.json's); returns the keys set."""
    set_keys = []
    for key in ("bos_token", "eos_token", "pad_token"):
        if special and special.get(key) and getattr(tokenizer, "tok", None) is not None:
            value = getattr(tokenizer.tok, f"{key}_id")
            if value is not None and getattr(model_config, f"{key}_id") != value:
                setattr(model_config, f"{key}_id", value)
                set_keys.append(f"{key}_id")
    return set_keys


# ------------------------------------------------------------------------------ the vocabulary
def resize_base_vocab(cfg, tokenizer, base, notes: list) -> None:
    """base_model's vocabulary resized to the tokenizer's by Axolotl's rule: the checkpoint reader
    makes the new rows (models/resize_vocab.py), cfg.model.vocab_size follows; one note."""
    c = cfg.model
    new = embeddings_len(tokenizer.vocab_size, c.vocab_size, cfg.resize_token_embeddings_to_32x,
                         cfg.shrink_embeddings)
    if new is None:
        return
    base.resize_vocab(VocabResize(c.vocab_size, new, cfg.mean_resizing_embeddings, c.initializer_range,
                                  cfg.seed))
    rows = "the mean of the old ones" if cfg.mean_resizing_embeddings else f"N(0, {c.initializer_range:g})"
    which = "embed_tokens" if c.tie_word_embeddings else "embed_tokens and lm_head"
    notes.append(f"vocabulary {c.vocab_size} -> {new} (the tokenizer's {tokenizer.vocab_size} tokens): "
                 f"{which} resized, new rows {rows}")
    c.vocab_size = new


def embeddings_len(n_tokens: int, vocab: int, to_32x: bool = False, shrink: bool = False) -> Optional[int]:
    """The base's new vocabulary size for a tokenizer of n_tokens, by Axolotl's rule (None: keep
    `vocab`): grown when the tokenizer has more tokens, shrunk only with shrink_embeddings."""
    want = -(-n_tokens // 32) * 32 if to_32x else n_tokens
    if want > vocab or (shrink and want < vocab):
        return want
    return None
