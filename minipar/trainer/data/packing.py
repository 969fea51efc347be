"""Rows of sequence_len tokens from whole examples, and the sampler over them.

Without packing each example is one row, padded at the end (pad id, labels -100); causal attention
never lets a real token see the padding after it. With `sample_packing: true` several whole examples
share a row, and three things keep each one as if it were alone (Krell et al., "Efficient Sequence
Packing without Cross-contamination", 2021):

    row           | example a      | example b          | c    | pad  |
    input_ids       a0 a1 a2 a3      b0 b1 b2 b3 b4 b5    c0 c1  p  p
    position_ids    0  1  2  3       0  1  2  3  4  5     0  1   0  1    RoPE restarts per example
    document_ids    0  0  0  0       1  1  1  1  1  1     2  2   3  3    attention stays inside one
    labels          a1 a2 a3 -100    b1 .. b5 -100        c1 -100 -100    the last label of each is -100

The model keeps attention inside each document by the ids' boundaries, taken to the host once per
micro-batch (context_parallel/documents.py): every attention block is skipped, run whole, or cut
into per-document pieces, with no (T, T) mask. The zigzag split (data.local_batch) cuts ids,
labels, positions and document ids alike, so every rank holds the same tokens with their own ids.

The packing plan is first-fit: the examples in an order drawn from the seed, each put in the first
of the last 64 open rows with room for it, else a new row. The plan is made once; every epoch then
visits every row once in the order of torch.randperm seeded by (seed, epoch), as data.BatchSampler
does for windows. So the global batch of a step is a pure function of (seed, step), and a resumed
run reads exactly what the uninterrupted one would have: the data position is the step number.
"""
from __future__ import annotations

import hashlib
from typing import Dict, Iterator, List, Optional

import torch

from minipar.batch_split import IGNORE_INDEX
from minipar.trainer.data.batches import check_same_data_order
from minipar.trainer.data.datasets import Examples, check_entries, load_examples, split_validation

LOOK_BACK = 64       # open rows first-fit searches; bounds the packing time at len(examples) * 64


def pack_plan(lengths: List[int], sequence_len: int, seed: int, packing: bool) -> List[List[int]]:
    """Which examples fill each row: [[i, ...], ...]; without packing one example per row, in order."""
    too_long = [i for i, n in enumerate(lengths) if n > sequence_len]
    if too_long:
        raise ValueError(f"example {too_long[0]} has {lengths[too_long[0]]} tokens "
                         f"> sequence_len {sequence_len}")
    if not packing:
        return [[i] for i in range(len(lengths))]
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed + 104729)).tolist()
    rows: List[List[int]] = []
    free: List[int] = []
    for i in order:
        n = lengths[i]
        first = max(0, len(rows) - LOOK_BACK)
        j = next((j for j in range(first, len(rows)) if free[j] >= n), None)
        if j is None:
            rows.append([])
            free.append(sequence_len)
            j = len(rows) - 1
        rows[j].append(i)
        free[j] -= n
    return rows


def build_rows(examples: Examples, plan: List[List[int]], sequence_len: int,
               pad_token_id: int) -> Dict[str, torch.Tensor]:
    """The rows of a plan: input_ids, labels, position_ids, document_ids, each (len(plan), T) long."""
    n = len(plan)
    ids = torch.full((n, sequence_len), pad_token_id, dtype=torch.long)
    labels = torch.full((n, sequence_len), IGNORE_INDEX, dtype=torch.long)
    pos = torch.zeros(n, sequence_len, dtype=torch.long)
    docs = torch.zeros(n, sequence_len, dtype=torch.long)
    for r, members in enumerate(plan):
        t = 0
        for d, i in enumerate(members):
            tok, lab = examples.example(i)
            ids[r, t:t + len(tok)], labels[r, t:t + len(tok)] = tok, lab
            pos[r, t:t + len(tok)] = torch.arange(len(tok))
            docs[r, t:t + len(tok)] = d
            t += len(tok)
        pos[r, t:] = torch.arange(sequence_len - t)                  # the padding: a document of its own
        docs[r, t:] = len(members)
    return dict(input_ids=ids, labels=labels, position_ids=pos, document_ids=docs)


