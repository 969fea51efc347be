"""The tokenizer of a run: the model's own (a Hugging Face tokenizer directory), or bytes.

    tokenizer_config: DIR      AutoTokenizer.from_pretrained(DIR); default: base_model when set
    (neither)                  the bundled ByteTokenizer (batches.py): 256 ids, no special tokens

What a run takes from a Hugging Face tokenizer, and where it goes:

    len(tokenizer)             the vocabulary: model.vocab_size is at least this (a model built from
                               scratch gets it, rounded up to a multiple of 64 as Megatron pads)
    bos_token_id, eos_token_id a completion row is [bos] + text + [eos]; a chat row is what the chat
                               template renders (it places its own bos / end-of-turn tokens)
    pad_token_id               fills what packing or a short row leaves empty (labels -100 there);
                               the eos id when the tokenizer has no pad token, else 0
    chat_template              renders `messages` of type: chat_template rows (datasets.py)
    (all three special ids)    the model config's bos/eos/pad_token_id where it has none, so the
                               exported config.json carries them (fill_special_token_ids)

A run's Axolotl keys change the loaded tokenizer before any row is tokenized: special_tokens,
tokens and added_tokens_overrides add or rename tokens, chat_template names its template
(special_tokens.py, chat_templates.py); HFTokenizer.changes records them for the prepared data's key.

transformers is imported here only, and only when a tokenizer directory is named, so the core
package still imports with torch alone. Both tokenizers answer the same small interface:
vocab_size, bos_token_id, eos_token_id, pad_token_id, encode(text) and decode(ids).

The byte tokenizer in a Hugging Face export (save_byte_tokenizer): a tokenizer.json written by
hand (json only, no `tokenizers` package needed at run time) that transformers loads as a
PreTrainedTokenizerFast and that gives the ids ByteTokenizer gives, byte b -> id b:

    pre_tokenizer  ByteLevel, no regex, no prefix space: the text's UTF-8 bytes, each shown as
                   GPT-2's printable stand-in character (bytes_to_unicode)
    model          BPE with those 256 characters as its vocabulary (id = the byte) and no merges,
                   so every byte stays one token
    decoder        ByteLevel: the stand-ins back to bytes, then UTF-8
    special tokens none, as ByteTokenizer (no bos/eos; the exported config.json has none either)
"""
from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence, Tuple

from minipar.trainer.data.batches import ByteTokenizer

VOCAB_MULTIPLE = 64


class HFTokenizer:
    """A transformers tokenizer seen through the small interface the data pipeline uses."""

    def __init__(self, tok, source: str, changes: Optional[dict] = None):
        self.tok, self.source = tok, source
        self.vocab_size = len(tok)
        self.bos_token_id, self.eos_token_id = tok.bos_token_id, tok.eos_token_id
        self.eos_token = tok.eos_token       # its text: where an assistant turn's training ends
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_token_id = 0 if pad is None else pad
        # what the run changed in it (special_tokens.py, chat_templates.py): the prepared data's key
        self.changes: dict = changes if changes is not None else {}

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tok, "chat_template", None))

    @property
    def chat_template(self) -> Optional[str]:
        template = getattr(self.tok, "chat_template", None)
        return template if isinstance(template, str) else None

    def set_chat_template(self, template: str) -> None:
        """The run's named template becomes the tokenizer's own: rendered, then saved with it."""
        self.tok.chat_template = template
        self.changes["chat_template"] = template

    def refresh(self) -> None:
        """Read the special tokens and the vocabulary again after tokens were added."""
        self.__init__(self.tok, self.source, self.changes)

    def encode(self, text: str) -> List[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        """Token ids of `text` and each token's character span in it (a fast tokenizer's offsets)."""
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def render_chat(self, messages: list, template: Optional[str] = None, **variables) -> str:
        """The conversation as text, by `template` (None: the tokenizer's own), with the template's
        extra `variables` (real_last_index, chat_format.py); a template's raise_exception (roles that
        do not alternate, a system turn it has none for) a ValueError."""
        from jinja2 import TemplateError
        try:
            return self.tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                add_generation_prompt=False, **variables)
        except TemplateError as err:
            raise ValueError(f"the chat template refuses the conversation: {err}") from None

    def save_pretrained(self, directory: str) -> None:
        self.tok.save_pretrained(directory)


