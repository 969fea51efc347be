"""What a rank holds of a checkpoint, as SEGMENTS, and the full tensors rebuilt from them and cut
again for any other layout: the resharding under save_load.py.

A rank's tensors are a list of segments: contiguous runs of the TP-local flat view of a named
(HF) parameter. A plain or TP parameter is one segment covering it; a ZeRO-3 flat shard (this
rank's [start, stop) of a unit's padded flat buffer, see zero3/unit.py) is one segment per tensor
it overlaps:

    unit flat buffer   [ q (tp-local, 32) | norm (8) | k (16) | pad 4 ]   offsets 0, 32, 40, 56
    shard of rank 1          [15 ............. 30)                       (dp_shard_cp = 4: 15 each)
    its segment        q[15:30] -> shard[0:15]            (+ tp rank, tp size, tp_split_dim, shapes)

The same segments place the parameter and every optimizer state shaped like it (AdamW's exp_avg
and exp_avg_sq; `step` is a scalar; bitsandbytes' 8-bit states as the same fp32 moments,
optim.portable_state), so one mechanism moves all of them:

    _local_records        per local tensor: its segments, CPU copies of it and of its states
    merge_records         the records of every shard file -> {kind: {name: FULL tensor}}
                          (concatenated over tp along tp_split_dim; a gap means a missing file)
    local_from_full       FULL tensors by name -> this rank's local tensors, any layout: saved on
                          2x2x2, resumed on 4x1x2 or on one process, with or without ZeRO-3
    full_optimizer_state  the FULL optimizer states gathered as the model gathers its weights

Communication: none, except in _gather_full and full_optimizer_state (FULL_STATE_DICT's gathers:
over tp, and over dp_shard_cp under ZeRO-3, an all-gather of the model's size per state kind).
An MoE expert weight (E, ...) is split over ep as well (each segment says its ep block), so the
full tensor is its blocks concatenated over ep, and a checkpoint of one ep loads on any other.
The scheme is torch.distributed.checkpoint's (local shards with their global placement, resharded
at load) in miniature.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch

from minipar.expert_parallel.sharding import ep_gather, ep_shard
from minipar.optim import portable_state
from minipar.tensor_parallel import gather_tensor, shard_tensor
from minipar.zero3 import ShardedStateDicts


@dataclasses.dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of the TP-local flat view of `name` sit at [offset, offset + stop -
    start) of the flat view of a rank's local tensor."""
    name: str
    tp_rank: int
    tp_size: int
    split_dim: Optional[int]
    local_shape: Tuple[int, ...]
    full_shape: Tuple[int, ...]
    start: int
    stop: int
    offset: int
    # an MoE expert weight is split over ep too (expert_parallel/sharding.py): its local tensor is
    # block ep_rank of ep_size along ep_split_dim of the TP-local one (defaults: checkpoints before ep)
    ep_rank: int = 0
    ep_size: int = 1
    ep_split_dim: Optional[int] = None


# ------------------------------------------------------------------------------ the layout
def _tensors(model, pgm):
    """(local tensor, its segments, [(name, full shape)] of the tensors whose states it carries)
    for every tensor the optimizer sees. A ZeRO-3 shard is stepped as a whole, so it carries every
    tensor of its unit; its segments come from the manager's sharded state dict (ShardedStateDicts):
    each tensor's offset in the padded flat buffer, intersected with this rank's [start, stop). Only trained
    tensors: a frozen base (LoRA's) is rebuilt from its source (the seed, base_model), so a LoRA
    checkpoint holds the adapters and their optimizer states; under ZeRO-3 those adapters are plain
    parameters outside the flat buffers, whole on every rank of dp_shard_cp."""
    manager = getattr(model, "zero3", None)
    plain = [(n, p) for n, p in model.named_parameters()
             if p.requires_grad and not getattr(p, "zero3_shard", False)]
    if manager is None:
        yield from _plain(plain, pgm)
        return
    sd = ShardedStateDicts(manager).sharded_state_dict()
    for shard, unit in zip(manager.shards, sd["units"].values()):   # both: the non-empty units, in order
        if not shard.requires_grad:
            continue
        start, stop, segments = unit["start"], unit["stop"], []
        for t in unit["params"]:
            a, b = max(t["offset"], start), min(t["offset"] + t["numel"], stop)
            if b > a:
                ep = {} if t.get("ep_split_dim") is None else \
                    dict(ep_rank=unit["ep_rank"], ep_size=unit["ep_size"], ep_split_dim=t["ep_split_dim"])
                segments.append(Segment(t["name"], sd["tp_rank"], sd["tp_size"], t["tp_split_dim"],
                                        tuple(t["local_shape"]), tuple(t["full_shape"]),
                                        a - t["offset"], b - t["offset"], a - start, **ep))
        yield shard, segments, [(t["name"], tuple(t["full_shape"])) for t in unit["params"]]
    yield from _plain(plain, pgm)