class PackedData:
    """The rows of one split and their order. `packing` says whether the model needs document ids."""

    def __init__(self, examples: Examples, sequence_len: int, pad_token_id: int, seed: int, packing: bool):
        plan = pack_plan(examples.lengths().tolist(), sequence_len, seed, packing)
        self._set(build_rows(examples, plan, sequence_len, pad_token_id), plan, sequence_len, seed, packing,
                  len(examples))

    @classmethod
    def from_rows(cls, rows: Dict[str, torch.Tensor], plan: List[List[int]], sequence_len: int, seed: int,
                  packing: bool, num_examples: int) -> "PackedData":
        """The rows of a plan built earlier (prepared.py loads them from dataset_prepared_path)."""
        self = cls.__new__(cls)
        self._set(rows, plan, sequence_len, seed, packing, num_examples)
        return self

    def _set(self, rows, plan, sequence_len, seed, packing, num_examples) -> None:
        self.sequence_len, self.seed, self.packing = int(sequence_len), int(seed), bool(packing)
        self.plan, self.rows = plan, rows
        self.num_rows = len(self.plan)
        self.num_examples = int(num_examples)
        h = hashlib.sha1()
        for key in ("input_ids", "labels", "document_ids"):
            h.update(self.rows[key].numpy().tobytes())
        self.fingerprint = h.hexdigest()[:16]

    def take(self, index: torch.Tensor) -> Dict[str, torch.Tensor]:
        keys = (("input_ids", "labels", "position_ids", "document_ids") if self.packing
                else ("input_ids", "labels"))
        return {k: self.rows[k][index] for k in keys}

    def fill(self) -> float:
        """The fraction of row tokens that hold an example (1 - padding)."""
        return float((self.rows["document_ids"] < torch.tensor([len(p) for p in self.plan])[:, None])
                     .float().mean())


class RowSampler:
    """The global batch of every optimizer step as a pure function of (seed, step), over rows.

        sampler = RowSampler(train_rows, global_batch_size=32, seed=0)
        batch = sampler.global_batch(step)    # dict of (32, T) tensors
    """

    def __init__(self, data: PackedData, global_batch_size: int, seed: int = 0):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.data, self.global_batch_size, self.seed = data, int(global_batch_size), int(seed)
        self._perm_cache: Dict[int, torch.Tensor] = {}   # a memo, not state

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 2:
                self._perm_cache.clear()
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2 ** 63))
            self._perm_cache[epoch] = torch.randperm(self.data.num_rows, generator=gen)
        return self._perm_cache[epoch]

    def batch(self, step: int) -> torch.Tensor:
        """Row indices (global_batch_size,) of optimizer step `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = self.data.num_rows
        sample = torch.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        epochs, pos = sample // n, sample % n
        rows = torch.empty_like(sample)
        for e in epochs.unique().tolist():      # a batch may straddle an epoch boundary
            mask = epochs == e
            rows[mask] = self.epoch_order(e)[pos[mask]]
        return rows

    def global_batch(self, step: int) -> Dict[str, torch.Tensor]:
        return self.data.take(self.batch(step))

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch_size / self.data.num_rows

    def state_dict(self) -> dict:
        return dict(num_rows=self.data.num_rows, sequence_len=self.data.sequence_len,
                    global_batch_size=self.global_batch_size, seed=self.seed,
                    packing=self.data.packing, fingerprint=self.data.fingerprint)

    def load_state_dict(self, state: dict) -> None:
        """Check that a resumed run reads the same rows in the same order."""
        check_same_data_order(state, self.state_dict(),
                              "datasets, tokenizer, sequence_len, sample_packing, global_batch_size and seed")


def eval_batches(data: Optional[PackedData], batch_size: int,
                 max_batches: Optional[int] = None) -> Iterator[Dict[str, torch.Tensor]]:
    """Validation batches: the rows in plan order, the last batch filled with rows that train
    nothing (pad ids, labels -100), at most `max_batches` of them."""
    if data is None:
        return
    n = -(-data.num_rows // batch_size)
    for i in range(n if max_batches is None else min(n, max_batches)):
        index = torch.arange(i * batch_size, (i + 1) * batch_size)
        real = index < data.num_rows
        batch = data.take(index.clamp(max=data.num_rows - 1))
        batch["labels"][~real] = IGNORE_INDEX
        yield batch


class DatasetRun:
    """What run_setup hands the trainer for a `datasets` run: the tokenizer and the two splits."""

    def __init__(self, tokenizer, train: PackedData, val: Optional[PackedData], notes: List[str]):
        self.tokenizer, self.train, self.val, self.notes = tokenizer, train, val, notes


def prepare(cfg, tokenizer, progress: bool = False) -> DatasetRun:
    """cfg.datasets -> tokenized examples -> train / validation split -> rows. No communication."""
    examples = load_examples(check_entries(cfg.datasets), tokenizer, cfg.sequence_len, cfg.train_on_inputs,
                             cfg.sample_packing, progress)
    train_ex, val_ex = split_validation(examples, cfg.val_set_size, cfg.seed)
    make = (lambda ex: PackedData(ex, cfg.sequence_len, tokenizer.pad_token_id, cfg.seed, cfg.sample_packing))
    train = make(train_ex)
    val = make(val_ex) if val_ex is not None else None
    notes = list(examples.notes)
    notes.append(f"datasets: {len(examples)} examples ({train.num_examples} train"
                 + (f", {val.num_examples} validation" if val else "") + f") in {train.num_rows} rows of "
                 f"{cfg.sequence_len} tokens, {100 * train.fill():.0f}% filled"
                 + (", packed" if cfg.sample_packing else ""))
    return DatasetRun(tokenizer, train, val, notes)
