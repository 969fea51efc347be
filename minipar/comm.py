"""The collectives every parallel piece uses, and the communication ledger that counts them.

Each function takes a `MeshDim` (pgm.tp, pgm.dp_shard_cp, ...) instead of a raw process group,
so that a size-1 dimension returns at once without communicating, and so that the ledger can say
which group a call went over.

    collective          buffer (n = group size)               bytes each rank sends (ring algorithm)
    all_reduce          x: [N]                 -> [N] summed    2 (n-1)/n * bytes(x)
    all_gather          x: [N/n] per rank      -> [N]           (n-1)/n * bytes(out)
    reduce_scatter      x: [N]                 -> [N/n] summed  (n-1)/n * bytes(in)
    all_to_all          x: [n, N/n], slot i    -> rank i        (n-1)/n * bytes(x), its own slot stays
    all_to_all_uneven   x: rows cut in n runs, run i -> rank i  bytes(x) - bytes(own run)
    ring send/recv      x -> next rank, y <- previous rank      bytes(x)
    send / recv         x -> any member (pipeline stages)      bytes(x), counted on the sender

torch 2.13 deprecates `all_gather_into_tensor` / `reduce_scatter_tensor` in favour of
`all_gather_single` / `reduce_scatter_single`; older releases (2.4 ...) only have the first pair.
We pick whichever exists, so no deprecation warning is raised on any supported release.

The ledger (comm_ledger.py): `with comm_ledger.ledger() as led: ...` records every call made inside (op,
group name, group size, element count, bytes of the full buffer, and the bytes this rank puts on
the wire by the table above). Tests and benchmarks compare it against theory. It is an opt-in
recorder, not a setting: nothing in the model reads it. `comm_ledger.mark("label")` adds a marker to the
record, so an order of events (a prefetch issued before a forward ends, say) can be checked.

Every call runs through comm_calls.py: a span "op:group" in a profiler trace, and a failure or
timeout re-raised as a `CollectiveError` naming the operation, the group and its ranks.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .comm_calls import Done, NamedWork, run, span
from .comm_ledger import _record

ReduceOp = dist.ReduceOp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _reduce_op(op):
    if isinstance(op, str):
        return {"sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN, "avg": "avg"}[op]
    return op


# ----------------------------------------------------------------------------------- collectives
def all_reduce(tensor: torch.Tensor, dim, op="sum", async_op: bool = False):
    """In place. op "avg" is a sum then a division (gloo has no AVG)."""
    if dim.size == 1:
        return Done() if async_op else tensor
    n = dim.size
    _record("all_reduce", dim, tensor, 2 * (n - 1) / n)
    op = _reduce_op(op)
    if op == "avg":
        if async_op:
            raise ValueError("all_reduce(op='avg') cannot be async; "
                             "sum asynchronously and divide after wait()")
        run("all_reduce", dim, lambda: dist.all_reduce(tensor, op=ReduceOp.SUM, group=dim.group), False)
        return tensor.div_(n)
    work = run("all_reduce", dim, lambda: dist.all_reduce(tensor, op=op, group=dim.group, async_op=async_op),
                async_op)
    return work if async_op else tensor


def all_gather_into(output: torch.Tensor, input: torch.Tensor, dim, async_op: bool = False):
    """output (n * len, ...) <- the inputs (len, ...) of all ranks, concatenated along dim 0."""
    if output.shape[0] != input.shape[0] * dim.size:
        raise ValueError(f"all_gather_into: output has {output.shape[0]} rows, expected "
                         f"{dim.size} x {input.shape[0]} over {dim.name}")
    if dim.size == 1:
        output.copy_(input)
        return Done() if async_op else output
    _record("all_gather", dim, output, (dim.size - 1) / dim.size)
    src = input.contiguous()
    work = run("all_gather", dim,
                lambda: _all_gather_single(output, src, group=dim.group, async_op=async_op), async_op)
    return work if async_op else output


def all_gather(tensor: torch.Tensor, dim, gather_dim: int = 0) -> torch.Tensor:
    """The tensors of all ranks concatenated along `gather_dim` (a new tensor)."""
    if dim.size == 1:
        return tensor
    moved = tensor.movedim(gather_dim, 0).contiguous()
    out = moved.new_empty((dim.size * moved.shape[0],) + tuple(moved.shape[1:]))
    all_gather_into(out, moved, dim)
    return out.movedim(0, gather_dim)


def reduce_scatter_into(output: torch.Tensor, input: torch.Tensor, dim, op="sum", async_op: bool = False):
    """output (len, ...) <- this rank's slice of the sum over ranks of input (n * len, ...)."""
    if input.shape[0] != output.shape[0] * dim.size:
        raise ValueError(f"reduce_scatter_into: input has {input.shape[0]} rows, expected "
                         f"{dim.size} x {output.shape[0]} over {dim.name}")
    if dim.size == 1:
        output.copy_(input)
        return Done() if async_op else output
    _record("reduce_scatter", dim, input, (dim.size - 1) / dim.size)
    op = _reduce_op(op)
    if op == "avg":
        raise ValueError("reduce_scatter: use op='sum' and scale; gloo has no AVG")
    src = input.contiguous()
    work = run("reduce_scatter", dim,
                lambda: _reduce_scatter_single(output, src, op=op, group=dim.group, async_op=async_op),
                async_op)
    return work if async_op else output


