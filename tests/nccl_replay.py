"""Replay a pipeline's recorded p2p posts and waits under NCCL's rules: does it finish, and does
every send meet a receive of its tag and size?

    rec = Recording()                      # a transport: comm's send_recv and wait_all, recorded
    run_schedule(..., transport=rec)       # or trainer.step.transport = rec; trainer.train()
    replay({pp rank: rec.events, ...})     # raises Deadlock, or Mismatch

A rank's events: ("post", batch, ops) for each batch_isend_irecv, ops [(op, peer pp rank, tag,
shape, dtype)], op "send" or "recv"; ("wait", batch) each time it waits on a batch's works.

The rules (p2p.py's docstring says where they come from):
  - a batch runs as one NCCL group: its ops do not block each other;
  - a batch starts only once the batches before it on its stream have finished: streams="rank"
    (what torch does for batch_isend_irecv: one stream for the whole group) or streams="peer" (one
    FIFO per pair of ranks: a batch waits for the earlier ones with any of its peers);
  - a batch starts only once every batch its rank waited on before posting it has finished;
  - the k-th send from a to b pairs with the k-th receive on b from a, whatever the tags (a
    different tag, shape or dtype there is a Mismatch), and an op finishes only when the batch
    of its partner has started (a send of a real activation is too large for NCCL's buffers);
  - a batch finishes when it has started and all its ops have.
Then everything that can start and finish does; a batch left over is a Deadlock. Nothing here
looks at what the posts mean: the same rules judge any recorded order.
"""
from __future__ import annotations

from minipar import comm


class Deadlock(AssertionError):
    pass


class Mismatch(AssertionError):
    pass


class Recording:
    """comm.send_recv and comm.wait_all, each call recorded in `events` (pp ranks, not global)."""

    def __init__(self):
        self.events = []
        self._batch = {}                          # id(work) -> (work, batch): the work kept alive

    def send_recv(self, sends, recvs, dim):
        ops = [(op, dim.ranks.index(peer), tag, tuple(t.shape), str(t.dtype))
               for op, items in (("send", sends), ("recv", recvs)) for t, peer, tag in items]
        works = comm.send_recv(sends, recvs, dim)
        batch = sum(e[0] == "post" for e in self.events)
        self.events.append(("post", batch, ops))
        for w in works:
            self._batch[id(w)] = (w, batch)
        return works

    def wait_all(self, works):
        for batch in sorted({self._batch[id(w)][1] for w in works}):
            self.events.append(("wait", batch))
        comm.wait_all(works)


def replay(traces: dict, streams: str = "rank") -> int:
    """Judge the recorded events of every rank of one pp group ({pp rank: events}); returns how many
    batches ran. Raises Deadlock or Mismatch (the module docstring)."""
    ops, after, before = {}, {}, {}               # batch -> ops, batches waited on, stream predecessors
    for r, events in traces.items():
        waited, last, last_with = set(), None, {}
        for ev in events:
            if ev[0] == "wait":
                waited.add((r, ev[1]))
                continue
            b = (r, ev[1])
            ops[b], after[b] = ev[2], set(waited)
            peers = {peer for _, peer, *_ in ev[2]}
            if streams == "rank":
                before[b] = {last} - {None}
            else:
                before[b] = {last_with[q] for q in peers if q in last_with}
            last = b
            last_with.update({q: b for q in peers})
    sent, received = {}, {}                       # (from, to) -> [(batch, tag, shape, dtype)] in order
    for b in sorted(ops, key=lambda b: (b[0], b[1])):
        for op, peer, tag, shape, dtype in ops[b]:
            link = (b[0], peer) if op == "send" else (peer, b[0])
            (sent if op == "send" else received).setdefault(link, []).append((b, tag, shape, dtype))
    partners = {b: set() for b in ops}
    for link in set(sent) | set(received):
        s, rcv = sent.get(link, []), received.get(link, [])
        if len(s) != len(rcv):
            raise Mismatch(f"link {link[0]} -> {link[1]}: {len(s)} sends, {len(rcv)} receives")
        for k, (x, y) in enumerate(zip(s, rcv)):
            if x[1:] != y[1:]:
                raise Mismatch(f"link {link[0]} -> {link[1]}, message {k}: the send (tag, shape, dtype) "
                               f"{x[1:]} of batch {x[0]} pairs with the receive {y[1:]} of batch {y[0]}")
            partners[x[0]].add(y[0])
            partners[y[0]].add(x[0])
    started, done = set(), set()
    changed = True
    while changed:
        changed = False
        for b in ops:
            if b not in started and before[b] <= done and after[b] <= done:
                started.add(b)
                changed = True
            if b in started and b not in done and partners[b] <= started:
                done.add(b)
                changed = True
    stuck = sorted(set(ops) - done)
    if stuck:
        first = {}
        for r, i in stuck:
            first.setdefault(r, (i, "started" if (r, i) in started else "not started", ops[(r, i)]))
        raise Deadlock(f"{len(stuck)} of {len(ops)} batches never finish; first stuck on each rank: {first}")
    return len(done)
