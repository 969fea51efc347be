"""Datasets as Axolotl writes them: entries -> token ids and labels, with label masking.

    datasets:
      - path: data/chat.jsonl          {"messages": [{"role": "user", "content": "..."}, ...]}
        type: chat_template            (chat_format.py: field_messages, message_property_mappings,
                                       roles, roles_to_train, train_on_eos)
      - path: data/share.jsonl
        type: sharegpt                 the legacy form: {"conversations": [{"from": "human", "value": ..}]}
      - path: data/alpaca.parquet
        type: alpaca                   {"instruction", "input", "output"} (formats.py)
      - path: data/io.jsonl
        type: input_output             {"segments": [{"text": ..., "label": true|false}]}
      - path: data/notes.jsonl
        type: completion               {"text": "..."}  (`field` names another key)
      - path: data/book.txt
        type: completion               plain text: one example per paragraph (blank-line separated)
    pretraining_dataset: [{path: data/web.jsonl, text_column: text}]   type pretrain (config/axolotl_keys.py)
    train_on_inputs: false             Axolotl's default: train on the responses only
    val_set_size: 0.05                 a fraction of the examples (or, >= 1, a count) held out
    sample_packing: true               packing.py: whole examples packed into sequence_len

Where the rows come from (local json, jsonl, JSON arrays, parquet, arrow, csv, save_to_disk folders,
with split, data_files, name, ds_type) is sources.py; what each format trains is formats.py and
chat_format.py. Several entries are mixed in the order written; packing.py orders the examples.

One example becomes token ids x_0 .. x_{n-1} and labels shifted by one, as the model expects
(label[t] is the target at t, the token x_{t+1}), with -100 where nothing is trained. The last label
of an example is always -100: its next token belongs to no one, so a packed row never trains one
example to predict the next. The loss divides by num_items_in_batch, the count of labels that are
not -100 in the global batch, so masked tokens change neither sum nor count.

Bad rows raise a ValueError naming the file and row (its line in a JSON-lines file): invalid JSON, a
missing field (named), empty or malformed messages, an unknown role, no chat template, and (without
packing) an example longer than sequence_len. A bad entry (an unknown type or key) names the list of
the supported ones. Everything is read and tokenized on every rank, deterministically, before any
collective; nothing is shuffled here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from minipar.batch_split import IGNORE_INDEX
from minipar.trainer.data.chat_format import TRAIN_ON_EOS, chat_row, role_map
from minipar.trainer.data.chat_templates import choice_problem, jinja_text, resolve
from minipar.trainer.data.formats import ALPACA_STYLES, alpaca_row, completion_row, input_output_row
from minipar.trainer.data.sources import SOURCE_KEYS, entry_rows

TYPES = ("completion", "chat_template", "sharegpt", "alpaca", "input_output", "pretrain")
CHAT_KEYS = ("field_messages", "message_property_mappings", "message_field_role", "message_field_content",
             "roles", "roles_to_train", "train_on_eos", "train_on_eot", "field_system", "drop_system_message",
             "chat_template", "chat_template_jinja")
ENTRY_KEYS = set(SOURCE_KEYS) | set(CHAT_KEYS) | {"type", "field", "text_column"}


@dataclass
class Examples:
    """Tokenized examples, concatenated: example i is tokens[offsets[i]:offsets[i+1]] (labels alike)."""
    tokens: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor
    sources: List[str] = field(default_factory=list)     # "file:line" of each example
    notes: List[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def example(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.labels[a:b]

    def subset(self, index: List[int]) -> "Examples":
        pieces = [self.example(i) for i in index]
        lengths = torch.tensor([len(t) for t, _ in pieces], dtype=torch.long)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        cat = (lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.long))
        return Examples(cat([t for t, _ in pieces]), cat([lab for _, lab in pieces]), offsets,
                        [self.sources[i] for i in index])


# ------------------------------------------------------------------------------ the config entries
def _chat_settings(e: dict, kind: str, where: str) -> dict:
    """The chat keys of one entry with Axolotl's defaults (sharegpt: conversations, from / value)."""
    legacy = kind == "sharegpt"
    mapping = dict(e.get("message_property_mappings") or {})
    for key, name in (("role", "message_field_role"), ("content", "message_field_content")):
        if e.get(name):
            if mapping.get(key, e[name]) != e[name]:
                raise ValueError(f"{where}: {name}: {e[name]} contradicts message_property_mappings.{key}: "
                                 f"{mapping[key]}; keep message_property_mappings")
            mapping[key] = e[name]
        mapping.setdefault(key, ("from" if key == "role" else "value") if legacy else key)
    roles = role_map(e.get("roles"))
    eos = e.get("train_on_eos") or "turn"
    if eos not in TRAIN_ON_EOS or e.get("train_on_eot") not in (None, eos):
        raise ValueError(f"{where}: train_on_eos {eos!r} / train_on_eot {e.get('train_on_eot')!r}: "
                         f"use one of "
                         f"{TRAIN_ON_EOS}, and the same for both (the end-of-turn token is the eos here)")
    template, jinja = e.get("chat_template"), e.get("chat_template_jinja")
    problem = choice_problem(template, jinja)
    if problem:
        raise ValueError(f"{where}: {problem}")
    to_train = e.get("roles_to_train")
    to_train = ["assistant"] if to_train is None else list(to_train)
    return dict(field_messages=e.get("field_messages") or ("conversations" if legacy else "messages"),
                message_property_mappings={k: mapping[k] for k in ("role", "content")}, roles=roles,
                roles_to_train=[roles.get(r, r) for r in to_train], train_on_eos=eos,
                field_system=e.get("field_system") or "system",
                drop_system_message=bool(e.get("drop_system_message")),
                **({"chat_template": template} if template else {}),
                **({"chat_template_jinja": jinja_text(jinja)} if jinja else {}))


