"""Datasets as Axolotl writes them: local files -> token ids and labels, with label masking.

    datasets:
      - path: data/chat.jsonl          one JSON object per line
        type: chat_template            {"messages": [{"role": "user", "content": "..."}, ...]}
      - path: data/notes.jsonl
        type: completion               {"text": "..."}  (`field` names another key)
      - path: data/book.txt
        type: completion               plain text: one example per paragraph (blank-line separated)
    train_on_inputs: false             Axolotl's default: train on assistant turns only
    val_set_size: 0.05                 a fraction of the examples (or, >= 1, a count) held out
    sample_packing: true               packing.py: whole examples packed into sequence_len

One example becomes token ids x_0 .. x_{n-1} and labels shifted by one, as the model expects
(label[t] is the target at t, the token x_{t+1}), with -100 where nothing is trained:

    completion       x = [bos] text [eos]                 labels = x[1:] + [-100]
    chat_template    x = the chat template's rendering    labels = x[t+1] where x[t+1] lies in an
                                                          assistant turn's content or its end-of-turn
                                                          text, else -100 (train_on_inputs: false)

The last label of an example is always -100: its next token belongs to no one, so a packed row
never trains one example to predict the next. The loss divides by num_items_in_batch, the count of
labels that are not -100 in the global batch, so masked tokens change neither sum nor count.

Finding the assistant turns. The conversation is rendered one message longer at a time; the text
each message adds (the template must only append, as chat templates do) is that turn. Inside an
assistant turn, training starts where its content starts and ends after the turn's eos token (or
at the turn's end, if the template closes turns with another marker): the role header is masked,
the content and its eos are trained, as Axolotl's roles_to_train: [assistant] with train_on_eos:
turn. A token is trained when its first character (the fast tokenizer's offsets) lies in a span.

Bad rows raise a ValueError naming the file and line: invalid JSON, a missing field, empty or
malformed messages, an unknown role, no chat template, and (without packing) an example longer than
sequence_len. Everything is read and tokenized on every rank, deterministically, before any
collective; nothing is shuffled here (packing.py orders the examples from the seed).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

import torch

from minipar.batch_split import IGNORE_INDEX
from minipar.trainer.data.batches import check_data_file

TYPES = ("completion", "chat_template")
ROLES = ("system", "user", "assistant")
ENTRY_KEYS = {"path", "type", "field", "field_messages"}


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
def check_entries(entries, where: str = "datasets") -> List[dict]:
    """Structural checks of the `datasets` list (no file is read): each a mapping with a known type."""
    if not isinstance(entries, list):
        raise ValueError(f"{where} must be a list of {{path, type}} mappings, got {entries!r}")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "path" not in e:
            raise ValueError(f"{where}[{i}] must be a mapping with at least `path` and `type`, got {e!r}")
        unknown = set(e) - ENTRY_KEYS
        if unknown:
            raise ValueError(f"{where}[{i}] ({e['path']}): unknown keys {sorted(unknown)}; known: "
                             f"{sorted(ENTRY_KEYS)}")
        kind = e.get("type", "completion")
        if kind not in TYPES:
            raise ValueError(f"{where}[{i}] ({e['path']}): type {kind!r} is not supported; "
                             f"use one of {TYPES}")
        if kind == "chat_template" and str(e["path"]).endswith(".txt"):
            raise ValueError(f"{where}[{i}]: type chat_template reads JSONL rows with `messages`, "
                             f"not the plain "
                             f"text file {e['path']}")
        out.append(dict(path=str(e["path"]), type=kind, field=e.get("field", "text"),
                        field_messages=e.get("field_messages", "messages")))
    return out


def read_rows(path: str) -> Iterator[Tuple[int, object]]:
    """(line number, row): JSON rows of a .jsonl/.json file, or text paragraphs of a .txt file."""
    check_data_file(path)
    with open(path, encoding="utf-8") as f:
        if path.endswith(".txt"):
            para, start = [], 0
            for n, line in enumerate(f, 1):
                if line.strip():
                    start = start or n
                    para.append(line.rstrip("\n"))
                elif para:
                    yield start, "\n".join(para)
                    para, start = [], 0
            if para:
                yield start, "\n".join(para)
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not valid JSON ({err.msg}); a JSONL file holds one object "
                                 f"per line") from None


# ------------------------------------------------------------------------------ one example
def shift_labels(ids: List[int], trained: List[bool]) -> List[int]:
    """labels[t] = ids[t+1] where that token is trained, else -100; the last label is -100."""
    return [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def completion_example(text, tokenizer, where: str) -> Tuple[List[int], List[int]]:
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: the text must be a non-empty string, got {text!r}")
    ids = tokenizer.encode(text)
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return ids, shift_labels(ids, [True] * len(ids))


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: `messages` must be a non-empty list of {{role, content}}, "
                         f"got {messages!r}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: message {j} must be a mapping with `role` and `content`, got {m!r}")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {j} has unknown role {m['role']!r}; known roles: {ROLES}")
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}: message {j} content must be a string, got {m['content']!r}")


def chat_spans(messages, tokenizer, where: str) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns that are trained."""
    prev, spans = "", []
    for j, m in enumerate(messages):
        cur = tokenizer.render_chat(messages[: j + 1])
        if not cur.startswith(prev):
            raise ValueError(f"{where}: the chat template rewrites earlier turns when a message is added, so "
                             f"the assistant turns cannot be located; use a template that only appends")
        if m["role"] == "assistant":
            pos = cur.find(m["content"], len(prev)) if m["content"] else len(cur)
            if pos < 0:
                raise ValueError(f"{where}: the chat template does not render message {j}'s content verbatim")
            end, eos = len(cur), getattr(tokenizer, "eos_token", None)
            k = cur.find(eos, pos + len(m["content"])) if eos else -1
            spans.append((pos, k + len(eos) if k >= 0 else end))     # up to the turn's eos, if it has one
        prev = cur
    return prev, spans


