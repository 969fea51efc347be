"""The communication ledger: an opt-in record of every collective comm.py makes, for tests and
benchmarks to hold against theory.

    with comm_ledger.ledger() as led:
        model(x).sum().backward()
    led.count("all_reduce", "tp")           # calls of one op over one group
    led.total_bytes("all_gather", "dp_shard_cp")   # bytes of the full buffers
    led.wire_bytes()                        # bytes this rank put on the wire
    led.summary()                           # {(op, group): (calls, bytes)}

Each Record holds (op, group name, group size, element count, bytes of the full buffer, wire
bytes, dtype). Which buffer counts is fixed per op, as the planner (minipar/plan/collective_counts.py) counts:
all_reduce the tensor, all_gather the output, reduce_scatter and all_to_all (even or uneven) the
input, send_recv and send the message; wire bytes apply the factors of comm.py's table (all_reduce
2 (n-1)/n, all_gather, reduce_scatter and all_to_all (n-1)/n, all_to_all_uneven the rows that leave
the rank, point-to-point 1). A size-1 group never
communicates and is never recorded. `mark("label")` interleaves a marker with the records, so an
order of events (a prefetch issued before a forward ends) can be checked.

It records, it never decides: nothing in the model reads it, and with no ledger open _record
returns at once. The open ledgers are one module-level list, not thread-local, because backward
hooks may run on autograd's device threads and must still be counted.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import List, Optional

import torch


@dataclass
class Record:
    op: str
    group: str
    group_size: int
    numel: int
    bytes: int
    wire_bytes: float
    dtype: str = ""


@dataclass
class Ledger:
    events: list = field(default_factory=list)   # Records and str markers, in call order

    @property
    def records(self) -> List[Record]:
        return [e for e in self.events if isinstance(e, Record)]

    def filter(self, op: Optional[str] = None, group: Optional[str] = None) -> List[Record]:
        return [r for r in self.records if (op is None or r.op == op) and (group is None or r.group == group)]

    def total_bytes(self, op: Optional[str] = None, group: Optional[str] = None) -> int:
        return sum(r.bytes for r in self.filter(op, group))

    def wire_bytes(self, op: Optional[str] = None, group: Optional[str] = None) -> float:
        return sum(r.wire_bytes for r in self.filter(op, group))

    def count(self, op: Optional[str] = None, group: Optional[str] = None) -> int:
        return len(self.filter(op, group))

    def summary(self) -> dict:
        """{(op, group): (calls, bytes)}"""
        out: dict = {}
        for r in self.records:
            calls, nbytes = out.get((r.op, r.group), (0, 0))
            out[(r.op, r.group)] = (calls + 1, nbytes + r.bytes)
        return out


# The active ledgers. A list, not thread-local: backward hooks may run on autograd's device
# threads and must still be counted.
_ACTIVE: List[Ledger] = []


@contextlib.contextmanager
def ledger():
    led = Ledger()
    _ACTIVE.append(led)
    try:
        yield led
    finally:
        _ACTIVE.remove(led)


def mark(label: str) -> None:
    for led in _ACTIVE:
        led.events.append(label)


def _record(op: str, dim, tensor: torch.Tensor, wire_factor: float) -> None:
    if not _ACTIVE:
        return
    nbytes = tensor.numel() * tensor.element_size()
    rec = Record(op, dim.name, dim.size, tensor.numel(), nbytes, wire_factor * nbytes, str(tensor.dtype))
    for led in _ACTIVE:
        led.events.append(rec)