def check_entries(entries, where: str = "datasets") -> List[dict]:
    """Structural checks of the `datasets` list (no file is read): each a mapping with a known type
    and known keys; returns each entry with its settings and Axolotl's defaults filled in."""
    if not isinstance(entries, list):
        raise ValueError(f"{where} must be a list of {{path, type}} mappings, got {entries!r}")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "path" not in e:
            raise ValueError(f"{where}[{i}] must be a mapping with at least `path` and `type`, got {e!r}")
        at = f"{where}[{i}] ({e['path']})"
        unknown = {k for k, v in e.items() if k not in ENTRY_KEYS and v not in (None, False, [], {})}
        if unknown:
            raise ValueError(f"{at}: unknown keys {sorted(unknown)}; known: {sorted(ENTRY_KEYS)}")
        kind = e.get("type") or "completion"
        base, _, style = str(kind).partition(":")
        if base not in TYPES or (base == "alpaca" and style and style not in ALPACA_STYLES) \
                or (style and base not in ("alpaca", "sharegpt")):
            raise ValueError(f"{at}: type {kind!r} is not supported; use one of {TYPES} (alpaca:chat, "
                             f"alpaca:chatml, alpaca:phi for Axolotl's other alpaca styles)")
        if base in ("chat_template", "sharegpt") and str(e["path"]).endswith(".txt"):
            raise ValueError(f"{at}: type {base} reads rows with `messages`, not the plain text file "
                             f"{e['path']}")
        entry = {k: e[k] for k in SOURCE_KEYS if e.get(k) is not None}
        entry.update(path=str(e["path"]), type=base)
        if base in ("completion", "pretrain"):
            entry["field"] = e.get("field") or e.get("text_column") or "text"
        elif base == "alpaca":
            entry["style"] = style or "instruct"
        elif base in ("chat_template", "sharegpt"):
            entry.update(_chat_settings(e, base, at), type="chat_template")
        out.append(entry)
    return out


# ------------------------------------------------------------------------------ all the files
def _example(e: dict, row, tokenizer, train_on_inputs: bool, where: str) -> Tuple[List[int], List[int]]:
    kind = e["type"]
    if kind in ("completion", "pretrain"):
        return completion_row(row, e["field"], tokenizer, where)
    if kind == "alpaca":
        return alpaca_row(row, tokenizer, train_on_inputs, where, e["style"])
    if kind == "input_output":
        return input_output_row(row, tokenizer, train_on_inputs, where)
    return chat_row(row, e, tokenizer, train_on_inputs, where)


