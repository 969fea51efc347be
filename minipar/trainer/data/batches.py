"""Data: bytes as tokens, a sampler that is a pure function of the step, and the split of one
global batch over data-parallel ranks (samples) and context-parallel ranks (the sequence).

Tokenizer. A byte-level vocabulary of 256: a token is one byte of the UTF-8 text. Nothing to
download, nothing to train, every file can be read, and decoding a cut in the middle of a
multi-byte character just shows a replacement mark.

Sampler. The training tokens are cut into windows of T + 1 tokens that overlap by one token
(window k starts at k*T), so that inputs and shifted labels come from the same window:

    tokens  ... | t0 t1 t2 ... t(T-1) tT | ...        window k = tokens[k*T : k*T + T + 1]
    input_ids     t0 t1 t2 ... t(T-1)                  = window[:-1]
    labels        t1 t2 t3 ... tT                      = window[1:]   (label[t] = token at t+1)

Every epoch visits each window once, in the order of `torch.randperm(num_windows)` drawn from a
generator seeded with (seed, epoch). Sample i of the run (i = step * B + b) is window
perm_{i // W}[i % W]. So the global batch of a step is a pure function of (seed, step): a run can
start at any step, a resumed run reads exactly what the uninterrupted one would have, and the
data position in a checkpoint is just the step number. There is no iterator state to save.

The split of one step's global batch over dp, micro-batches and cp is minipar/batch_split.py's.

References: the byte-level vocabulary of ByT5 (Xue et al., 2021); the zigzag layout of Megatron-LM's
context parallelism and of ring-flash-attention (a cousin of Striped Attention, Brandon et al., 2023).
"""
from __future__ import annotations

import os
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch


# ------------------------------------------------------------------------------------ tokenizer
class ByteTokenizer:
    """UTF-8 bytes are the tokens: vocab_size 256, ids 0..255."""

    vocab_size = 256
    bos_token_id = eos_token_id = None     # no special tokens: every id is a byte
    pad_token_id = 0                       # what fills a short row (its labels are -100)
    has_chat_template = False

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        # bytearray: frombuffer wants a writable buffer, and the tensor then owns a private copy
        data = text.encode("utf-8")
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids: Union[Sequence[int], torch.Tensor]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        bad = [i for i in ids if not 0 <= int(i) < 256]
        if bad:
            raise ValueError(f"ByteTokenizer.decode: ids must lie in 0..255, got {bad[:5]}")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------- corpus
# what the text corpus `dataset` must be, said with every refusal of it
DATASET_IS = "set `dataset` to a text file (the bundled corpus is data/shakespeare.txt)"


def check_data_file(path: str, what: str = "dataset file", expected: str = "") -> None:
    """Refuse a data path that is not a non-empty regular file, saying which it is (missing, a
    directory, empty) and `expected`, what it should be: the one check of every data path (the
    config's `dataset` and `datasets` in check.py, then load_corpus and sources.read_rows)."""
    then = f"; {expected}" if expected else ""
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a directory, not a file{then}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path!r} not found (working directory {os.getcwd()!r}){then}")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} is not a regular file{then}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{what} {path!r} is empty (0 bytes){then}")
    with open(path, "rb") as f:             # reads up to the first non-blank byte: one chunk, usually
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                raise ValueError(f"{what} {path!r} is empty (blank lines only){then}")
            if chunk.strip():
                break


