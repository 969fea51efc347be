"""Preference datasets for DPO, as Axolotl and TRL write them: rows -> pairs of token rows.

    {"messages": [{"role": "user", "content": "..."}],           Axolotl's chat_template form
     "chosen": {"role": "assistant", "content": "..."},          (field_messages, field_chosen,
     "rejected": {"role": "assistant", "content": "..."}}         field_rejected name the keys)
    {"prompt": "...", "chosen": "...", "rejected": "..."}         the plain form (TRL's standard)

Each side becomes one row as datasets.py makes a chat row: token ids and labels shifted by one,
-100 everywhere but the RESPONSE (the last assistant turn's content and its end of turn; in the
plain form, the response text and eos), so log p(y | x) sums over the response tokens only.
chosen and rejected share the prompt's tokens; both rows are padded to sequence_len (labels -100).

Bad rows, one line each before any step: a row without its chosen or rejected (ValueError, file
and line); a prompt that leaves no room for a response in sequence_len (ValueError, its length);
chosen equal to rejected (dropped, counted in one warning: such a pair has no gradient); a
response cut to fit sequence_len (counted in one note, as TRL's max_length truncates).
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from minipar.batch_split import IGNORE_INDEX
from minipar.trainer.data.chat_format import _check_messages, chat_spans
from minipar.trainer.data.formats import shift_labels
from minipar.trainer.data.sources import read_rows


def _side(row: dict, key: str, where: str):
    if key not in row or row[key] in (None, "", {}):
        raise ValueError(f"{where}: a preference row needs `{key}` (the keys are {sorted(row)}); set "
                         f"field_chosen / field_rejected if your file names them otherwise")
    return row[key]


def chat_side(messages: list, response, tokenizer, where: str) -> Tuple[List[int], List[int], int]:
    """(ids, labels, prompt tokens) of the conversation `messages` + the assistant `response`,
    trained on the response's span only."""
    reply = response if isinstance(response, dict) else dict(role="assistant", content=response)
    conv = list(messages) + [reply]
    _check_messages(conv, where)
    text, spans = chat_spans(conv, tokenizer, where)
    a, b = spans[-1]                                      # the response's turn, nothing before it
    ids, offsets = tokenizer.encode_with_offsets(text)
    trained = [a <= s < b for s, _ in offsets]
    first = trained.index(True) if any(trained) else len(ids)
    return ids, shift_labels(ids, trained), first


def plain_side(prompt: str, response: str, tokenizer, where: str) -> Tuple[List[int], List[int], int]:
    """bos prompt response eos, trained on the response and eos."""
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise ValueError(f"{where}: prompt, chosen and rejected must be strings in the plain form")
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    head = ([bos] if bos is not None else []) + tokenizer.encode(prompt)
    tail = tokenizer.encode(response) + ([eos] if eos is not None else [])
    ids = head + tail
    return ids, shift_labels(ids, [False] * len(head) + [True] * len(tail)), len(head)


def load_pairs(path: str, tokenizer, sequence_len: int, pad_token_id: int = 0,
               field_messages: str = "messages", field_chosen: str = "chosen",
               field_rejected: str = "rejected"):
    """(chosen ids, chosen labels, rejected ids, rejected labels), each (P, sequence_len), and notes."""
    rows, same, cut = [], 0, 0
    for n, row in read_rows(path):
        where = f"{path}:{n}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: a preference row is a JSON object, got {type(row).__name__}")
        chosen, rejected = _side(row, field_chosen, where), _side(row, field_rejected, where)
        if chosen == rejected:
            same += 1
            continue
        if field_messages in row:
            sides = [chat_side(row[field_messages], r, tokenizer, where) for r in (chosen, rejected)]
        else:
            prompt = _side(row, "prompt", where)
            sides = [plain_side(prompt, r, tokenizer, where) for r in (chosen, rejected)]
        prompt_len = sides[0][2]
        if prompt_len >= sequence_len:
            raise ValueError(f"{where}: the prompt is {prompt_len} tokens, sequence_len {sequence_len} "
                             f"leaves no room for a response; raise sequence_len or shorten the prompt")
        pair = []
        for ids, labels, _ in sides:
            if len(ids) > sequence_len:
                cut += 1
                ids, labels = ids[:sequence_len], labels[:sequence_len - 1] + [IGNORE_INDEX]
            pad = sequence_len - len(ids)
            pair.append((ids + [pad_token_id] * pad, labels + [IGNORE_INDEX] * pad))
        rows.append(pair)
    if not rows:
        raise ValueError(f"{path}: no preference pair left (rows with chosen == rejected: {same})")
    notes = []
    if same:
        notes.append(f"warning: {path}: {same} row(s) with chosen == rejected dropped (such a pair has "
                     f"no gradient)")
    if cut:
        notes.append(f"{path}: {cut} response(s) cut to sequence_len {sequence_len}")
    t = torch.tensor(rows, dtype=torch.long)              # (P, 2 sides, 2 [ids, labels], T)
    return t[:, 0, 0], t[:, 0, 1], t[:, 1, 0], t[:, 1, 1], notes
