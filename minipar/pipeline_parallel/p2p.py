"""The point-to-point traffic of a pipeline: activations forward, their gradients backward.

Between neighbouring stages of pgm.pp (the tp, cp and dp coordinates are the same on both ends,
so tp rank t of stage p talks to tp rank t of stage p + 1 only):

    forward    stage k --h (b, s_local, d)-->  stage k + 1     after stage k's forward of a micro-batch
    backward   stage k <--dL/dh (same shape)--  stage k + 1    after stage k + 1's backward of it

    s_local = sequence_len / cp (and / tp under sequence parallelism: the residual stream is
    already split along the sequence there, so each tp rank sends only its part, as Megatron does)

A model whose loss needs more than h across stages (an MoE's load-balancing loss, which pools
the routing counts of every layer) declares a side vector: a few fp32 numbers sent right after each
activation (SIDE_FORWARD) and each gradient (SIDE_BACKWARD), with their own tags (executor.py).

Bytes per step: each of the p - 1 boundaries carries one activation forward and one gradient
backward per micro-batch, so 2 (p - 1) m x bytes(h) over the whole pipeline (interleaving: v p - 1
boundaries, a ring: the last rank feeds the first one's next chunk; the V of zbv: 2 p - 1
boundaries of which 2 (p - 1) cross ranks, the turn at rank p - 1 staying local, so 2 x 2 (p - 1) m
x bytes(h): twice 1F1B's, the price of two chunks per rank).

Which rank holds the other end of a boundary is the placement's: `owner[k]` is the pp rank of
virtual stage k (schedules.chunk_stages). A boundary whose two ends are on this rank (zbv's turn)
moves no bytes: the tensor is handed over in memory, detached, as a receive would give it.

The receiver knows the shape in advance (every stage sees the same micro-batch shape), so no
shape message travels. Each message has a tag naming (kind, receiving virtual stage, micro-batch):
a backend that matches by tag (gloo) pairs every send with its receive whatever the posting order.
A backend that ignores tags (NCCL) matches a link's messages in posting order: the executor posts
sends in the order it produces them; for AFAB, 1F1B, interleaved 1F1B and ZB-H1 every link
consumes them in that same order (tests/test_pipeline.py checks it). ZB-V does not: the link from
rank r to r + 1 carries chunk 0's activations and chunk 1's gradients, and rank r + 1 may need a
gradient that rank r sent after an activation. So a link can be given `arrivals`, the order in
which each neighbour posts its sends to this rank (arrival_order: a pure function of the
schedule, like everything the neighbours do); it then receives in that order, and a message that
comes before it is needed waits in `early` (its sender posted it earlier, so receiving it first
never waits longer than for the wanted one). Sends are
asynchronous: a stage never waits for its neighbour to take a tensor before going on with its next
micro-batch; only a receive blocks, when its data is needed. On gloo each neighbour's next receive
is kept posted (`_post_next`): gloo moves a message only once its receiver has posted the receive,
so a receive posted at the moment of need pays a handshake and the sender's I/O thread must win a
core from the sender's compute; posted ahead, the bytes arrive while this rank computes. Not on
NCCL, which runs a pair's sends and receives on one stream: a receive posted ahead would hold back
this rank's own sends behind it, and two neighbours doing so would wait on each other.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import comm
from .schedules import chunk_stages, schedule_order

# the kinds of message; a model whose loss needs more than h between stages (an MoE's aux loss:
# the model's pipeline_aux) sends a small side vector after each activation and each gradient
ACTIVATION, GRADIENT, SIDE_FORWARD, SIDE_BACKWARD = 0, 1, 2, 3


def message_tag(kind: int, virtual: int, micro: int, num_micro: int) -> int:
    """The tag naming (kind, receiving virtual stage, micro-batch): unique within a step."""
    return 4 * (virtual * num_micro + micro) + kind


def arrival_order(name: str, p: int, m: int, v: int, rank: int, side: bool = False) -> Dict[int, List[int]]:
    """{pp rank of a neighbour: the tags of its sends to `rank`, in the order it posts them};
    side: each activation and gradient is followed by its side vector."""
    owner = {k: r for r in range(p) for k in chunk_stages(name, p, r, v)}
    last, out = p * v - 1, {}
    for r in range(p):
        for a in schedule_order(name, p, m, r, v):
            vs = chunk_stages(name, p, r, v)[a.chunk]
            if a.kind == "F" and vs < last and owner[vs + 1] == rank != r:
                out.setdefault(r, []).append(message_tag(ACTIVATION, vs + 1, a.micro, m))
                if side:
                    out[r].append(message_tag(SIDE_FORWARD, vs + 1, a.micro, m))
            if a.kind == "B" and vs > 0 and owner[vs - 1] == rank != r:
                out.setdefault(r, []).append(message_tag(GRADIENT, vs - 1, a.micro, m))
                if side:
                    out[r].append(message_tag(SIDE_BACKWARD, vs - 1, a.micro, m))
    return out


class StageLink:
    """The sends and receives of one rank of pgm.pp for one step: m micro-batches, shape and dtype
    of h known in advance. `virtual` is the receiving virtual stage (chunk * pp + rank)."""

    def __init__(self, pgm, shape: Tuple[int, ...], dtype: torch.dtype, device, num_micro: int,
                 owner: Optional[List[int]] = None, arrivals: Optional[Dict[int, List[int]]] = None,
                 side_sizes: Tuple[int, int] = (0, 0)):
        self.pp, self.shape, self.dtype = pgm.pp, tuple(shape), dtype
        self.side_sizes = side_sizes              # the side vectors' lengths (fp32), forward and back
        self.device, self.num_micro = device, num_micro
        # the pp rank holding each virtual stage; default: the loop, k -> k % pp
        self.owner = owner
        self.pending: List[Tuple[object, torch.Tensor]] = []      # sends in flight (work, tensor)
        self.local: Dict[int, torch.Tensor] = {}                  # tag -> tensor handed over in memory
        # receive in each neighbour's posting order (keyed by global rank), or as consumed (None)
        self.arrivals = None if arrivals is None else {pgm.pp.ranks[k]: list(t) for k, t in arrivals.items()}
        self.early: Dict[int, torch.Tensor] = {}                  # tag -> received before it was needed
        self.bytes_sent = 0
        # gloo: each neighbour's next receive kept posted (the module docstring says why not NCCL)
        self.posted: Dict[int, tuple] = {}                        # peer -> (tag, tensor, works)
        self.prepost = self.arrivals is not None and "gloo" in str(dist.get_backend(pgm.pp.group))
        if self.prepost:
            for peer in self.arrivals:
                self._post_next(peer)

    def _tag(self, kind: int, virtual: int, micro: int) -> int:
        return message_tag(kind, virtual, micro, self.num_micro)

    def _peer(self, virtual: int) -> int:
        """The global rank holding virtual stage `virtual` (None: this rank itself)."""
        k = virtual % self.pp.size if self.owner is None else self.owner[virtual]
        return None if k == self.pp.rank else self.pp.ranks[k]

    def _send(self, t: torch.Tensor, peer: int, tag: int):
        t = t.detach().to(self.dtype if tag % 4 < SIDE_FORWARD else torch.float32).contiguous()
        if peer is None:                         # both ends here: no bytes move
            self.local[tag] = t
            return
        self.bytes_sent += t.numel() * t.element_size()
        self.pending += [(w, t) for w in comm.send_recv([(t, peer, tag)], [], self.pp)]
        self._reap()

    def _recv(self, peer: int, tag: int) -> torch.Tensor:
        if peer is None:
            return self.local.pop(tag)
        if self.arrivals is None:
            return self._recv_now(peer, tag)
        while tag not in self.early:             # what the neighbour posted first comes first
            if peer not in self.posted:          # not posted ahead (NCCL): posted now, when needed
                self._post_next(peer)
            first, t, works = self.posted.pop(peer)
            comm.wait_all(works)
            self.early[first] = t
            if self.prepost:
                self._post_next(peer)
        return self.early.pop(tag)

    def _post_next(self, peer: int):
        """Post the receive of the next message `peer` sends us, into a fresh buffer. gloo moves a
        message only once its receive is posted (the receiver tells the sender it is ready); a
        receive posted when the data is needed costs that handshake, and the sender's I/O thread
        must then win a core from its own compute. Posted ahead, the bytes move while this rank
        computes and the wait finds them there."""
        if self.arrivals[peer]:
            tag = self.arrivals[peer].pop(0)
            t = self._buffer(tag)
            self.posted[peer] = (tag, t, comm.send_recv([], [(t, peer, tag)], self.pp))

    def _buffer(self, tag: int) -> torch.Tensor:
        kind = tag % 4
        if kind < SIDE_FORWARD:
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return torch.empty(self.side_sizes[kind - SIDE_FORWARD], dtype=torch.float32, device=self.device)

    def _recv_now(self, peer: int, tag: int) -> torch.Tensor:
        t = self._buffer(tag)
        comm.wait_all(comm.send_recv([], [(t, peer, tag)], self.pp))
        return t

    def _reap(self):
        """Drop sends the neighbour has taken (their tensors may then be freed)."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]

    # the four moves; `virtual` is always the virtual stage that RECEIVES
    def send_forward(self, h: torch.Tensor, virtual: int, micro: int):
        self._send(h, self._peer(virtual), self._tag(ACTIVATION, virtual, micro))

    def recv_forward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._recv(self._peer(virtual - 1), self._tag(ACTIVATION, virtual, micro))

    def send_backward(self, grad: torch.Tensor, virtual: int, micro: int):
        self._send(grad, self._peer(virtual), self._tag(GRADIENT, virtual, micro))

    def recv_backward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._recv(self._peer(virtual + 1), self._tag(GRADIENT, virtual, micro))

    # the side vectors, sent right after their activation / gradient (arrival_order's side=True)
    def send_side_forward(self, side: torch.Tensor, virtual: int, micro: int):
        self._send(side, self._peer(virtual), self._tag(SIDE_FORWARD, virtual, micro))

    def recv_side_forward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._recv(self._peer(virtual - 1), self._tag(SIDE_FORWARD, virtual, micro))

    def send_side_backward(self, side: torch.Tensor, virtual: int, micro: int):
        self._send(side, self._peer(virtual), self._tag(SIDE_BACKWARD, virtual, micro))

    def recv_side_backward(self, virtual: int, micro: int) -> torch.Tensor:
        return self._recv(self._peer(virtual + 1), self._tag(SIDE_BACKWARD, virtual, micro))

    def finish(self):
        """Wait for every send still in flight (end of the step: the buffers must stay valid)."""
        for w, _ in self.pending:
            w.wait()
        self.pending = []
        if self.posted:                          # every arrival is consumed by a schedule's end
            tags = [t for t, _, _ in self.posted.values()]
            raise RuntimeError(f"receives posted but never consumed: tags {tags}")


def activation_shape(micro_batch: dict, pgm, hidden_size: int) -> Tuple[int, int, int]:
    """(b, s_local, d) of the residual stream of this rank for a local micro-batch."""
    b, s = micro_batch["input_ids"].shape
    if pgm.config.sequence_parallel and pgm.tp.size > 1:
        s //= pgm.tp.size
    return (b, s, hidden_size)
