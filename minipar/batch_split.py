"""The share of one global batch that a rank computes: its data-parallel samples, one micro-batch
of them, its context-parallel chunks of the sequence. No communication.

The split of one step's global batch (B samples x T tokens), as in docs/design.md:

    global batch  B x T                       (every rank builds it: it is cheap, and every rank
      |                                        then knows num_items_in_batch without talking)
      | dp rank d of D takes samples [d*B/D, (d+1)*B/D)        contiguous blocks, in order
      | micro-step m of M takes its B/(D*M) of those          gradient accumulation
      | cp rank c of C keeps chunks c and 2C-1-c of 2C        zigzag, input ids, labels and
      v                                                       positions alike
    local  B/(D*M) x T/C                      tp ranks of one group get identical input

    e.g. T = 8, C = 2: chunks [0 1 | 2 3 | 4 5 | 6 7]; cp rank 0 keeps positions 0 1 6 7,
    cp rank 1 keeps 2 3 4 5, so both ranks do the same causal-attention work.

Communication: none. The loss divides by num_items_in_batch = the count of non-ignored labels in
the WHOLE global batch (`count_label_tokens(global labels)`), so per-rank losses sum to the
single-process loss and gradients are summed, never averaged, over dp and cp.

The zigzag layout is Megatron-LM's context parallelism's and ring-flash-attention's (a cousin of
Striped Attention, Brandon et al., 2023); context_parallel/layouts.py cuts the sequence.
"""
from __future__ import annotations

import itertools
from typing import Dict, Iterable, Iterator, List, Optional

import torch

from minipar.config import check_sequence_len
from minipar.context_parallel import sequence_positions, shard_sequence

IGNORE_INDEX = -100     # a label that does not count (the prompt of a chat row, padding)


def count_label_tokens(labels: torch.Tensor) -> int:
    """How many labels count in the loss: num_items_in_batch, taken over the GLOBAL batch."""
    return int((labels != IGNORE_INDEX).sum().item())


def check_batch_split(global_batch_size: int, sequence_len: int, pgm, num_micro_steps: int = 1) -> None:
    """Raise a ValueError (before any collective) when the batch cannot be split on this layout."""
    parts = pgm.dp.size * num_micro_steps
    if num_micro_steps < 1 or global_batch_size % parts:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not divisible by dp size {pgm.dp.size} "
            f"(dp_replicate x dp_shard) x num_micro_steps {num_micro_steps} = {parts}; use a "
            f"global_batch_size that is a multiple of {parts}, or fewer accumulation steps")
    check_sequence_len(sequence_len, pgm.cp.size)


def local_batch(input_ids: torch.Tensor, labels: torch.Tensor, pgm, micro_step: int = 0,
                num_micro_steps: int = 1, device=None, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """This rank's share of the global batch: dict(input_ids, labels, position_ids), each
    (B / (dp * num_micro_steps), T / cp) long; position_ids are the true positions of the kept
    tokens (zigzag under cp, or contiguous with cp_layout). Packed rows (packing.py) bring their own
    position_ids (restarting at each example) and document_ids: both are cut exactly like the tokens,
    and document_ids is added to the dict. No communication. To a GPU the host rows go pinned and
    with non_blocking: the host queues the copy and goes on (a pageable copy would wait for it)."""
    B, T = input_ids.shape
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} "
                         f"differ in shape")
    check_batch_split(B, T, pgm, num_micro_steps)
    if not 0 <= micro_step < num_micro_steps:
        raise ValueError(f"micro_step {micro_step} is outside 0..{num_micro_steps - 1}")
    per_rank = B // pgm.dp.size
    per_micro = per_rank // num_micro_steps
    first = pgm.dp.rank * per_rank + micro_step * per_micro
    rows = slice(first, first + per_micro)
    device = torch.device(input_ids.device if device is None else device)

    def to_device(t):                          # pinned, then a copy the host does not wait for
        if device.type == "cuda" and t.device.type == "cpu":
            t = t.pin_memory()
        return t.to(device, non_blocking=True)
    layout = pgm.config.cp_layout              # zigzag (default) or contiguous: context_parallel/layouts.py
    ids = to_device(shard_sequence(input_ids[rows], 1, pgm.cp, layout))
    lab = to_device(shard_sequence(labels[rows], 1, pgm.cp, layout))
    if position_ids is None:
        pos = sequence_positions(T, pgm.cp, layout, device=device)
        pos = pos.unsqueeze(0).expand(per_micro, -1).contiguous()
    else:
        pos = to_device(shard_sequence(position_ids[rows], 1, pgm.cp, layout)).contiguous()
    out = dict(input_ids=ids.contiguous(), labels=lab.contiguous(), position_ids=pos)
    if document_ids is not None:
        out["document_ids"] = to_device(shard_sequence(document_ids[rows], 1, pgm.cp, layout)).contiguous()
    return out


def windows(items: Iterable, size: int) -> Iterator[List]:
    """items in lists of `size`, the last one shorter: the batches one forward pass takes together
    (compose.Step.eval_window; under pp they go down the pipeline at once)."""
    it = iter(items)
    while True:
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield chunk