def _plain(named, pgm):
    """A plain (or TP) parameter: one segment covering it (an expert's also says its ep block)."""
    for name, p in named:
        full = tuple(getattr(p, "tp_full_shape", None) or p.shape)
        ep_dim = getattr(p, "ep_split_dim", None)
        ep = {} if ep_dim is None else dict(ep_rank=pgm.ep.rank, ep_size=pgm.ep.size, ep_split_dim=ep_dim)
        seg = Segment(name, pgm.tp.rank, pgm.tp.size, getattr(p, "tp_split_dim", None), tuple(p.shape),
                      full, 0, p.numel(), 0, **ep)
        yield p, [seg], [(name, full)]


def layout(model, pgm) -> List[Tuple[torch.nn.Parameter, List[Segment]]]:
    """(local tensor, its segments) for every tensor the optimizer sees."""
    return [(p, segments) for p, segments, _ in _tensors(model, pgm)]


def _param_shapes(model, pgm) -> Dict[str, list]:
    """{name: full shape} of every parameter, not only of those this rank's shards touch. A
    pipeline stage holds some layers only, but describes the whole model (its layers' names carry
    their global index), so a checkpoint of any pp size loads on any other."""
    whole = getattr(model, "full_param_shapes", None)
    if whole is not None:
        return {n: list(shape) for n, shape in whole.items()}
    return {n: list(shape) for _, _, carried in _tensors(model, pgm) for n, shape in carried}


# ----------------------------------------------------------------------- full <-> local tensors
def local_from_full(model, pgm, full: Dict[str, torch.Tensor], source: str = "checkpoint") -> dict:
    """{local tensor: values shaped like it} cut from full tensors by HF name for this rank's layout
    (plain, TP and ZeRO-3 flat shards alike; padding is zero). No communication."""
    out = {}
    for p, segments in layout(model, pgm):
        flat = torch.zeros(p.numel(), dtype=p.dtype)
        for s in segments:
            if s.name not in full:
                raise ValueError(f"{source} has no tensor {s.name!r}, which this model needs")
            t = full[s.name]
            if tuple(t.shape) != s.full_shape:
                raise ValueError(f"{source}: {s.name} has shape {tuple(t.shape)}, this model expects "
                                 f"{s.full_shape}: the checkpoint is of another model shape")
            local = ep_shard(shard_tensor(t, s.split_dim, pgm.tp), s.ep_split_dim, pgm.ep).reshape(-1)
            flat[s.offset:s.offset + s.stop - s.start] = local[s.start:s.stop]
        out[p] = flat.view(p.shape)
    return out


def _elementwise(v, p) -> bool:
    return torch.is_tensor(v) and v.dim() > 0 and v.numel() == p.numel()