def chat_example(messages, tokenizer, train_on_inputs: bool, where: str) -> Tuple[List[int], List[int]]:
    _check_messages(messages, where)
    text, spans = chat_spans(messages, tokenizer, where)
    ids, offsets = tokenizer.encode_with_offsets(text)
    if train_on_inputs:
        trained = [True] * len(ids)
    else:
        trained = [any(a <= s < b for a, b in spans) for s, _ in offsets]
    return ids, shift_labels(ids, trained)


# ------------------------------------------------------------------------------ all the files
def load_examples(entries: List[dict], tokenizer, sequence_len: int, train_on_inputs: bool = False,
                  sample_packing: bool = False, progress: bool = False) -> Examples:
    """Read and tokenize every entry of `datasets` (checked by check_entries), in file order.

    Without packing an example must fit in sequence_len (else a ValueError names it); with packing a
    longer one is cut into sequence_len pieces, each packed as its own example. An example with no
    trained label (e.g. a chat without an assistant turn) is left out, and counted in `notes`."""
    tokens, labels, lengths, sources, untrained, cut = [], [], [], [], 0, 0
    for e in entries:
        if e["type"] == "chat_template" and not tokenizer.has_chat_template:
            raise ValueError(f"{e['path']}: type chat_template needs a tokenizer with a chat template; set "
                             f"tokenizer_config (or base_model) to a tokenizer directory that has one")
        rows = read_rows(e["path"])
        if progress:
            from tqdm import tqdm
            rows = tqdm(rows, desc=f"tokenizing {os.path.basename(e['path'])}", unit=" rows", leave=False)
        for line, row in rows:
            where = f"{e['path']}:{line}"
            if e["type"] == "completion":
                if isinstance(row, str):
                    text = row
                elif isinstance(row, dict) and e["field"] in row:
                    text = row[e["field"]]
                else:
                    raise ValueError(f"{where}: the row has no field {e['field']!r} (keys: "
                                     f"{sorted(row) if isinstance(row, dict) else type(row).__name__}); set "
                                     f"`field` in this dataset entry")
                ids, lab = completion_example(text, tokenizer, where)
            else:
                if not isinstance(row, dict) or e["field_messages"] not in row:
                    raise ValueError(f"{where}: the row has no field {e['field_messages']!r}; "
                                     f"a chat_template "
                                     f"row is {{\"messages\": [{{\"role\": ..., \"content\": ...}}]}}")
                ids, lab = chat_example(row[e["field_messages"]], tokenizer, train_on_inputs, where)
            if len(ids) > sequence_len and not sample_packing:
                raise ValueError(f"{where}: the example is {len(ids)} tokens, longer than sequence_len "
                                 f"{sequence_len}; raise sequence_len, shorten the row, or set "
                                 f"sample_packing: true (which cuts long examples into pieces)")
            bad = [i for i in ids if not 0 <= i < max(tokenizer.vocab_size, 1)]
            if bad:
                raise ValueError(f"{where}: token id {bad[0]} is outside the tokenizer's vocabulary")
            for a in range(0, len(ids), sequence_len):     # one piece unless packing cut a long example
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
                         f"(train_on_inputs: false trains assistant turns only)")
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
