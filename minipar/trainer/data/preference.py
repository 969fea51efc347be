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

The trainer's side (rl: dpo): prepare_pairs reads every `datasets` entry (check_pair_entries: the
keys Axolotl's DPO entries carry) and holds out val_set_size pairs; each split is a PairData,
(P, 2 sides, T) ids and labels and, once the trainer has computed them, the reference's (P, 2)
log-probs (2 floats per pair, on the host, on every rank). packing.RowSampler draws PAIRS from it
(global_batch_size counts pairs, as TRL's batch sizes do), and take() lays a draw out as the rows
c_0, r_0, c_1, r_1, ... that minipar/dpo_step.py splits.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional, Tuple

import torch

from minipar.batch_split import IGNORE_INDEX
from minipar.trainer.data.chat_format import _check_messages, chat_spans
from minipar.trainer.data.formats import shift_labels
from minipar.trainer.data.sources import read_rows

# a `datasets` entry of preference rows: Axolotl's DPO keys (type chat_template[.default] reads
# field_messages; a row without it is read in the plain prompt / chosen / rejected form)
PAIR_ENTRY_KEYS = {"path", "type", "field_messages", "field_chosen", "field_rejected"}
PAIR_TYPES = (None, "chat_template", "chat_template.default")


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


def check_pair_entries(entries, where: str = "datasets") -> List[dict]:
    """Structural checks of the `datasets` list of an rl run (no file is read)."""
    if not isinstance(entries, list):
        raise ValueError(f"{where} must be a list of {{path, type}} mappings, got {entries!r}")
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or "path" not in e:
            raise ValueError(f"{where}[{i}] must be a mapping with at least `path`, got {e!r}")
        unknown = set(e) - PAIR_ENTRY_KEYS
        if unknown:
            raise ValueError(f"{where}[{i}] ({e['path']}): unknown keys {sorted(unknown)} for preference "
                             f"rows (rl: dpo); known: {sorted(PAIR_ENTRY_KEYS)}")
        if e.get("type") not in PAIR_TYPES:
            raise ValueError(f"{where}[{i}] ({e['path']}): type {e.get('type')!r} is not a preference "
                             f"format; use chat_template (field_messages, field_chosen, field_rejected) "
                             f"or leave `type` out for prompt / chosen / rejected rows")
        out.append(dict(path=str(e["path"]), field_messages=e.get("field_messages", "messages"),
                        field_chosen=e.get("field_chosen", "chosen"),
                        field_rejected=e.get("field_rejected", "rejected")))
    return out


class PairData:
    """The pairs of one split: ids and labels (P, 2, T), side 0 chosen, side 1 rejected; ref_logps
    (P, 2) once set (the trainer's precomputed reference). RowSampler draws pair indices from it."""

    packing = False

    def __init__(self, ids: torch.Tensor, labels: torch.Tensor, sequence_len: int):
        self.ids, self.labels, self.sequence_len = ids, labels, int(sequence_len)
        self.num_rows = self.num_examples = ids.shape[0]          # pairs (RowSampler's "rows")
        self.ref_logps: Optional[torch.Tensor] = None
        h = hashlib.sha1()
        for t in (ids, labels):
            h.update(t.numpy().tobytes())
        self.fingerprint = h.hexdigest()[:16]

    def take(self, index: torch.Tensor) -> Dict[str, torch.Tensor]:
        """(2k, T) rows c, r of each pair in `index` (k,), and their (2k,) reference log-probs if set."""
        out = dict(input_ids=self.ids[index].flatten(0, 1), labels=self.labels[index].flatten(0, 1))
        if self.ref_logps is not None:
            out["ref_logps"] = self.ref_logps[index].flatten()
        return out

    def batches(self, pairs: int, max_batches: Optional[int] = None):
        """Whole batches of `pairs` pairs in file order (evaluation: the last partial one left out,
        so every rank's share holds whole pairs)."""
        n = self.num_rows // pairs
        for i in range(n if max_batches is None else min(n, max_batches)):
            yield self.take(torch.arange(i * pairs, (i + 1) * pairs))


class PairRun:
    """What run_setup hands the trainer for an rl run (packing.DatasetRun's face): the two splits."""

    def __init__(self, tokenizer, train: PairData, val: Optional[PairData], notes: List[str]):
        self.tokenizer, self.train, self.val, self.notes = tokenizer, train, val, notes


def prepare_pairs(cfg, tokenizer) -> PairRun:
    """cfg.datasets -> pairs -> train / held-out split (val_set_size pairs, drawn by the seed as
    datasets.split_validation draws examples). No communication."""
    parts, notes = [], []
    for e in check_pair_entries(cfg.datasets):
        *four, more = load_pairs(e["path"], tokenizer, cfg.sequence_len, tokenizer.pad_token_id or 0,
                                 e["field_messages"], e["field_chosen"], e["field_rejected"])
        parts.append(four)
        notes.extend(more)
    cid, clab, rid, rlab = (torch.cat(x) for x in zip(*parts))
    ids, labels = torch.stack([cid, rid], 1), torch.stack([clab, rlab], 1)
    n = ids.shape[0]
    n_val = int(cfg.val_set_size) if cfg.val_set_size >= 1 else int(round(n * cfg.val_set_size))
    if n_val >= n:
        raise ValueError(f"val_set_size {cfg.val_set_size} holds out {n_val} of {n} pairs; use a fraction in "
                         f"[0, 1) or a count below {n}")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + 7919)).tolist()
    val_i, train_i = sorted(perm[:n_val]), sorted(perm[n_val:])
    train = PairData(ids[train_i], labels[train_i], cfg.sequence_len)
    val = PairData(ids[val_i], labels[val_i], cfg.sequence_len) if n_val else None
    G = cfg.global_batch_size
    if val is not None and G and val.num_rows < G:
        raise ValueError(f"val_set_size {cfg.val_set_size} holds out {val.num_rows} pairs, fewer than one "
                         f"evaluation batch (global_batch_size {G} pairs); hold out at least {G} or set "
                         f"val_set_size: 0")
    notes.append(f"datasets: {n} preference pairs ({train.num_rows} train"
                 + (f", {val.num_rows} held out" if val else "") + f"), each side one row of "
                 f"{cfg.sequence_len} tokens")
    return PairRun(tokenizer, train, val, notes)
