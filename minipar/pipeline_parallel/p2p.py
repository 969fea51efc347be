"""The point-to-point traffic of a pipeline: activations forward, their gradients backward.

Between neighbouring stages of pgm.pp (the tp, cp and dp coordinates are the same on both ends,
so tp rank t of stage p talks to tp rank t of stage p + 1 only):

    forward    stage k --h (b, s_local, d)-->  stage k + 1     after stage k's forward of a micro-batch
    backward   stage k <--dL/dh (same shape)--  stage k + 1    after stage k + 1's backward of it

    s_local = sequence_len / cp (and / tp under sequence parallelism: the residual stream is
    already split along the sequence there, so each tp rank sends only its part, as Megatron does)

Bytes per step: each of the p - 1 boundaries carries one activation forward and one gradient
backward per micro-batch, so 2 (p - 1) m x bytes(h) over the whole pipeline (interleaving: v p - 1
boundaries, a ring: the last rank feeds the first one's next chunk).

The receiver knows the shape in advance (every stage sees the same micro-batch shape), so no
shape message travels. Each message has a tag naming (kind, receiving virtual stage, micro-batch):
a backend that matches by tag (gloo) pairs every send with its receive whatever the posting order.
A backend that ignores tags (NCCL) matches a link's messages in posting order: the executor posts
sends in the order it produces them and receives in the order it consumes them, and for all three
schedules these two orders agree on every link (tests/test_pipeline.py checks it). Sends are
asynchronous: a stage never waits for its neighbour to take a tensor before going on with its next
micro-batch; only a receive blocks, when its data is needed.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from .. import comm

ACTIVATION, GRADIENT = 0, 1


class StageLink:
    """The sends and receives of one rank of pgm.pp for one step: m micro-batches, shape and dtype
    of h known in advance. `virtual` is the receiving virtual stage (chunk * pp + rank)."""

    def __init__(self, pgm, shape: Tuple[int, ...], dtype: torch.dtype, device, num_micro: int):
        self.pp, self.shape, self.dtype = pgm.pp, tuple(shape), dtype
        self.device, self.num_micro = device, num_micro
        self.pending: List[Tuple[object, torch.Tensor]] = []      # sends in flight (work, tensor)
        self.bytes_sent = 0

    def _tag(self, kind: int, virtual: int, micro: int) -> int:
        return 2 * (virtual * self.num_micro + micro) + kind

    def _send(self, t: torch.Tensor, peer: int, tag: int):
        t = t.detach().to(self.dtype).contiguous()
        self.bytes_sent += t.numel() * t.element_size()
        self.pending += [(w, t) for w in comm.send_recv([(t, peer, tag)], [], self.pp)]
        self._reap()

    def _recv(self, peer: int, tag: int) -> torch.Tensor:
        t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        comm.wait_all(comm.send_recv([], [(t, peer, tag)], self.pp))
        return t

    def _reap(self):
        """Drop sends the neighbour has taken (their tensors may then be freed)."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    # the four moves; `virtual` is always the virtual stage that RECEIVES
    def send_forward(self, h: torch.Tensor, virtual: int, micro: int):
        self._send(h, self.pp.next_rank, self._tag(ACTIVATION, virtual, micro))

    def recv_forward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._recv(self.pp.prev_rank, self._tag(ACTIVATION, virtual, micro))

    def send_backward(self, grad: torch.Tensor, virtual: int, micro: int):
        self._send(grad, self.pp.prev_rank, self._tag(GRADIENT, virtual, micro))

    def recv_backward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._recv(self.pp.next_rank, self._tag(GRADIENT, virtual, micro))

    def finish(self):
        """Wait for every send still in flight (end of the step: the buffers must stay valid)."""
        for w, _ in self.pending:
            w.wait()
        self.pending = []


def activation_shape(micro_batch: dict, pgm, hidden_size: int) -> Tuple[int, int, int]:
    """(b, s_local, d) of the residual stream of this rank for a local micro-batch."""
    b, s = micro_batch["input_ids"].shape
    if pgm.config.sequence_parallel and pgm.tp.size > 1:
        s //= pgm.tp.size
    return (b, s, hidden_size)
