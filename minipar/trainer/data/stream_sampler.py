"""The global batches of a streamed run, step after step, and the stream's position in checkpoints.

The stream (stream.py) is one long sequence of rows: epoch 0's buffer 0 rows in their order, then
buffer 1's, ... to the end of the files, then epoch 1 from the first training document again. Step s
takes the next global_batch_size rows of it (a batch may straddle buffers and epochs):

    rows      | buffer 0 (n_0 rows)       | buffer 1        | ... | epoch 1: buffer 0 ...
    step 0    [ B rows ]
    step 1              [ B rows ]
    step 2                        [ B rows straddling ]

A position is where a step starts: Position(epoch, buffer, entry, row, used, tokens), the buffer's
first document at (entry, row) of the entries, `used` of its rows already taken, `tokens` the real
tokens handed out so far (the progress the log shows). It is all a checkpoint needs: on resume the
buffer is read again from (entry, row) and packed again (the same rows: every order is seeded), its
first `used` rows dropped, so a killed-and-resumed run reads the batches of an uninterrupted one.
Saving the packer's left-over rows instead would put up to buffer_size x T tokens in every
checkpoint; reading one buffer again costs a second.

The trainer prefetches a step ahead, so the position of every step produced recently is kept:
state_dict(step) gives the position where `step` starts, the first step not yet trained when a
checkpoint is written, not the one already read ahead. With one buffer holding the whole corpus,
step s reads rows s*B .. (s+1)*B - 1 of epoch orders e = i // n exactly as packing.RowSampler does.
Every rank runs the same sampler on the same files: no communication.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from minipar.trainer.data.batches import check_same_data_order
from minipar.trainer.data.stream import Buffer, TokenStream

KEEP = 8          # the positions of the last steps produced (the prefetch is one step ahead)


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    buffer: int = 0
    entry: int = 0
    row: int = 0
    used: int = 0
    tokens: int = 0


class StreamSampler:
    """The global batch of each step from the stream, in step order (RowSampler's face).

        sampler = StreamSampler(stream, global_batch_size=32)
        batch = sampler.global_batch(step)      # dict of (32, T) long tensors, steps 0, 1, 2, ...
        state = sampler.state_dict(step)        # where `step` starts, for a checkpoint
    """

    def __init__(self, stream: TokenStream, global_batch_size: int):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.stream, self.global_batch_size = stream, int(global_batch_size)
        self._starts: Dict[int, Position] = {0: Position(0, 0, *stream.start)}
        self._batches: Dict[int, dict] = {}       # a memo of the last steps' batches, not state
        self._buf: Optional[Buffer] = None

    # ------------------------------------------------------------------ batches
    def global_batch(self, step: int) -> Dict[str, torch.Tensor]:
        """Rows of step `step`: (global_batch_size, T) each. A step is read from its start position,
        known for step 0, a resumed step, and the step after each one read."""
        if step in self._batches:
            return self._batches[step]
        if step not in self._starts:
            raise ValueError(f"the stream gives its batches in step order: step {step} was asked, and the "
                             f"steps it can read now are {sorted(self._starts)}")
        batch, end = self._take(self._starts[step], self.global_batch_size)
        self._starts[step + 1] = end
        self._batches = {s: b for s, b in self._batches.items() if s > step - 2}
        self._batches[step] = batch
        for s in sorted(self._starts)[:-KEEP]:
            del self._starts[s]
        return batch

    def _load(self, pos: Position) -> Optional[Buffer]:
        """The buffer `pos` is in: the one held, else read (None at the end of the documents)."""
        b = self._buf
        if b is None or (b.epoch, b.index, b.start) != (pos.epoch, pos.buffer, (pos.entry, pos.row)):
            self._buf = b = self.stream.buffer(pos.epoch, pos.buffer, (pos.entry, pos.row))
        return b

    def _take(self, pos: Position, count: int):
        """`count` rows from `pos` on, and the position after them."""
        parts: List[Dict[str, torch.Tensor]] = []
        empty_epochs = 0                           # ends of the files met since the last row taken
        while count:
            buf = self._load(pos)
            if buf is None:                        # the documents ran out: the next epoch
                if pos.buffer == 0 or empty_epochs:    # none at all, or a whole epoch without a row
                    paths = [e["path"] for e in self.stream.entries]
                    raise ValueError(f"the stream {paths} holds no document with a trained token after "
                                     f"the held-out head (val_set_size)")
                empty_epochs += 1
                pos = Position(pos.epoch + 1, 0, *self.stream.start, 0, pos.tokens)
                continue
            if pos.used >= buf.n:                  # done with it: the next one starts where it ended
                pos = Position(pos.epoch, pos.buffer + 1, *buf.end, 0, pos.tokens)
                continue
            k = min(count, buf.n - pos.used)
            cut = slice(pos.used, pos.used + k)
            parts.append({key: v[cut] for key, v in buf.rows.items()})
            pos = dataclasses.replace(pos, used=pos.used + k, tokens=pos.tokens + int(buf.tokens[cut].sum()))
            count -= k
            empty_epochs = 0
        return {key: torch.cat([p[key] for p in parts]).long() for key in parts[0]}, pos

    # ------------------------------------------------------------------ progress and checkpoints
    def progress(self, step: int) -> dict:
        """The run's progress through the stream when `step` starts: tokens handed out, the epoch."""
        pos = self._starts.get(step)
        return {} if pos is None else dict(stream_tokens=pos.tokens, stream_epoch=pos.epoch)

    def settings(self) -> dict:
        s = self.stream
        return dict(kind="stream", sequence_len=s.T, seed=s.seed, packing=s.packing, keys=list(s.keys),
                    buffer_size=s.buffer_size, start=list(s.start), fingerprint=s.fingerprint())

    def state_dict(self, step: int) -> dict:
        """Where `step` starts, with what fixes the rows (checked on load)."""
        if step not in self._starts:
            raise ValueError(f"the stream's position at step {step} is not known (known: "
                             f"{sorted(self._starts)})")
        return dict(self.settings(), step=int(step), position=dataclasses.asdict(self._starts[step]))

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's position: the same entries, tokenizer and settings only."""
        check_same_data_order({k: state.get(k) for k in self.settings()}, self.settings(),
                              "datasets (streamed), tokenizer, sequence_len, sample_packing, "
                              "pretrain_multipack_attn, streaming_multipack_buffer_size, val_set_size "
                              "and seed")
        self._starts = {int(state["step"]): Position(**state["position"])}
        self._batches, self._buf = {}, None
