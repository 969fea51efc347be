"""One STAGE of a pp x (dp_replicate, dp_shard, cp, tp) layout: what its ranks hold, keep in flight and send.

With pp > 1 every rank holds one stage (pipeline_parallel/stage.py's split_layers rule, imported,
not re-derived): a contiguous run of layers per model chunk (v chunks per rank under
interleaving), the embedding on the first stage, the final norm + lm_head + loss on the last.
Inside a stage the layout is the 4D one of model.py; replay_stage answers, per stage (long_step.py
the same for a step of many micro-batches, from three short ones):

    kept         pipeline_overlap_steps with clipping: post-validation's copy of the persistent state
                 (parameters, gradients, AdamW's m, v, step), alive through the whole next step
    persistent   16 B x the stage's parameters (+ 4 B per tensor / unit): as model.py, over the
                 stage's tensors; under ZeRO-3 its units: <root> = norm + lm_head on the last stage
                 (EMPTY elsewhere: an empty unit never gathers), the embedding on the first, then
                 one per layer of the stage in chunk order. Tied with the ends apart, the last stage
                 holds a copy of E (tied_ends.py): its root is E alone, its norm a unit after the layers
    gathered     ZeRO-3's buffers, from a replay of zero3's hooks (zero3_replay.py) over the
                 schedule's action list: the root is re-gathered at every chunk forward, prefetch
                 follows the learned order, which alternates between chunks under interleaving
    accumulated  compose.py keeps ZeRO-3 / DDP in no_sync until the rank's last backward:
                 with m > 1 every unit's unsharded fp32 gradient is held (as fsdp.sync_each_batch
                 false), and each unit reduce-scatters ONCE per step
    activations  per micro-batch, the chunk's layers (activation_bytes.py's per-layer bytes) + cos/sin per
                 chunk + ids on the first stage + norm/softmax on the last + in bf16 the received h
                 on the others (kept for its gradient; `received` below), times what is in flight:
                 counted from the action list (the peak of live (chunk, micro) pairs, each weighted
                 by its chunk's bytes): AFAB m, 1F1B min(m, p - stage), interleaved what it holds;
                 under zb_h1 / zbv (split_backward.py) B frees a chunk's activations but each
                 Linear's input x and output gradient dy, which W frees (`w_bytes` below)

Communication per stage, as comm.py's ledger records it: ("send", "pp") one message per F on a
non-last virtual stage (h forward) and per B on a non-first one (dL/dh backward), when the
neighbouring virtual stage is on another rank (zbv's turn at rank p - 1 is not: schedules.sends_to), each
b x s/cp (/tp under SP) x d in the compute dtype (bf16 in a bf16 run, autocast's too: trainer.py's
act_dtype, which p2p.py sends); ("all_reduce", "pp") 8 B
for the loss and 8 B for the global grad norm (pipeline_overlap_steps: both in one 16 B all-reduce
over the world); tied embeddings with the ends on two ranks: ("all_reduce", "pp_ends") of E's
fp32 gradient (its shard under ZeRO-3) on the first and last stage (stage_units.py's tied_sum);
TP/CP per layer of the stage, the embedding's
collective on the first stage, lm_head's and the loss's on the last, each in the dtype
collective_counts.py gives it (under autocast the stream's f / g fp32, o_proj's and down_proj's g bf16).

pipeline.py puts the stages together: the worst stage's memory, the slowest stage's time, the bubble.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from minipar.optim_bnb import state_bytes
from minipar.pipeline_parallel.schedules import chunk_stages, schedule_order, sends_to, stage_owners
from minipar.pipeline_parallel.simulate import peak_in_flight

from . import activation_bytes as pa
from . import collective_counts as pc
from . import model as pm
from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options, param_bytes
from .model import Unit
from .stage_units import Stage, chunk_units, stage_tensors, stage_units, tied_sum
from .zero3_replay import Zero3Replay


@dataclass(frozen=True)
class Pipeline:
    """The pipeline dimension of a layout (the 4D Layout of model.py is one stage's grid)."""
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    layers: Optional[Tuple[int, ...]] = None       # pipeline_layers: an explicit split
    overlap_steps: bool = False                    # pipeline_overlap_steps: stages never meet at a step end
    post_validation: bool = False                  # ... with clipping: each update kept, checked a step late

    @classmethod
    def from_sizes(cls, sizes: dict) -> "Pipeline":
        """The pipeline of a config's sizes (pp > 1; minipar/trainer/prediction.py's from_train_config):
        post-validation where its stages step alone with clipping on."""
        layers, overlap = sizes.get("pipeline_layers"), bool(sizes["pipeline_overlap_steps"])
        return cls(sizes["pp"], sizes["pipeline_schedule"], sizes["virtual_stages"],
                   tuple(layers) if layers else None, overlap, bool(overlap and sizes["max_grad_norm"]))

    def __str__(self) -> str:
        v = f", v {self.virtual_stages}" if self.virtual_stages > 1 else ""
        alone = (", steps overlapped" + (", post-validated" if self.post_validation else "")) \
            if self.overlap_steps else ""
        return f"pp {self.pp} ({self.schedule}{v}{alone})"


def _replay_step(replay: Zero3Replay, order, us: List[Unit], st: Stage):
    """One step of the schedule's actions through ZeRO-3's hooks."""
    chunks = [chunk_units(us, st, c) for c in range(len(st.chunks))]
    for a in order:
        if a.kind == "W":          # a W pass reaches the flat buffers only: it gathers nothing
            continue
        seq = chunks[a.chunk]
        if a.kind == "F":
            replay.forward(seq)
            continue
        # the backward reaches the units in the order their hooks sit on the chunk's output: the
        # loss is the root's own output (root first); h is the last layer's output too, whose hook
        # was registered before the root's (that layer first, then the root)
        head = st.last and a.chunk == len(st.chunks) - 1
        back = seq[:0:-1]
        replay.backward([seq[0]] + back if head else back[:1] + [seq[0]] + back[1:], head)


def replay_stage(model: ModelShape, layout: Layout, pipe: Pipeline, st: Stage, batch: Batch,
                 opts: Options) -> dict:
    """Memory, activations and ledger of one stage (one rank of it: all its ranks are alike), by
    the full replay of the step's action list (long_step.plan_stage: the same for a long step
    from three short ones)."""
    T, C, e = layout.tp, layout.cp, DTYPE_BYTES[opts.dtype]
    pe = param_bytes(layout, opts)               # the residual stream's dtype: fp32 under autocast
    M, b = batch.micro_steps(layout), batch.micro(layout)
    order = schedule_order(pipe.schedule, pipe.pp, M, st.rank, pipe.virtual_stages)
    coll: Dict[Tuple[str, str], List[int]] = {}
    sizes = dict(layout.sizes(), pp=pipe.pp, world=layout.world * pipe.pp, pp_ends=2)

    def add(op, group, calls, nbytes):
        if calls and sizes[group] > 1:
            c = coll.setdefault((op, group), [0, 0])
            c[0] += calls
            c[1] += calls * nbytes

    # ---- persistent state and ZeRO-3
    us = stage_units(model, layout, st)
    gathered = accumulated = 0
    if layout.sharded:
        N = layout.dp_shard * C
        padded = {u.name: pm._padded(u.numel, N) for u in us}
        numels = [padded[u.name] // N for u in us if u.numel]         # a flat shard per unit
        elems = sum(numels)
        replay = Zero3Replay(us, {k: v * e for k, v in padded.items()}, opts.prefetch,
                              opts.reshard_after_forward)
        _replay_step(replay, order, us, st)
        calls = dict(replay.calls)                  # the ledger: step 1, from the static order
        _replay_step(replay, order, us, st)         # the peak: over two steps, as the test measures
        gathered = replay.peak
        for u in us:
            add("all_gather", "dp_shard_cp", calls[u.name], padded[u.name] * e)
            if u.numel:            # once per step: the rank's last backward (compose.py)
                add("reduce_scatter", "dp_shard_cp", 1, padded[u.name] * 4)
                add("all_reduce", "dp_replicate", 1, padded[u.name] // N * 4)
        if M > 1:
            accumulated = 4 * sum(padded.values())
    else:
        tens = numels = stage_tensors(model, layout, st)
        elems = sum(tens)
        if layout.sizes()["dp_cp"] > 1:                      # DDP once per step
            for nbytes in pc.bucket_bytes([4 * x for x in tens]):
                add("all_reduce", "dp_cp", 1, nbytes)
    add("all_reduce", "pp_ends", *tied_sum(model, layout, st, opts))     # a tied embedding's two copies
    opt = state_bytes(opts.optimizer, numels)
    mem = dict(params=4 * elems, grads=4 * elems, optimizer=opt, persistent=8 * elems + opt,
               gathered=gathered, accumulated_grads=accumulated, param_elements=elems)
    # post-validation (pipeline_parallel/post_validate.py) keeps a copy of all of it, parameters, gradients
    # and AdamW's state, from one update until it is checked in the next step
    mem["kept"] = mem["persistent"] if pipe.overlap_steps and pipe.post_validation else 0

    # ---- activations: per (chunk, micro-batch), weighted by what the schedule keeps alive
    act = pa.activations(model, layout, batch, opts)
    n, D = b * (batch.sequence_len // C), model.head_dim
    ids = 8 * n + (n if T > 1 else 0)
    rope = 2 * pa.stream_bytes(layout, opts) * n * D * pa.rope_tables(model)
    head = act["root"] - ids - rope                         # final norm, softmax, targets, masks
    full_ac = dataclasses.replace(opts, gradient_checkpointing=True)

    # the executor keeps a received h for its gradient: in bf16 beside autocast's fp32 stream, or under
    # ZeRO-3 the stream itself, which a chunk's first layer saves only as its checkpointed input (its
    # norm keeps an fp32 copy); in fp32 the tensor that norm saves, counted with the layers
    bf16 = opts.dtype == "bfloat16" and not opts.distributed_optimizer
    held = message_bytes(model, layout, batch, opts) if bf16 else 0

    def received(c: int, checkpointed, how: Options) -> int:
        kept = layout.sharded and checkpointed and any(pa.recomputes(how, i) for i in st.chunks[c][:1])
        return 0 if kept else held

    def chunk_bytes(c: int, checkpointed, how: Options = full_ac) -> int:
        extra = (rope + (ids if st.first and c == 0 else received(c, checkpointed, how))
                 + (head if st.last and c == len(st.chunks) - 1 else 0))
        return extra + sum(pa.kept_per_layer(act, how, i) if checkpointed else act["layers"][i]
                           for i in st.chunks[c])

    # zb_h1 / zbv: what each Linear keeps from B to W, its input x and output gradient dy, per
    # layer: x of q/k/v and gate/up (n d each, gathered under SP), of o (H hd / T) and down (f / T);
    # dy of q/k/v ((H + 2 KV) hd / T), o and down (d each, before the tp reduction), gate/up (f / T)
    d, f, hd = model.hidden_size, model.intermediate_size, model.head_dim
    x_layer = e * n * (2 * d + model.num_attention_heads * hd // T + f // T)
    qkv = (model.num_attention_heads + 2 * model.num_key_value_heads) * hd // T
    dy_layer = e * n * (qkv + 2 * d + 2 * f // T)

    def w_bytes(c: int) -> Tuple[int, int]:
        """(x, dy) bytes chunk c keeps for W: its layers', and lm_head's on the last chunk."""
        lm = st.last and c == len(st.chunks) - 1
        return (len(st.chunks[c]) * x_layer + (e * n * d if lm else 0),
                len(st.chunks[c]) * dy_layer + (e * n * model.vocab_size // T if lm else 0))

    split = any(a.kind == "W" for a in order)

    def in_flight(checkpointed, how: Options = full_ac, after_backward: bool = False) -> int:
        """The peak of live bytes over the step, or (after_backward) the most left as a B ends."""
        live = peak = after = 0
        for a in order:
            x, dy = w_bytes(a.chunk) if split else (0, 0)
            if a.kind == "F":
                live += chunk_bytes(a.chunk, checkpointed, how)
            elif a.kind == "B":        # frees what autograd saved but x (or keeps the recomputed x), adds dy
                live += x + dy - chunk_bytes(a.chunk, checkpointed, how)
                after = max(after, live)
            else:                      # W frees x and dy
                live -= x + dy
            peak = max(peak, live)
        return after if after_backward else peak

    per_micro = sum(chunk_bytes(c, False) for c in range(len(st.chunks)))
    acts = dict(per_micro=per_micro,
                per_micro_checkpointed=sum(chunk_bytes(c, True) for c in range(len(st.chunks))),
                full=in_flight(False), checkpointed=in_flight(True),
                checkpointed_peak=in_flight(True) + act["per_layer"],
                as_configured=in_flight(True, opts) + pa.recompute_peak(act, opts),
                after_backward=in_flight(True, opts, after_backward=True),
                in_flight=peak_in_flight(order))

    # ---- TP / CP inside the stage, per micro-batch
    L, fst, lst = st.num_layers, int(st.first), int(st.last)
    acL = pa.recomputed_layers(model, opts, L)
    for _ in range(M):   # dtypes as collective_counts.py: the stream's pe, o_proj's and down_proj's e
        h, stream = n * model.hidden_size * e, n * model.hidden_size * pe
        if layout.sp:    # the f's (qkv, gate/up, lm_head) forward and recompute, the embedding's g
            add("all_gather", "tp", 2 * L + fst + lst + 2 * acL, stream)    # backward; the rows' g
            add("all_gather", "tp", 2 * L, h)                               # backward
            add("reduce_scatter", "tp", 2 * L + fst + lst, stream)   # the embedding's g, the f's backward
            add("reduce_scatter", "tp", 2 * L + acL, h)
            # the replicated (d,) weights' gradients (norms, row-parallel biases: collective_counts.py)
            add("all_reduce", "tp", model.replicated_per_layer * L + lst, model.hidden_size * pe)
        else:   # the embedding's g, the f's backward (stream); the rows' g, forward and recompute
            add("all_reduce", "tp", 2 * L + fst + lst, stream)
            add("all_reduce", "tp", 2 * L + acL, h)
        add("all_reduce", "tp", lst, 4 * n)
        add("all_reduce", "tp", lst, 8 * n)
        if model.qk_norm:     # Qwen3's q / k norms: a tp rank saw its heads only (collective_counts.py)
            add("all_reduce", "tp", 2 * L, model.head_dim * pe)
        pc.cp_attention(add, model, layout, batch, opts, L, acL,     # ring hops and/or all-to-alls;
                        [i for c in st.chunks for i in c])           # a masked layer's K/V all-gather

    # ---- the pipeline's own messages, and the step's small reductions
    msg = message_bytes(model, layout, batch, opts)
    owner = stage_owners(pipe.schedule, pipe.pp, pipe.virtual_stages)     # p2p.py's own rule
    mine = chunk_stages(pipe.schedule, pipe.pp, st.rank, pipe.virtual_stages)
    add("send", "pp", sum(sends_to(a, mine, owner) is not None for a in order), msg)
    add("all_reduce", "dp_cp", 1, 8)                       # the loss over dp_cp, then over pp
    add("all_reduce", "tp", 1, 16)                         # the global norm (clipped by, or only logged)
    add("all_reduce", "dp_shard_cp", 1, 8)
    if pipe.overlap_steps:                                 # loss and squared norm: one sum over the world
        add("all_reduce", "world", 1, 16)                  # in the background (overlap_steps.py)
    else:
        add("all_reduce", "pp", 2, 8)
    return dict(rank=st.rank, layers=[list(c) for c in st.chunks], first=st.first, last=st.last,
                memory=mem, activations=acts, collectives=coll)


def message_bytes(model: ModelShape, layout: Layout, batch: Batch, opts: Options) -> int:
    """Bytes of one p2p message: h (b, s/cp [/tp under SP], d), in minipar's compute dtype (the
    distributed_optimizer mode's, another trainer's, in its stream's dtype, as before)."""
    s = batch.sequence_len // layout.cp // (layout.tp if layout.sp else 1)
    bf16 = opts.dtype == "bfloat16" and (layout.sharded or not opts.distributed_optimizer)
    e = 2 if bf16 else 4
    return batch.micro(layout) * s * model.hidden_size * e

