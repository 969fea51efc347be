"""A pipeline stage: the part of the decoder that one rank of pgm.pp holds and runs.

The L decoder layers are cut into n = pp x v contiguous runs, one per VIRTUAL stage (v model
chunks per rank, v = 1 except for the interleaved schedule). The rule, as Megatron's and
torchtitan's even split, with the remainder going to the earliest stages (the last stage also
runs the final norm, the lm_head and the loss, the widest matmul of a small model):

    virtual stage k of n gets  L // n + (1 if k < L % n else 0)  layers, in order
    pipeline_layers: [a, b, ...]   an explicit split instead (n numbers, each >= 1, summing to L)

    L = 8, pp = 2:              stage 0: layers 0-3 + embed_tokens | stage 1: layers 4-7 + norm, lm_head
    L = 8, pp = 2, v = 2:       rank 0: chunk 0 = layers 0-1 (+ embed_tokens), chunk 1 = layers 4-5
                                rank 1: chunk 0 = layers 2-3, chunk 1 = layers 6-7 (+ norm, lm_head)
    (virtual stage k = chunk k // pp of rank k % pp: a micro-batch visits rank 0, 1, 0, 1)
    L = 8, pp = 2, zbv:         rank 0: chunk 0 = layers 0-1 (+ embed_tokens), chunk 1 = layers 6-7
                                (+ norm, lm_head); rank 1: chunk 0 = layers 2-3, chunk 1 = layers 4-5
    (the V: chunk 0 of rank r is virtual stage r, chunk 1 is 2 pp - 1 - r: rank 0, 1, 1, 0)

Under a zero-bubble schedule (zb_h1, zbv) build_stage also gives the stage's Linear layers one
WeightGradStore (split_backward.py), `stage.weight_grads`, so the executor can run B and W apart.

The stage is built from the whole LlamaForCausalLM (so its weights are the seeded ones of every
other layout) by dropping what other stages hold. The layers it keeps sit in an nn.ModuleDict keyed
by their GLOBAL index, so its parameter names are the Hugging Face names of the whole model
(model.layers.6.mlp.up_proj.weight on rank 1 above): checkpoints and exports need no renaming,
and a checkpoint saved on one pp size loads on any other, or on none. ZeRO-3, DDP, TP and CP see
a stage as just a smaller model: its units shard over its own dp_shard_cp, its TP/CP groups are
its own (mesh.py puts pp outermost, so every other group lies inside one stage).

What crosses stages is the residual stream h, (micro_batch, sequence_len / cp, hidden) per rank
(sequence / cp / tp under sequence parallelism), forward, and its gradient, backward (p2p.py).
Every stage reads the same micro-batch from the sampler, so position_ids (for RoPE), document_ids
(packed examples) and labels never travel: the first stage embeds the input ids, the last one
computes the loss.
"""
from __future__ import annotations

import json
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from .. import comm, default_device
from ..tensor_parallel.layers import gather_tensor
from ..zero3.state_dicts import ShardedStateDicts
from .p2p_plan import exchange_plan, forward_plan
from .schedules import SPLIT_BACKWARD, chunk_stages, schedule_order, stage_owners
from .side_vectors import NoSide, SideVectors
from .split_backward import split_weight_gradients
from .tied_ends import TIED, holds_copy, untie_matmul, zero3_units


def split_layers(num_layers: int, num_stages: int,
                 pipeline_layers: Optional[List[int]] = None) -> List[List[int]]:
    """The global layer indices of each virtual stage (see the rule above). Raises a ValueError
    naming the values when the split cannot work; no communication."""
    if pipeline_layers is not None:
        counts = list(pipeline_layers)
        if len(counts) != num_stages or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                                            for c in counts):
            raise ValueError(f"pipeline_layers={counts} must list {num_stages} positive layer counts, "
                             f"one per (virtual) stage "
                             f"(pipeline_parallel_size x pipeline_virtual_stages = {num_stages})")
        if sum(counts) != num_layers:
            raise ValueError(f"pipeline_layers={counts} sums to {sum(counts)}, but the model has "
                             f"num_hidden_layers={num_layers}: the counts must add up to {num_layers}")
    else:
        if num_layers < num_stages:
            raise ValueError(f"num_hidden_layers={num_layers} cannot be split over {num_stages} "
                             f"(virtual) pipeline "
                             f"stages: every stage needs at least one layer; use pipeline_parallel_size (x "
                             f"pipeline_virtual_stages) <= {num_layers}, or more layers")
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if k < extra else 0) for k in range(num_stages)]
    out, first = [], 0
    for c in counts:
        out.append(list(range(first, first + c)))
        first += c
    return out


