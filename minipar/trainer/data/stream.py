"""Streamed pretraining data (Axolotl's `pretraining_dataset`): documents read from the files,
tokenized and packed as the steps need them, so a corpus of any size starts training at once.

    pretraining_dataset: [{path: web.jsonl, text_column: text}]   `datasets` of type pretrain, with
                                             streaming: true (config/axolotl_keys.py)
    streaming_multipack_buffer_size: 10000   documents per buffer (Axolotl's default; its older name
                                             pretrain_multipack_buffer_size is read too)
    pretrain_multipack_attn: true            a packed document attends only to itself (Axolotl's default)
    val_set_size: N                          the first N documents of the stream held out for eval
    max_steps: S                             required: the stream's length is not known up front

The stream is the entries' rows in file order (sources.entry_rows reads them lazily: JSON lines and
.txt paragraphs line by line, parquet / arrow / csv / JSON arrays through HF `datasets` with
streaming=True, a save_to_disk folder memory-mapped), after the held-out head, again and again (one
pass is an epoch). It is cut into buffers of buffer_size documents, and each buffer becomes rows
exactly as packing.py turns a whole `datasets` run into rows, over its own documents only:

    document   [bos] text [eos], labels shifted (formats.completion_row), cut into sequence_len pieces,
               a piece that trains nothing left out (as datasets.load_examples cuts type pretrain)
    buffer k   packing.pack_plan(lengths, T, seed + k * 1000033, sample_packing): first-fit over a
               seeded order with packing, one piece per row without; build_rows -> (n_k, T) each of
               input_ids, labels, position_ids, document_ids
    epoch e    buffer k's rows in the order randperm(n_k) seeded by seed * 1000003 + e + k * 1000000007

For k = 0 that is the plan and the epoch order of packing.RowSampler: a corpus that fits in one
buffer gives the very rows, in the very order, of the same entries prepared once (non-streamed
`type: pretrain`), and so the same loss curve (tests/test_stream.py). It is Axolotl's streaming
multipack (its encode_packed_streaming: each map batch of streaming_multipack_buffer_size rows
tokenized, shuffled and bin-packed, documents kept apart by pretrain_multipack_attn) with minipar's
seeded orders. With pretrain_multipack_attn: false the rows are packed the same way but carry no document
ids: attention runs causally across the documents of a row, as Axolotl's does then.

Every rank reads and packs the whole stream (no communication; the global batch of a step is the
same everywhere) and batch_split.local_batch gives each its share, as for prepared rows. The cost:
each rank tokenizes every buffer, when the steps reach it (on a GPU while the device still works
through the step before: the trainer prefetches a step), and holds one buffer's rows (int32).
stream_sampler.py cuts the rows into global batches and saves the position in checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from minipar.batch_split import IGNORE_INDEX
from minipar.trainer.data.datasets import Examples, check_entries
from minipar.trainer.data.formats import completion_row
from minipar.trainer.data.packing import PackedData, build_rows, pack_plan
from minipar.trainer.data.prepared import tokenizer_inputs
from minipar.trainer.data.sources import entry_rows, source_files

PLAN_STRIDE, ORDER_STRIDE = 1_000_033, 1_000_000_007     # buffer k's seeds: k = 0 is RowSampler's


def stream_problems(cfg) -> List[str]:
    """What a streamed run cannot do, each with the fix (config/check.py raises them with the rest)."""
    if not cfg.streaming:
        return []
    out = []
    if not cfg.datasets:
        out.append("streaming: true streams `datasets` of type pretrain (or pretraining_dataset), and "
                   "there are none; set pretraining_dataset, or remove streaming")
    kinds = [e.get("type") or "completion" for e in cfg.datasets if isinstance(e, dict)]
    if any(k != "pretrain" for k in kinds):
        out.append(f"streaming: true streams plain text (type pretrain) only, got types {kinds}; the "
                   f"other formats are prepared once: remove streaming")
    if cfg.rl:
        out.append(f"streaming: true with rl: {cfg.rl}: preference pairs are prepared once; remove "
                   f"streaming")
    if 0 < cfg.val_set_size < 1:
        out.append(f"val_set_size {cfg.val_set_size:g} is a fraction, but a streamed dataset's length is "
                   f"not known before training: give a count of documents (val_set_size: 100 holds out "
                   f"the first 100 documents of the stream for evaluation), or 0")
    return out


@dataclass
class Buffer:
    """The packed rows of one buffer, in their epoch order: rows[k] is (n, T) int32 (input_ids,
    labels, and position_ids, document_ids when the documents are kept apart); tokens[r] the real
    (not padding) tokens of row r; the documents read spanned positions start .. end."""
    epoch: int
    index: int
    start: Tuple[int, int]
    end: Tuple[int, int]
    rows: Dict[str, torch.Tensor]
    tokens: torch.Tensor
    documents: int

    @property
    def n(self) -> int:
        return len(self.tokens)


class TokenStream:
    """The documents of `entries` from any (entry, row) position on, tokenized and packed a buffer at a
    time. `start` is where training begins, after the held-out head; docs_read counts the documents
    this process has read from the files (a buffer read again on resume counts again)."""

    def __init__(self, entries: List[dict], tokenizer, sequence_len: int, seed: int, packing: bool,
                 attn_apart: bool, buffer_size: int, start: Tuple[int, int] = (0, 0)):
        self.entries, self.tokenizer, self.T = entries, tokenizer, int(sequence_len)
        self.seed, self.packing, self.buffer_size = int(seed), bool(packing), int(buffer_size)
        self.start = start
        self.keys = (("input_ids", "labels", "position_ids", "document_ids") if packing and attn_apart
                     else ("input_ids", "labels"))
        self.docs_read = 0
        self._cursor, self._docs = None, None       # the open reader and the position it has reached
        self._fingerprint: Optional[str] = None

    # ------------------------------------------------------------------ documents
    def _read(self, entry: int, row: int) -> Iterator[Tuple[int, int, List[int], List[int]]]:
        """(entry, row, ids, labels) of every document from (entry, row) on. The rows before `row`
        are read and skipped, not tokenized (a resume's only extra cost)."""
        vocab = max(self.tokenizer.vocab_size, 1)
        for i in range(entry, len(self.entries)):
            e = self.entries[i]
            first = row if i == entry else 0
            for r, (where, data) in enumerate(entry_rows(e)):
                if r < first:
                    continue
                ids, labels = completion_row(data, e["field"], self.tokenizer, where)
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"{where}: token id {bad[0]} is outside the tokenizer's vocabulary")
                self.docs_read += 1
                yield i, r, ids, labels

    def documents(self, entry: int, row: int, count: int) -> Iterator[Tuple[int, int, List[int], List[int]]]:
        """At most `count` documents from (entry, row): the open reader goes on where it stopped when
        that is the position asked for, else a new one opens there."""
        if self._cursor != (entry, row):
            self._docs = self._read(entry, row)
        for _ in range(count):
            doc = next(self._docs, None)
            if doc is None:
                self._cursor = None
                return
            self._cursor = (doc[0], doc[1] + 1)
            yield doc

    def pieces(self, entry: int, row: int, count: int) -> Tuple[Examples, Tuple[int, int], int]:
        """The sequence_len pieces of up to `count` documents from (entry, row), as Examples; the
        position after the last document read; how many were read."""
        tokens: List[int] = []
        labels: List[int] = []
        lengths: List[int] = []
        end, n = (entry, row), 0
        for i, r, ids, lab in self.documents(entry, row, count):
            end, n = (i, r + 1), n + 1
            for a in range(0, len(ids), self.T):       # one piece unless the document is longer
                piece, piece_labels = ids[a:a + self.T], lab[a:a + self.T]
                if any(x != IGNORE_INDEX for x in piece_labels):
                    tokens += piece
                    labels += piece_labels
                    lengths.append(len(piece))
        offsets = torch.tensor([0] + lengths, dtype=torch.long).cumsum(0)
        return Examples(torch.tensor(tokens, dtype=torch.long), torch.tensor(labels, dtype=torch.long),
                        offsets), end, n

    # ------------------------------------------------------------------ buffers
    def buffer(self, epoch: int, index: int, start: Tuple[int, int]) -> Optional[Buffer]:
        """Buffer `index` of `epoch`, its documents read from `start`; None when no document is left."""
        examples, end, n = self.pieces(*start, self.buffer_size)
        if n == 0:
            return None
        lengths = examples.lengths().tolist()
        plan = pack_plan(lengths, self.T, self.seed + index * PLAN_STRIDE, self.packing)
        rows = build_rows(examples, plan, self.T, self.tokenizer.pad_token_id)
        tokens = torch.tensor([sum(lengths[i] for i in p) for p in plan], dtype=torch.long)
        seed = (self.seed * 1_000_003 + epoch + index * ORDER_STRIDE) % (2 ** 63)   # RowSampler's at k = 0
        order = torch.randperm(len(plan), generator=torch.Generator().manual_seed(seed))
        return Buffer(epoch, index, start, end, {k: rows[k][order].to(torch.int32) for k in self.keys},
                      tokens[order], n)

    def fingerprint(self) -> str:
        """What fixes the stream's rows besides the settings: each entry's settings and its files'
        sizes (not their bytes: hashing a large corpus at each start would cost what streaming
        saves), and the tokenizer's files. Computed once, at the first checkpoint or resume."""
        if self._fingerprint is not None:
            return self._fingerprint
        entries = [dict({k: v for k, v in e.items() if k not in ("path", "data_files")},
                        sizes=[os.path.getsize(f) for f in source_files(e)]) for e in self.entries]
        text = json.dumps(dict(entries=entries, tokenizer=tokenizer_inputs(self.tokenizer)), sort_keys=True)
        self._fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._fingerprint