def load_corpus(path: str, val_fraction: float = 0.1, sequence_len: Optional[int] = None,
                tokenizer=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train_tokens, val_tokens) as 1-D uint8 tensors of byte ids: the last `val_fraction` of the
    file is validation, the rest training (deterministic, no shuffling of the file). A tokenizer
    (tokenizer.py: the model's own) makes them long tensors of its ids for the whole text instead.

    With `sequence_len`, each non-empty split must hold at least one window of sequence_len + 1
    tokens, else a ValueError says which and how to fix it."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    check_data_file(path, "dataset file", DATASET_IS)
    with open(path, "rb") as f:
        raw = f.read()
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if tokenizer is not None and not isinstance(tokenizer, ByteTokenizer):
        tokens = torch.tensor(tokenizer.encode(raw.decode("utf-8", errors="replace")), dtype=torch.long)
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    if sequence_len is not None:
        need = int(sequence_len) + 1
        for name, split in (("training", train), ("validation", val)):
            if name == "validation" and val_fraction == 0:
                continue
            if len(split) < need:
                raise ValueError(
                    f"dataset {path!r} holds {len(tokens)} bytes: its {name} split ({len(split)} tokens, "
                    f"val_fraction={val_fraction}) is shorter than one sequence of sequence_len + 1 = "
                    f"{need} tokens; use a longer file or a smaller sequence_len")
    return train, val


def windows(tokens: torch.Tensor, starts: torch.Tensor,
            sequence_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), both (len(starts), T) long, from windows of T + 1 tokens."""
    idx = starts.long().unsqueeze(1) + torch.arange(sequence_len + 1)
    w = tokens[idx].long()
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


# -------------------------------------------------------------------------------------- sampler
class BatchSampler:
    """The global batch of every optimizer step, as a pure function of (seed, step).

        sampler = BatchSampler(len(train), sequence_len=256, global_batch_size=32, seed=0)
        input_ids, labels = sampler.global_batch(train, step)    # (32, 256) each
    """

    def __init__(self, num_tokens: int, sequence_len: int, global_batch_size: int, seed: int = 0):
        if sequence_len < 1 or global_batch_size < 1:
            raise ValueError(f"sequence_len ({sequence_len}) and global_batch_size ({global_batch_size}) "
                             f"must be positive integers")
        if num_tokens < sequence_len + 1:
            raise ValueError(f"{num_tokens} tokens cannot fill one sequence of sequence_len + 1 = "
                             f"{sequence_len + 1} tokens; use a longer dataset or a smaller sequence_len")
        self.num_tokens, self.sequence_len = int(num_tokens), int(sequence_len)
        self.global_batch_size, self.seed = int(global_batch_size), int(seed)
        self.num_windows = (self.num_tokens - 1) // self.sequence_len
        self._perm_cache: Dict[int, torch.Tensor] = {}   # a memo, not state: results never depend on it

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The window order of one epoch: a permutation drawn from a generator seeded by (seed, epoch)."""
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 2:
                self._perm_cache.clear()
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2 ** 63))
            self._perm_cache[epoch] = torch.randperm(self.num_windows, generator=gen)
        return self._perm_cache[epoch]

    def batch(self, step: int) -> torch.Tensor:
        """Start offsets (global_batch_size,) long of the windows of optimizer step `step`."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        first = step * self.global_batch_size
        sample = torch.arange(first, first + self.global_batch_size)
        epochs, pos = sample // self.num_windows, sample % self.num_windows
        window = torch.empty_like(sample)
        for e in epochs.unique().tolist():      # a batch may straddle an epoch boundary
            mask = epochs == e
            window[mask] = self.epoch_order(e)[pos[mask]]
        return window * self.sequence_len

    def global_batch(self, tokens: torch.Tensor, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each (global_batch_size, sequence_len) long."""
        if len(tokens) != self.num_tokens:
            raise ValueError(f"the sampler was built for {self.num_tokens} tokens, got a tensor of "
                             f"{len(tokens)}")
        return windows(tokens, self.batch(step), self.sequence_len)

    def epoch_of(self, step: int) -> float:
        return step * self.global_batch_size / self.num_windows

    def state_dict(self) -> dict:
        """What fixes the order of the data. The position itself is the step number."""
        return dict(num_tokens=self.num_tokens, sequence_len=self.sequence_len,
                    global_batch_size=self.global_batch_size, seed=self.seed)

    def load_state_dict(self, state: dict) -> None:
        """Check that a resumed run reads the same data order; the sampler has nothing else to load."""
        check_same_data_order(state, self.state_dict(), "dataset, sequence_len, global_batch_size and seed")


def check_same_data_order(saved: dict, mine: dict, what_to_keep: str) -> None:
    """A sampler's resume check: the checkpoint's order-fixing state must equal this run's."""
    diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
    if diff:
        what = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in diff.items())
        raise ValueError(f"the checkpoint's data order differs from this run ({what}); resume with "
                         f"the same {what_to_keep}")


def eval_batches(tokens: torch.Tensor, sequence_len: int, batch_size: int,
                 max_batches: Optional[int] = None) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Validation batches: consecutive windows in file order (the same on every layout), full
    batches only, at most `max_batches` of them."""
    num_windows = (len(tokens) - 1) // sequence_len
    n = num_windows // batch_size
    if max_batches is not None:
        n = min(n, max_batches)
    for i in range(n):
        starts = torch.arange(i * batch_size, (i + 1) * batch_size) * sequence_len
        yield windows(tokens, starts, sequence_len)