def host_clone(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` that later in-place updates of `t` cannot reach (a CPU tensor is cloned)."""
    return t.detach().cpu().clone()


def _local_records(model, optimizer, pgm, to_host=host_clone) -> list:
    """Per local tensor: its segments, the CPU tensors shaped like it (param, optimizer states)
    and the scalar states. `to_host`: how a tensor reaches the host (async_save.py's into pinned
    memory without waiting for each copy)."""
    state, records = portable_state(optimizer) if optimizer is not None else {}, []
    # under ZeRO-3 only dp_shard_cp rank 0 writes the plain (whole, replicated) tensors: LoRA's adapters
    whole_here = getattr(model, "zero3", None) is None or pgm.dp_shard_cp.rank == 0
    for p, segments in layout(model, pgm):
        if not (whole_here or getattr(p, "zero3_shard", False)):
            continue
        st = state.get(p, {})
        tensors = {"param": to_host(p)}
        tensors.update({k: to_host(v).view(p.shape)
                        for k, v in st.items() if _elementwise(v, p)})
        scalars = {k: float(v) for k, v in st.items() if not _elementwise(v, p)}
        segments = [dataclasses.asdict(s) for s in segments]
        records.append(dict(segments=segments, tensors=tensors, scalars=scalars))
    return records


def merge_records(records: list, source: str) -> Tuple[Dict[str, dict], Dict[str, dict]]:
    """({kind: {name: full tensor}}, {name: scalars}) from the records of all shard files; refuses
    files that do not cover every element (a rank's file missing)."""
    bufs: Dict[tuple, list] = {}      # (kind, name, tp_rank, ep_rank) -> [local flat tensor, covered mask]
    meta: Dict[str, Segment] = {}
    scalars: Dict[str, dict] = {}
    for rec in records:
        for d in rec["segments"]:
            s = Segment(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
            if s.split_dim is None and s.tp_rank != 0:
                continue              # replicated over tp: tp rank 0's copy is the one
            meta.setdefault(s.name, s)
            if rec["scalars"]:
                scalars.setdefault(s.name, rec["scalars"])
            for kind, t in rec["tensors"].items():
                key = (kind, s.name, s.tp_rank, s.ep_rank)
                if key not in bufs:
                    n = int(torch.Size(s.local_shape).numel())
                    bufs[key] = [torch.zeros(n, dtype=t.dtype), torch.zeros(n, dtype=torch.bool)]
                bufs[key][0][s.start:s.stop] = t.reshape(-1)[s.offset:s.offset + s.stop - s.start]
                bufs[key][1][s.start:s.stop] = True
    full: Dict[str, Dict[str, torch.Tensor]] = {}
    for kind in sorted({k for k, _, _, _ in bufs}):
        for name, s in meta.items():
            ranks = range(s.tp_size if s.split_dim is not None else 1)
            blocks = range(s.ep_size if s.ep_split_dim is not None else 1)
            keys = [[(kind, name, r, e) for r in ranks] for e in blocks]
            if not any(k in bufs for row in keys for k in row):
                continue              # no optimizer state for this tensor (never stepped)
            for k in (k for row in keys for k in row):
                if k not in bufs or not bufs[k][1].all():
                    raise ValueError(f"{source}: the shard files do not cover all of {kind} of {name} "
                                     f"(tp rank {k[2]}, ep rank {k[3]}): a rank's file is missing from "
                                     f"the checkpoint")
            # concatenated over tp (along split_dim), then the experts' blocks over ep
            parts = [_cat([bufs[k][0].view(s.local_shape) for k in row], s.split_dim) for row in keys]
            full.setdefault(kind, {})[name] = _cat(parts, s.ep_split_dim)
    return full, scalars


def _cat(parts: list, dim: Optional[int]) -> torch.Tensor:
    return torch.cat(parts, dim) if dim is not None else parts[0]


def _gather_full(model, pgm, local: dict) -> Dict[str, torch.Tensor]:
    """{name: full tensor} from tensors shaped like the local ones, gathered as the model gathers
    its weights (over tp, and over dp_shard_cp under ZeRO-3). Collective."""
    manager = getattr(model, "zero3", None)
    if manager is not None:                  # each to the host as it is gathered, in model order
        items = ShardedStateDicts(manager).iter_full([local[s] for s in manager.shards])
        full = {n: t.cpu() for n, t in items}
        return {n: full[n] for n in manager.param_names}
    return {n: ep_gather(gather_tensor(local[p].contiguous(), getattr(p, "tp_split_dim", None), pgm.tp),
                         getattr(p, "ep_split_dim", None), pgm.ep).cpu().clone()
            for n, p in model.named_parameters()}


def full_optimizer_state(model, optimizer, pgm) -> Tuple[Dict[str, dict], Dict[str, dict]]:
    """({state kind: {name: full tensor}}, {name: scalar states}) on every rank. Collective."""
    params, state = [p for p, _ in layout(model, pgm)], portable_state(optimizer)
    kinds = sorted({k for p in params for k, v in state.get(p, {}).items() if _elementwise(v, p)})
    full = {k: _gather_full(model, pgm, {p: state.get(p, {}).get(k, torch.zeros_like(p)) for p in params})
            for k in kinds}
    scalars = {}
    for p, _, carried in _tensors(model, pgm):
        sc = {k: float(v) for k, v in state.get(p, {}).items() if not _elementwise(v, p)}
        scalars.update({n: sc for n, _ in carried if sc})
    return full, scalars