def tokenizer_path(cfg) -> Optional[str]:
    """tokenizer_config, or base_model when only that is set (Axolotl's rule), or None (bytes)."""
    return cfg.tokenizer_config or getattr(cfg, "base_model", None)


def load_tokenizer(path: Optional[str]):
    """ByteTokenizer for None; else the directory's tokenizer through AutoTokenizer (local files only)."""
    if path is None:
        return ByteTokenizer()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer_config={path!r}: no such directory; point it at a Hugging Face "
                                f"tokenizer directory (tokenizer.json / tokenizer_config.json)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("tokenizer_config needs the transformers package: "
                          "pip install transformers") from None
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"tokenizer_config={path!r}: AutoTokenizer cannot load it ({err})") from None
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer_config={path!r} loaded a slow tokenizer; "
                         f"label masking needs the character "
                         f"offsets of a fast one (a tokenizer.json)")
    return HFTokenizer(tok, path)


def special_token_ids(tokenizer) -> dict:
    """{bos_token_id, eos_token_id, pad_token_id} as a config.json records them: the tokenizer's own
    special tokens, None where it has none. The pad id is the tokenizer's pad token only, not the
    eos / 0 that fills rows without one; the byte tokenizer has none of the three."""
    tok = getattr(tokenizer, "tok", None)          # HFTokenizer's transformers tokenizer
    return dict(bos_token_id=getattr(tokenizer, "bos_token_id", None),
                eos_token_id=getattr(tokenizer, "eos_token_id", None),
                pad_token_id=getattr(tok, "pad_token_id", None) if tok is not None else None)


def fill_special_token_ids(model_config, tokenizer) -> List[str]:
    """Set the model config's bos/eos/pad ids that are still None from the tokenizer (those a base
    model's config.json gives are kept); returns the keys set. They reach the exported config.json."""
    filled = []
    for key, value in special_token_ids(tokenizer).items():
        if getattr(model_config, key) is None and value is not None:
            setattr(model_config, key, value)
            filled.append(key)
    return filled


def padded_vocab_size(n: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """n rounded up to a multiple of `multiple`: the same on every layout, and divisible by any tp
    that divides `multiple`."""
    return -(-n // multiple) * multiple


# -------------------------------------------------------------- the byte tokenizer, for transformers
def bytes_to_unicode() -> dict:
    """GPT-2's map of the 256 bytes to printable characters (tokenizers' ByteLevel uses the same):
    printable Latin-1 bytes stand for themselves, the others for chr(256 + n)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(rest)}}


def save_byte_tokenizer(directory: str) -> list:
    """Write tokenizer.json + tokenizer_config.json for ByteTokenizer into `directory`; returns
    the names. AutoTokenizer.from_pretrained(directory) then encodes as ByteTokenizer does."""
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=False, use_regex=False)
    stand_in = bytes_to_unicode()
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
                 "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
                 "decoder": byte_level,
                 "model": {"type": "BPE", "dropout": None, "unk_token": None,
                           "continuing_subword_prefix": None,
                           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                           "vocab": {stand_in[b]: b for b in range(ByteTokenizer.vocab_size)}, "merges": []}}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_input_names": ["input_ids", "attention_mask"]}
    os.makedirs(directory, exist_ok=True)
    for name, content in (("tokenizer.json", tokenizer), ("tokenizer_config.json", config)):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(content, f, ensure_ascii=False, indent=1)
    return ["tokenizer.json", "tokenizer_config.json"]


def save_tokenizer(tokenizer, directory: str) -> None:
    """The run's tokenizer beside an export: the model's own (save_pretrained), or the bytes."""
    if isinstance(tokenizer, ByteTokenizer):
        save_byte_tokenizer(directory)
    elif hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
