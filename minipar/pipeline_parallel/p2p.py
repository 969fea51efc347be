"""The point-to-point traffic of a pipeline: activations forward, their gradients backward, posted
in paired exchanges that a backend which ignores tags (NCCL) cannot deadlock.

Between neighbouring stages of pgm.pp (the tp, cp and dp coordinates are the same on both ends,
so tp rank t of stage p talks to tp rank t of stage p + 1 only):

    forward    stage k --h (b, s_local, d)-->  stage k + 1     after stage k's forward of a micro-batch
    backward   stage k <--dL/dh (same shape)--  stage k + 1    after stage k + 1's backward of it

    s_local = sequence_len / cp (and / tp under sequence parallelism: the residual stream is
    already split along the sequence there, so each tp rank sends only its part, as Megatron does)

A model whose loss needs more than h across stages (an MoE's load-balancing loss, which pools
the routing counts of every layer) declares a side vector: a few fp32 numbers that ride right
after each activation (SIDE_FORWARD) and each gradient (SIDE_BACKWARD), in the same exchange.

Bytes per step: each of the p - 1 boundaries carries one activation forward and one gradient
backward per micro-batch, so 2 (p - 1) m x bytes(h) over the whole pipeline (interleaving: v p - 1
boundaries, a ring: the last rank feeds the first one's next chunk; the V of zbv: 2 p - 1
boundaries of which 2 (p - 1) cross ranks, the turn at rank p - 1 staying local, so 2 x 2 (p - 1) m
x bytes(h): twice 1F1B's, the price of two chunks per rank). `owner[k]` is the pp rank of virtual
stage k (schedules.stage_owners); a boundary whose two ends are on one rank (zbv's turn) moves no
bytes: the tensor is handed over in memory, detached, as a receive would give it.

What NCCL does. batch_isend_irecv opens an NCCL group (ncclGroupStart/End): its sends and receives
run as one kernel and do not block each other, so a send and a receive with the same peer in one
batch cannot wait on each other. Across batches NCCL keeps the order they were posted in: torch
runs every batch of a group on one stream per device (the communicator of the whole pp group), so
batch j + 1 of a rank starts only once batch j has finished, and once the works its rank waited
on before posting it have (a wait makes the compute stream, which every later launch follows,
wait for them). NCCL ignores tags: the k-th send from a to b pairs with the k-th receive on b from
a. And a send of a real activation (tens of MiB, past NCCL's buffers) finishes only when its
receive runs. Post each send and each receive as a batch of its own and 1F1B at pp 2 deadlocks:
rank 0 posts send A0, send A1, recv G0; rank 1 recv A0, send G0, recv A1; send A1 waits for recv
A1, queued behind send G0, which waits for recv G0, queued behind send A1. (Tiny test models fit
in the buffers and pass; a real model hangs.)

The posting order, which exchanges a rank posts before each of its actions, is a pure function
of every rank's action list: p2p_plan.py makes it (plan_exchanges, on simulate.py's timeline) and
says why it cannot deadlock under the rules above; the caller hands it to the executor, and
StageLink below only follows it.

Sends never block the schedule: a rank waits on an exchange only when the next action needs one
of its receives (or at the step's end, finish()). The bytes of a receive posted in an earlier slot
move while this rank computes (on gloo too, which moves a message only once its receive is posted).
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

import torch

from .. import comm

# the kinds of message; a model whose loss needs more than h between stages (an MoE's aux loss:
# the model's pipeline_aux) sends a small side vector with each activation and each gradient
ACTIVATION, GRADIENT, SIDE_FORWARD, SIDE_BACKWARD = 0, 1, 2, 3


def message_tag(kind: int, virtual: int, micro: int, num_micro: int) -> int:
    """The tag naming (kind, receiving virtual stage, micro-batch): unique within a step."""
    return 4 * (virtual * num_micro + micro) + kind


class Exchange(NamedTuple):
    """One batch_isend_irecv with one neighbour: the tags this rank sends it, then receives from it."""
    peer: int                    # pp rank of the neighbour
    sends: Tuple[int, ...]
    recvs: Tuple[int, ...]


class StageLink:
    """The sends and receives of one rank of pgm.pp for one step: m micro-batches, shape and dtype
    of h known in advance (no shape message travels; `shape` one for all, or a list of one per
    micro-batch: an evaluation's batches may differ in length). The executor hands each tensor it makes to
    send_*(), calls post(slot) before every action and once after the last, and takes what it
    needs with recv_*(); `virtual` is always the RECEIVING virtual stage. `transport` posts and
    waits (comm's send_recv and wait_all; a test may pass a recording wrapper)."""

    def __init__(self, pgm, shape, dtype: torch.dtype, device, num_micro: int,
                 owner: List[int], plan: List[List[Exchange]], side_sizes: Tuple[int, int] = (0, 0),
                 transport=comm):
        self.pp, self.dtype = pgm.pp, dtype
        self.shapes = [tuple(s) for s in shape] if isinstance(shape, list) else [tuple(shape)] * num_micro
        self.side_sizes = side_sizes              # the side vectors' lengths (fp32), forward and back
        self.device, self.num_micro, self.owner = device, num_micro, owner
        self.plan, self.transport = plan, transport
        self.outbox: Dict[int, torch.Tensor] = {}     # tag -> made, not yet posted
        self.local: Dict[int, torch.Tensor] = {}      # tag -> handed over in memory (zbv's turn)
        self.arrived: Dict[int, torch.Tensor] = {}    # tag -> received, not yet taken
        # posted batches: [works, {tag: receive buffer}, the sent tensors (alive until done)]
        self.posted: List[list] = []

    def _tag(self, kind: int, virtual: int, micro: int) -> int:
        return message_tag(kind, virtual, micro, self.num_micro)

    def _local(self, virtual: int) -> bool:
        return self.owner[virtual] == self.pp.rank

    def _put(self, t: torch.Tensor, kind: int, virtual: int, micro: int):
        t = t.detach().to(self.dtype if kind < SIDE_FORWARD else torch.float32).contiguous()
        (self.local if self._local(virtual) else self.outbox)[self._tag(kind, virtual, micro)] = t

    def _take(self, kind: int, virtual: int, micro: int, sender: int) -> torch.Tensor:
        tag = self._tag(kind, virtual, micro)
        if self._local(sender):
            return self.local.pop(tag)
        if tag not in self.arrived:
            batch = next((b for b in self.posted if tag in b[1]), None)
            if batch is None:
                raise RuntimeError(f"pipeline p2p: message tag {tag} is needed but no exchange posted its "
                                   f"receive: the plan does not match the action list")
            self.transport.wait_all(batch[0])     # the whole batch: on NCCL one work for all its ops
            self.arrived.update(batch[1])
            self.posted.remove(batch)
        return self.arrived.pop(tag)

    def post(self, slot: int):
        """Post the exchanges of `slot` (before action `slot`), one batch_isend_irecv each."""
        for ex in self.plan[slot]:
            peer = self.pp.ranks[ex.peer]
            missing = [t for t in ex.sends if t not in self.outbox]
            if missing:
                raise RuntimeError(f"pipeline p2p: slot {slot} sends tags {missing} to pp rank {ex.peer} "
                                   f"before they were made: the plan does not match the action list")
            sends = [(self.outbox.pop(t), peer, t) for t in ex.sends]
            recvs = [(self._buffer(t), peer, t) for t in ex.recvs]
            works = self.transport.send_recv(sends, recvs, self.pp)
            self.posted.append([works, {t: b for b, _, t in recvs}, [s for s, _, _ in sends]])
        self._reap()

    def _buffer(self, tag: int) -> torch.Tensor:
        kind = tag % 4
        if kind < SIDE_FORWARD:
            return torch.empty(self.shapes[(tag // 4) % self.num_micro], dtype=self.dtype, device=self.device)
        return torch.empty(self.side_sizes[kind - SIDE_FORWARD], dtype=torch.float32, device=self.device)

    def _reap(self):
        """Drop send-only batches the neighbour has taken (their tensors may then be freed)."""
        self.posted = [b for b in self.posted if b[1] or not all(w.is_completed() for w in b[0])]

    # the four moves, and the side vectors that ride with them
    def send_forward(self, h: torch.Tensor, virtual: int, micro: int):
        self._put(h, ACTIVATION, virtual, micro)

    def recv_forward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._take(ACTIVATION, virtual, micro, virtual - 1)

    def send_backward(self, grad: torch.Tensor, virtual: int, micro: int):
        self._put(grad, GRADIENT, virtual, micro)

    def recv_backward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._take(GRADIENT, virtual, micro, virtual + 1)

    def send_side_forward(self, side: torch.Tensor, virtual: int, micro: int):
        self._put(side, SIDE_FORWARD, virtual, micro)

    def recv_side_forward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._take(SIDE_FORWARD, virtual, micro, virtual - 1)

    def send_side_backward(self, side: torch.Tensor, virtual: int, micro: int):
        self._put(side, SIDE_BACKWARD, virtual, micro)

    def recv_side_backward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._take(SIDE_BACKWARD, virtual, micro, virtual + 1)

    def finish(self):
        """Wait for every batch still in flight (end of the step: the buffers must stay valid)."""
        posted, self.posted = self.posted, []
        for works, recvs, _ in posted:
            self.transport.wait_all(works)
            self.arrived.update(recvs)
        left = sorted(self.outbox) + sorted(self.arrived) + sorted(self.local)
        if left:
            raise RuntimeError(f"pipeline p2p: messages made or received, never sent or taken: tags {left}")


def activation_shape(micro_batch: dict, pgm, hidden_size: int,
                     sequence_parallel: bool) -> Tuple[int, int, int]:
    """(b, s_local, d) of the residual stream of this rank for a local micro-batch; sequence_parallel:
    the model's setting (the stream split along the sequence over pgm.tp)."""
    b, s = micro_batch["input_ids"].shape
    if sequence_parallel and pgm.tp.size > 1:
        s //= pgm.tp.size
    return (b, s, hidden_size)