class StreamRun:
    """What run_setup hands the trainer for a streamed run (packing.DatasetRun's face): the
    tokenizer, train (the TokenStream), val (the held-out head's rows, or None), notes."""

    def __init__(self, tokenizer, train: TokenStream, val: Optional[PackedData], notes: List[str]):
        self.tokenizer, self.train, self.val, self.notes = tokenizer, train, val, notes


def open_stream(cfg, tokenizer) -> StreamRun:
    """The stream of cfg.datasets: only the held-out head (val_set_size documents) is read now."""
    entries = check_entries(cfg.datasets)
    packing, apart = bool(cfg.sample_packing), bool(cfg.pretrain_multipack_attn)
    stream = TokenStream(entries, tokenizer, cfg.sequence_len, cfg.seed, packing, apart,
                         cfg.streaming_multipack_buffer_size)
    val, notes = None, []
    head = int(cfg.val_set_size)
    if head:
        examples, stream.start, n = stream.pieces(0, 0, head)
        if n < head or len(examples) == 0:
            raise ValueError(f"val_set_size {head} holds out the first {head} documents of the stream, but "
                             f"{[e['path'] for e in entries]} hold only {n} (with {len(examples)} trained "
                             f"pieces); lower val_set_size")
        plan = pack_plan(examples.lengths().tolist(), cfg.sequence_len, cfg.seed, packing)
        val = PackedData.from_rows(build_rows(examples, plan, cfg.sequence_len, tokenizer.pad_token_id), plan,
                                   cfg.sequence_len, cfg.seed, packing and apart, len(examples))
        notes.append(f"validation: the first {head} documents of the stream ({val.num_rows} rows)")
    how = ("packed, each document attending to itself" if packing and apart else
           "packed, attention across the documents of a row (pretrain_multipack_attn: false)" if packing else
           "one piece per row")
    notes.append(f"datasets stream ({', '.join(e['path'] for e in entries)}): read, tokenized and packed "
                 f"in buffers of {stream.buffer_size} documents as the steps need them ({how}); "
                 f"max_steps {cfg.max_steps} decides the length")
    if cfg.dataset_prepared_path:
        notes.append(f"dataset_prepared_path {cfg.dataset_prepared_path!r} is not used: a stream is "
                     f"never prepared ahead")
    return StreamRun(tokenizer, stream, val, notes)
