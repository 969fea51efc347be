"""Where a step's tokens come from, for every layout's step (compose.Step, through trainer.py), and
the evaluation loop over them.

    Batches(run, device)
        global_batch(step)      (B, T) input_ids, labels (+ position_ids, document_ids when packed):
                                the same on every rank, a pure function of seed and step
        step(step, M)           num_items_in_batch and this rank's M micro-batches, on the device
        prefetch(step, M)       make them one step ahead: a step calls it for the next step once
                                it has queued its own work, so the host cuts and copies the next
                                rows while the GPU computes (pinned, non_blocking: no wait)
        local(gb, m, M)         this rank's share of micro-batch m of M: dp samples, cp chunks
        eval_batches()          the validation batches, in file order, the same on every rank
        state_dict()            the sampler's position, saved in a checkpoint's extra (a stream's:
                                where the first step not yet trained starts, not the prefetched one)
        progress(step)          a stream's tokens handed out when `step` starts ({} otherwise)
    eval_loss(model, batches, loss_of, groups, window)
        the mean over the eval batches of their losses, loss_of([local batch, ...], [num_items, ...])
        on `window` batches at a time (under pp they go down the pipeline together: compose's
        Step.eval_window), summed over `groups` (dp_cp; and pp, where only the last stage adds a loss)

Three sources sit behind the one interface: packed `datasets` rows (packing.py) when the config
names datasets, the same rows read as the steps need them when they stream (pretraining_dataset:
stream.py, stream_sampler.py), else windows of the byte corpus (batches.py). A step never asks which.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from minipar import batch_split, comm
from minipar.trainer.data import batches as mdata
from minipar.trainer.data.packing import RowSampler
from minipar.trainer.data.packing import eval_batches as packed_eval_batches
from minipar.trainer.data.stream import TokenStream
from minipar.trainer.data.stream_sampler import StreamSampler


class Batches:
    """The run's global batches, this rank's share of them, and the eval batches."""

    def __init__(self, run, device: torch.device):
        self.run, self.cfg, self.pgm, self.device = run, run.cfg, run.pgm, device
        cfg = self.cfg
        self.streamed = run.datasets is not None and isinstance(run.datasets.train, TokenStream)
        if self.streamed:                         # rows packed as the steps need them (stream.py)
            self.sampler = StreamSampler(run.datasets.train, cfg.global_batch_size)
        elif run.datasets is not None:            # `datasets` rows (packing.py), else the byte corpus
            self.sampler = RowSampler(run.datasets.train, cfg.global_batch_size, cfg.seed)
        else:
            self.sampler = mdata.BatchSampler(len(run.train_tokens), cfg.sequence_len, cfg.global_batch_size,
                                              cfg.seed)
        self._ahead = None                        # ((step, M), what step() gives): prefetch's batches
        self._next = 0                            # the first step not yet trained (a stream's checkpoint)

    def global_batch(self, step: int) -> dict:
        if self.run.datasets is not None:
            return self.sampler.global_batch(step)
        ids, labels = self.sampler.global_batch(self.run.train_tokens, step)
        return dict(input_ids=ids, labels=labels)

    def step(self, step: int, M: int):
        """(num_items_in_batch, [this rank's M micro-batches]) of step `step`, on the device: the ones
        prefetch(step) prepared, else made now."""
        self._next = step + 1
        if self._ahead is not None and self._ahead[0] == (step, M):
            ready, self._ahead = self._ahead[1], None
            return ready
        self._ahead = None
        return self._make(step, M)

    def _make(self, step: int, M: int):
        gb = self.global_batch(step)
        return batch_split.count_label_tokens(gb["labels"]), [self.local(gb, m, M) for m in range(M)]

    def prefetch(self, step: int, M: int) -> None:
        """Make step `step`'s batches now, while the device still works through the current step's
        queue: the next step then starts from rows already on their way (one step ahead)."""
        self._ahead = ((step, M), self._make(step, M))

    def local(self, gb: dict, m: int, M: int) -> dict:
        return batch_split.local_batch(gb["input_ids"], gb["labels"], self.pgm, m, M, device=self.device,
                                 position_ids=gb.get("position_ids"), document_ids=gb.get("document_ids"))

    def eval_batches(self) -> Iterator[dict]:
        cfg = self.cfg
        if self.run.datasets is not None:
            yield from packed_eval_batches(self.run.datasets.val, cfg.global_batch_size, cfg.eval_batches)
            return
        for ids, labels in mdata.eval_batches(self.run.val_tokens, cfg.sequence_len, cfg.global_batch_size,
                                              cfg.eval_batches):
            yield dict(input_ids=ids, labels=labels)

    # the sampler's position travels in a checkpoint, so a resumed run reads the batches it would have
    def state_dict(self) -> dict:
        return self.sampler.state_dict(self._next) if self.streamed else self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
        self._ahead = None
        self._next = int(state.get("step", 0))

    def progress(self, step: int) -> dict:
        return self.sampler.progress(step) if self.streamed else {}


@torch.no_grad()
def eval_loss(model, batches: Batches, loss_of: Callable[[list, list], torch.Tensor],
              groups: Sequence, window: int = 1) -> float:
    """The mean eval loss: every eval batch whole (one micro-batch), each rank's loss a share of the
    batch mean, so the sum over `groups` is the loss of the batch on every layout. loss_of takes
    up to `window` batches and their token counts and returns their (k,) shares."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=batches.device)
    count = 0
    for group in batch_split.windows(batches.eval_batches(), window):
        shares = loss_of([batches.local(gb, 0, 1) for gb in group],
                         [batch_split.count_label_tokens(gb["labels"]) for gb in group])
        for k in range(len(group)):                # summed in batch order: the numbers of one at a time
            total += shares[k]
        count += len(group)
    for group in groups:
        comm.all_reduce(total, group)
    model.train()
    return total.item() / max(count, 1)