def reduce_scatter(tensor: torch.Tensor, dim, scatter_dim: int = 0) -> torch.Tensor:
    """This rank's chunk (along `scatter_dim`) of the sum of `tensor` over the group."""
    if dim.size == 1:
        return tensor
    if tensor.shape[scatter_dim] % dim.size:
        raise ValueError(f"reduce_scatter: size {tensor.shape[scatter_dim]} of dim {scatter_dim} is not "
                         f"divisible by the {dim.name} group size {dim.size}")
    moved = tensor.movedim(scatter_dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // dim.size,) + tuple(moved.shape[1:]))
    reduce_scatter_into(out, moved, dim)
    return out.movedim(0, scatter_dim)


def all_to_all(output: torch.Tensor, input: torch.Tensor, dim, async_op: bool = False):
    """Slot i of `input` (its dim 0 cut into dim.size equal slots) goes to member i; slot i of
    `output` (same shape) arrives from member i. Ulysses attention turns a sequence split into a head
    split with it (context_parallel/ulysses.py). A size-1 group copies input into output."""
    n = dim.size
    if output.shape != input.shape or input.shape[0] % n:
        raise ValueError(f"all_to_all: input {tuple(input.shape)} and output {tuple(output.shape)} must have "
                         f"one shape, its dim 0 divisible by the {dim.name} group size {n}")
    if n == 1:
        output.copy_(input)
        return Done() if async_op else output
    _record("all_to_all", dim, input, (n - 1) / n)
    src = input.contiguous()
    work = run("all_to_all", dim,
                lambda: dist.all_to_all_single(output, src, group=dim.group, async_op=async_op), async_op)
    return work if async_op else output


def all_to_all_uneven(input: torch.Tensor, dim, input_splits: Sequence[int],
                      output_splits: Sequence[int]) -> torch.Tensor:
    """Rows [sum(input_splits[:i]), +input_splits[i]) of `input` go to member i; the result holds
    output_splits[i] rows from member i, in member order (expert parallelism's token exchange,
    expert_parallel/dispatch.py). Every member must agree: my input_splits[j] is member j's
    output_splits[me]. The ledger counts the rows that leave this rank (its own run stays)."""
    n = dim.size
    if len(input_splits) != n or len(output_splits) != n or sum(input_splits) != input.shape[0]:
        raise ValueError(f"all_to_all_uneven: {len(input_splits)} input and {len(output_splits)} output "
                         f"splits for a {dim.name} group of {n}; the input splits sum to "
                         f"{sum(input_splits)}, the input has {input.shape[0]} rows")
    output = input.new_empty((sum(output_splits),) + tuple(input.shape[1:]))
    if n == 1:
        return output.copy_(input)
    rows = max(input.shape[0], 1)
    _record("all_to_all_uneven", dim, input, (input.shape[0] - input_splits[dim.rank]) / rows)
    src = input.contiguous()
    run("all_to_all_uneven", dim,
         lambda: dist.all_to_all_single(output, src, list(output_splits), list(input_splits),
                                        group=dim.group), False)
    return output


def broadcast(tensor: torch.Tensor, dim, src_group_rank: int = 0):
    """In place, from the member with group rank `src_group_rank`."""
    if dim.size == 1:
        return tensor
    _record("broadcast", dim, tensor, 1.0 if dim.rank == src_group_rank else 0.0)
    run("broadcast", dim,
         lambda: dist.broadcast(tensor, src=dim.ranks[src_group_rank], group=dim.group), False)
    return tensor


def ring_shift(send: Sequence[torch.Tensor], recv: Sequence[torch.Tensor], dim) -> list:
    """Start sending each tensor of `send` to the next rank of the ring and receiving each of
    `recv` from the previous one; returns the works to wait on. On a size-1 ring it copies."""
    if len(send) != len(recv):
        raise ValueError("ring_shift: as many receive buffers as tensors sent")
    if dim.size == 1:
        for s, r in zip(send, recv):
            r.copy_(s)
        return []
    ops = []
    for s, r in zip(send, recv):
        _record("send_recv", dim, s, 1.0)
        ops.append(dist.P2POp(dist.isend, s.contiguous(), dim.next_rank, group=dim.group))
        ops.append(dist.P2POp(dist.irecv, r, dim.prev_rank, group=dim.group))
    works = run("send_recv", dim, lambda: dist.batch_isend_irecv(ops), False)
    return [NamedWork(w, "send_recv", dim) for w in works]


def send_recv(sends: Sequence[tuple], recvs: Sequence[tuple], dim) -> list:
    """Point-to-point between members of `dim`: start every (tensor, peer global rank, tag) of
    `sends` and of `recvs` in one batch_isend_irecv; returns the works to wait on. Sends are
    posted before receives, in the order given, so two ranks that exchange several tensors match
    them in that order even where the backend ignores tags (NCCL). The ledger counts each send."""
    ops = []
    for t, peer, tag in sends:
        _record("send", dim, t, 1.0)
        ops.append(dist.P2POp(dist.isend, t.contiguous(), peer, group=dim.group, tag=tag))
    for t, peer, tag in recvs:
        ops.append(dist.P2POp(dist.irecv, t, peer, group=dim.group, tag=tag))
    if not ops:
        return []
    with span(f"{'send' if sends else 'recv'}:{dim.name}"):   # (a recv is not in the ledger)
        return dist.batch_isend_irecv(ops)


def wait_all(works) -> None:
    """Wait for every work and empty the list: on gloo, waiting twice on a send blocks forever."""
    for w in works:
        w.wait()
    if isinstance(works, list):
        works.clear()


def barrier(dim) -> None:
    """Return once every rank of `dim` has called it. On NCCL the GPU is named: torch 2.4's
    barrier otherwise guesses it (global rank % GPUs), which can pick another process's device."""
    if dim.size == 1:
        return
    kwargs = {}
    if "nccl" in str(dist.get_backend(dim.group)):
        kwargs["device_ids"] = [torch.cuda.current_device()]
    run("barrier", dim, lambda: dist.barrier(group=dim.group, **kwargs), False)