def _chat_entry(e: dict, tokenizer) -> dict:
    """A chat entry with the template its rows are rendered by: the entry's own chat_template
    (chat_templates.py), else the tokenizer's (the run's chat_template, or the tokenizer's own)."""
    if not hasattr(tokenizer, "render_chat"):
        raise ValueError(f"{e['path']}: type chat_template needs a tokenizer with a chat template (a "
                         f"Hugging Face tokenizer); set tokenizer_config (or base_model) to a tokenizer "
                         f"directory")
    own = getattr(tokenizer, "chat_template", None)
    template = resolve(e.get("chat_template"), e.get("chat_template_jinja"), own, e["path"]) \
        if e.get("chat_template") else None
    if template is None and not getattr(tokenizer, "has_chat_template", False):
        raise ValueError(f"{e['path']}: type chat_template needs a tokenizer with a chat template: it has "
                         f"none; name one (chat_template: chatml, llama3, ...), or set tokenizer_config (or "
                         f"base_model) to a tokenizer directory that has one")
    return dict(e, template=template)


def load_examples(entries: List[dict], tokenizer, sequence_len: int, train_on_inputs: bool = False,
                  sample_packing: bool = False, progress: bool = False) -> Examples:
    """Read and tokenize every entry of `datasets` (checked by check_entries), in order.

    Without packing an example must fit in sequence_len (else a ValueError names it), except a
    pretrain document; with packing (or type pretrain) a longer one is cut into sequence_len pieces,
    each its own example. An example with no trained label (e.g. a chat without an assistant turn)
    is left out, and counted in `notes`."""
    tokens, labels, lengths, sources, untrained, cut = [], [], [], [], 0, 0
    for e in entries:
        if e["type"] == "chat_template":
            e = _chat_entry(e, tokenizer)
        rows = entry_rows(e)
        if progress:
            from tqdm import tqdm
            rows = tqdm(rows, desc=f"tokenizing {os.path.basename(e['path'])}", unit=" rows", leave=False)
        for where, row in rows:
            ids, lab = _example(e, row, tokenizer, train_on_inputs, where)
            if len(ids) > sequence_len and not sample_packing and e["type"] != "pretrain":
                raise ValueError(f"{where}: the example is {len(ids)} tokens, longer than sequence_len "
                                 f"{sequence_len}; raise sequence_len, shorten the row, or set "
                                 f"sample_packing: true (which cuts long examples into pieces)")
            bad = [i for i in ids if not 0 <= i < max(tokenizer.vocab_size, 1)]
            if bad:
                raise ValueError(f"{where}: token id {bad[0]} is outside the tokenizer's vocabulary")
            for a in range(0, len(ids), sequence_len):     # one piece unless the example is cut
                piece, piece_labels = ids[a:a + sequence_len], lab[a:a + sequence_len]
                if all(x == IGNORE_INDEX for x in piece_labels):
                    untrained += 1
                    continue
                tokens.extend(piece)
                labels.extend(piece_labels)
                lengths.append(len(piece))
                sources.append(where)
            cut += len(ids) > sequence_len
    if not lengths:
        raise ValueError(f"datasets {[e['path'] for e in entries]}: no example with a trained label "
                         f"(train_on_inputs: false trains the responses only)")
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(lengths).cumsum(0)])
    notes = []
    if untrained:
        notes.append(f"datasets: {untrained} example(s) or cut pieces without a trained label left out")
    if cut:
        notes.append(f"datasets: {cut} example(s) longer than sequence_len {sequence_len} cut into pieces")
    return Examples(torch.tensor(tokens, dtype=torch.long), torch.tensor(labels, dtype=torch.long), offsets,
                    sources, notes)


def split_validation(examples: Examples, val_set_size: float,
                     seed: int) -> Tuple[Examples, Optional[Examples]]:
    """(train, validation): val_set_size < 1 is a fraction of the examples, >= 1 a count, drawn by
    a permutation seeded by `seed` (the same on every rank and every run); 0 holds nothing out."""
    n = len(examples)
    n_val = int(val_set_size) if val_set_size >= 1 else int(round(n * val_set_size))
    if val_set_size < 0 or n_val >= n:
        raise ValueError(f"val_set_size {val_set_size} holds out {n_val} of {n} examples; use a fraction in "
                         f"[0, 1) or a count below {n}")
    if n_val == 0:
        return examples, None
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    val, train = sorted(perm[:n_val]), sorted(perm[n_val:])
    return examples.subset(train), examples.subset(val)