def stage_chunks(num_layers: int, pp_size: int, pp_rank: int, virtual_stages: int = 1,
                 pipeline_layers: Optional[List[int]] = None, schedule: str = "1f1b") -> List[List[int]]:
    """The layers of each model chunk of rank `pp_rank`: chunk j is virtual stage j * pp + rank (the
    V of zbv: rank, then 2 pp - 1 - rank; schedules.chunk_stages)."""
    split = split_layers(num_layers, pp_size * virtual_stages, pipeline_layers)
    return [split[k] for k in chunk_stages(schedule, pp_size, pp_rank, virtual_stages)]


def _autocast(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:                                   # torch < 2.4: one flag per device kind
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


class PipelineStage(nn.Module):
    """One rank's stage of a LlamaForCausalLM: forward(x, position_ids, labels, num_items_in_batch,
    chunk) runs model chunk `chunk` on x (input ids on the first virtual stage, the residual stream
    h otherwise) and returns h, or on the last virtual stage the loss (sum of token losses /
    num_items_in_batch)."""

    def __init__(self, model: nn.Module, pgm, chunks: List[List[int]], schedule: str = "1f1b"):
        super().__init__()
        self.config, self.pgm, self.chunks = model.config, pgm, [list(c) for c in chunks]
        self.schedule = schedule                 # what the chunks are placed for (p2p plans its sends by it)
        self.num_chunks = len(chunks)
        p = pgm.pp.size
        # the virtual stage of each chunk of this rank, and the pp rank holding each virtual stage
        # (what the sends address): the loop j * pp + rank, or the V of zbv
        self.virtual = chunk_stages(schedule, p, pgm.pp.rank, self.num_chunks)
        self.num_virtual = p * self.num_chunks
        self.owner = stage_owners(schedule, p, self.num_chunks)
        # whether this rank holds the embedding (virtual stage 0) / the norm, lm_head and loss (the last)
        self.is_first, self.is_last = 0 in self.virtual, self.num_virtual - 1 in self.virtual
        self.weight_grads = None                 # a WeightGradStore under zb_h1 / zbv (build_stage)
        # the whole model's names and full shapes: what a checkpoint of any stage must describe
        # (the trained ones: a frozen base, LoRA's, comes back from its source, not a checkpoint)
        self.full_param_shapes: Dict[str, list] = {
            n: list(getattr(p, "tp_full_shape", None) or p.shape) for n, p in model.named_parameters()
            if p.requires_grad}
        body = model.model
        kept = [i for c in chunks for i in c]
        body.layers = nn.ModuleDict({str(i): body.layers[i] for i in kept})
        if not self.is_first and not holds_copy(self.config, self.is_first, self.is_last):
            body.embed_tokens = None             # (a tied last stage keeps it: tied_ends.py)
        if not self.is_last:
            body.norm = None
        self.model = body
        # the residual stream is split along the sequence over tp (what p2p.activation_shape sends)
        self.sequence_parallel = body.sequence_parallel
        self.lm_head = model.lm_head if self.is_last else None
        self.gradient_checkpointing = getattr(model, "gradient_checkpointing", False)
        # the model's ZeRO-3 units, for fully_shard (+ a tied last stage's final norm: tied_ends.py)
        self.zero3_unit_classes = zero3_units(self, model.zero3_unit_classes)
        # what the model's loss needs carried between stages besides h (an MoE's aux loss; None:
        # nothing): the executor passes its vectors on, the model computes them
        self.pipeline_aux = model.pipeline_aux

    def gradient_checkpointing_enable(self):
        self.gradient_checkpointing = True

    def is_first_virtual(self, chunk: int) -> bool:
        return self.virtual[chunk] == 0

    def is_last_virtual(self, chunk: int) -> bool:
        return self.virtual[chunk] == self.num_virtual - 1

    def forward(self, x, position_ids, labels=None, num_items_in_batch=None, chunk: int = 0,
                document_ids=None):
        # the decoder's own pieces (LlamaModel.embed, rotary, run_layers, head_loss): one forward,
        # cut at chunk boundaries, not a copy of it
        body = self.model
        h = body.embed(x) if self.is_first_virtual(chunk) else x
        if not self.is_first_virtual(chunk) and _autocast(h.device.type):
            h = h.float()       # bf16 on the link; under autocast the stream is fp32, as in one model
        cos, sin = body.rotary(position_ids, h.dtype)
        h = body.run_layers(h, cos, sin, self.chunk_layers(chunk), document_ids, self.gradient_checkpointing)
        if not self.is_last_virtual(chunk):
            return h
        return body.head_loss(h, self.lm_head, labels, num_items_in_batch)

    def chunk_layers(self, chunk: int) -> list:
        """The decoder layers of model chunk `chunk`, in order."""
        return [self.model.layers[str(i)] for i in self.chunks[chunk]]

    # ------------------------------------------------------------------ what the executor is handed
    def exchange_plan(self, order: list, num_micro: int) -> list:
        """This rank's exchanges (p2p_plan.py) for `order`, which must be this stage's schedule's."""
        p, v, rank = self.pgm.pp.size, self.num_chunks, self.pgm.pp.rank
        if list(order) != schedule_order(self.schedule, p, num_micro, rank, v):
            raise ValueError(f"run_schedule: this order is not {self.schedule}'s for pp {p}, m {num_micro}: "
                             f"pass plan=p2p_plan.plan_exchanges(<every rank's order>, ...)[rank]")
        return exchange_plan(self.schedule, p, num_micro, v, rank, side=self.pipeline_aux is not None)

    def forward_plan(self, num_micro: int = 1) -> list:
        """This rank's exchanges of num_micro micro-batches forward only, pipelined (an evaluation)."""
        return forward_plan(self.schedule, self.pgm.pp.size, self.num_chunks, self.pgm.pp.rank, num_micro)

    def side_vectors(self, link, wait, weight: float, device):
        """The mover of this step's side vectors over `link` (side_vectors.py), or NoSide when the
        model's loss needs only h."""
        return NoSide() if self.pipeline_aux is None else SideVectors(self, link, wait, weight, device)

    # ------------------------------------------------------------------ whole-model state dicts
    def full_state_dict(self) -> dict:
        """{HF name: full CPU tensor} of the WHOLE model on every rank: each stage gathers its own
        (over tp, and its ZeRO-3 shards), then the stages hand theirs over pgm.pp. Collective."""
        out = {n: t.cpu() for n, t in self.full_state_items()}
        return {n: out[n] for n in _hf_order(out)}

    def full_state_items(self, meter=None):
        """The whole model one (HF name, full tensor) at a time, on every rank: stage by stage, each
        tensor gathered by its stage and broadcast over pgm.pp as it is handed out
        (stream_over_stages). Collective: every rank must take every item. `meter`: an accounting
        hook (models/hf_shards.py HeldBytes) shown every tensor made."""
        return stream_over_stages(self._own_full_items(meter), self.pgm, meter)

    def _own_full_items(self, meter):
        skip = TIED if holds_copy(self.config, self.is_first, self.is_last) else None   # (the first's)
        if getattr(self, "zero3", None) is not None:
            items = ShardedStateDicts(self.zero3).iter_full([s.detach() for s in self.zero3.shards], meter)
            yield from ((n, t) for n, t in items if n != skip)
            return
        for n, p in ((n, p) for n, p in self.named_parameters() if n != skip):
            t = gather_tensor(p.detach(), p.tp_split_dim, self.pgm.tp)
            t = t.clone() if t.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() else t
            if meter is not None:
                meter.track(t)
            yield n, t
            del t


def gather_over_stages(mine: dict, pgm) -> dict:
    """Merge the {name: CPU tensor or JSON value} dicts of all stages of pgm.pp (each stage holds
    other names); every rank gets the union, in the whole model's order. Item by item
    (stream_over_stages)."""
    if pgm.pp.size == 1:
        return mine
    out = {n: t.cpu() if torch.is_tensor(t) else t for n, t in stream_over_stages(iter(mine.items()), pgm)}
    return {n: out[n] for n in _hf_order(out)}


def stream_over_stages(mine, pgm, meter=None):
    """Every stage's (name, tensor) items on every rank of pgm.pp, one tensor at a time: the stages
    take turns (stage 0's items first); a stage broadcasts each of its items over pgm.pp as it is
    taken from `mine`, its name, shape and dtype first (a JSON header in a uint8 tensor, after its
    length), then the tensor itself; an empty header ends the stage's turn. A value that is not a
    tensor (a dict of optimizer scalars) travels in its header, as JSON. Nothing is pickled and
    no rank ever holds more than the tensor in flight (the stage's own gathers aside). Tensors travel
    on minipar.default_device() (CUDA under NCCL) and are yielded there. Collective over pp: every
    rank must take every item. Cost: 3 broadcasts per tensor (its bytes once over the wire)."""
    if pgm.pp.size == 1:
        yield from mine
        return
    device = default_device()
    for stage in range(pgm.pp.size):
        if stage == pgm.pp.rank:
            for name, t in mine:
                if not torch.is_tensor(t):       # plain values (optimizer scalars) ride in the header
                    _header(pgm, stage, device, dict(name=name, value=t))
                    yield name, t
                    continue
                t = t.detach().to(device).contiguous()
                _header(pgm, stage, device, dict(name=name, shape=list(t.shape), dtype=str(t.dtype)[6:]))
                comm.broadcast(t, pgm.pp, stage)
                yield name, t
                del t
            _header(pgm, stage, device, None)
            continue
        while True:
            head = _header(pgm, stage, device)
            if head is None:
                break
            if "value" in head:
                yield head["name"], head["value"]
                continue
            t = torch.empty(head["shape"], dtype=getattr(torch, head["dtype"]), device=device)
            comm.broadcast(t, pgm.pp, stage)
            if meter is not None:
                meter.track(t)
            yield head["name"], t
            del t


def _header(pgm, stage: int, device, head=None):
    """Broadcast one item's header (a dict, or None for the end of a stage) from pp rank `stage`;
    returns it on every rank."""
    sending = pgm.pp.rank == stage
    data = json.dumps(head).encode() if sending and head is not None else b""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    comm.broadcast(length, pgm.pp, stage)
    if int(length) == 0:
        return None
    buf = (torch.tensor(list(data), dtype=torch.uint8, device=device) if sending
           else torch.empty(int(length), dtype=torch.uint8, device=device))
    comm.broadcast(buf, pgm.pp, stage)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def _hf_order(names):
    """embed_tokens, layers in numeric order, norm, lm_head: the order of the whole model."""
    def key(n):
        parts = n.split(".")
        if n.startswith("model.embed_tokens"):
            return (0, 0, n)
        if n.startswith("model.layers."):
            return (1, int(parts[2]), n)
        if n.startswith("model.norm"):
            return (2, 0, n)
        return (3, 0, n)
    return sorted(names, key=key)


def build_stage(model: nn.Module, pgm, virtual_stages: int = 1,
                pipeline_layers: Optional[List[int]] = None, schedule: str = "1f1b") -> PipelineStage:
    """This rank's PipelineStage of a freshly built LlamaForCausalLM (call before fully_shard /
    replicate and before the optimizer, which must only see the stage's parameters), its chunks
    placed as `schedule` runs them, its Linears' backward split when the schedule has W actions."""
    chunks = stage_chunks(model.config.num_hidden_layers, pgm.pp.size, pgm.pp.rank, virtual_stages,
                          pipeline_layers, schedule)
    stage = PipelineStage(model, pgm, chunks, schedule)
    if schedule in SPLIT_BACKWARD:                 # (a tied lm_head's matmul split too: tied_ends.py)
        stage.weight_grads = split_weight_gradients(untie_matmul(stage))
    return stage
