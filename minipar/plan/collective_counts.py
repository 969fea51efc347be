"""The collectives of one optimizer step on one rank, from the shapes alone (model.py has the
notation): what comm.py's ledger records, call by call, and the bytes each puts on the wire.

Collectives per step (op, group) -> calls and buffer bytes as comm.py's ledger records them
(all_reduce: the tensor; all_gather: the output; reduce_scatter: the input; send_recv: the
message; all_to_all: the input), see `collectives`. Attention across cp, per layer and
micro-batch (`cp_attention`; context_parallel/ulysses.py's docstring for the exchanges), with
kv = 2 b f (K / T) s D and f the KV repeat (1 under ring):
    ring  ("send_recv", "cp")          C - 1 K/V hops forward, C - 1 backward (+ C - 1 when the
                                       layer is recomputed), kv e each; C - 1 dK/dV hops, kv x 4
    ulysses ("all_to_all", "cp_ulysses")  q, k, v, out forward, dout, dq, dk, dv backward (+ the
                                       forward four when recomputed): b (H / T) s D e for q-sized,
                                       kv e / 2 for k- and v-sized buffers
    usp   both: the all-to-alls over u, and the ring over "cp_ring" with R - 1 = C / u - 1 hops
    a layer with a dense mask (a sliding window that binds, Gemma 2's capped logits; ModelShape.masked),
          whatever cp_impl, none of those: window_attention.py all-gathers K and V of the whole
          sequence over "cp", 2 b S (K / T) D e (+ again when recomputed), and reduce-scatters dK/dV
          of that size in e backward
Row-parallel biases (attention_bias's o_proj, mlp_bias's down_proj) are (d,) and replicated over tp:
under SP their gradients are summed over tp like a norm's; Qwen2's q/k/v biases are column-parallel
and need no collective.
Packed documents (document ids) are not modelled: the planner has no packing option, so it leaves
out the ids' all-gather over cp_ulysses and their ring hops (b u s and b s int64 per call).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from .activation_bytes import kv_repeat, recomputed_layers, recomputes
from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options, param_bytes
from .model import _padded, gathers, shard_size, units
from .moe import collectives as moe_collectives
from .moe import step_collectives


def collectives(model: ModelShape, layout: Layout, batch: Batch,
                opts: Options) -> Dict[Tuple[str, str], List[int]]:
    """{(op, group): [calls, bytes]} of one optimizer step on one rank, as comm.py's ledger records
    them (size-1 groups never communicate, so never appear)."""
    out: Dict[Tuple[str, str], List[int]] = {}
    sizes = layout.sizes()

    def add(op, group, calls, nbytes):
        if calls and sizes[group] > 1:
            c = out.setdefault((op, group), [0, 0])
            c[0] += calls
            c[1] += calls * nbytes

    m, C, L = model, layout.cp, model.num_hidden_layers
    e = DTYPE_BYTES[opts.dtype]
    M = batch.micro_steps(layout)
    b, s = batch.micro(layout), batch.sequence_len // C
    n, d = b * s, m.hidden_size
    # layers whose forward runs again in backward; torch's checkpoint stops the recompute once the
    # last saved tensor is back (early stop), so the collective after down_proj is not repeated
    ac = recomputed_layers(model, opts, L)
    # the f / g pairs of the layers: attention's in each, the dense MLP's (an MoE has none: moe.py)
    fg, mlp = (L + 1, 0) if m.is_moe else (2 * L + 1, 1)
    # ZeRO-3 gathers parameters in the compute dtype; otherwise fp32 masters (and so fp32 norm grads).
    # The residual stream has the parameters' dtype: autocast (no ZeRO-3) keeps it fp32 and casts
    # only a matmul's output, so a row-parallel output (o_proj, down_proj) is in e, while the
    # embedding's output, the norms' outputs before a column-parallel layer, and their gradients
    # are in pe (pipeline messages carry the compute dtype instead: pipeline_stage.message_bytes)
    pe = param_bytes(layout, opts)
    # LoRA (frozen base): layer 0's input needs no gradient (embedding and norm frozen), so the f
    # before its q/k/v runs no backward, nor (unless attention is adapted) the one before gate/up;
    # under SP the embedding's g runs no backward, nor (unless attention is adapted) layer 0's o_proj's
    lora = opts.lora_r > 0
    attn = any(t in ("q_proj", "k_proj", "v_proj", "o_proj") for t in opts.lora_targets)
    skipped = (2 - attn) if lora else 0
    for micro in range(M):
        act, stream = n * d * e, n * d * pe      # a row-parallel output; the stream and its grads
        rows = fg - 1                            # the g after o_proj (and down_proj) of each layer
        if layout.sp:   # f / g become all-gather / reduce-scatter along the sequence
            # all-gather: the f's forward and recompute, the embedding's g backward (stream); the rows'
            add("all_gather", "tp", fg + (1 + mlp) * ac + 1 - lora, stream)      # g backward (e)
            add("all_gather", "tp", rows - (skipped - lora), act)
            # reduce-scatter: the embedding's g, the f's backward (stream); the rows' g and recompute
            add("reduce_scatter", "tp", 1 + fg - skipped, stream)
            add("reduce_scatter", "tp", rows + ac, act)
            if not lora:
                # the norm weights' grads (they saw n / tp tokens)
                add("all_reduce", "tp", m.replicated_per_layer * L + 1, d * pe)
        else:           # fwd: embedding, o_proj, down_proj; bwd: the f before qkv, gate/up, lm_head
            add("all_reduce", "tp", 1 + fg - skipped, stream)   # embedding's g, the f's backward
            add("all_reduce", "tp", rows + ac, act)             # the rows' g, forward and recompute
        for t in opts.lora_targets:   # the whole pieces' gradients: column A in the input's dtype
            row = t in ("o_proj", "down_proj")                    # (the norm's), row B in e
            a, b_ = model.lora_tensors(1, opts.lora_r, [t])
            add("all_reduce", "tp", L, b_ * e if row else a * pe)
        if m.qk_norm and not lora:   # Qwen3's q / k norms: a tp rank saw its heads only, so summed
            add("all_reduce", "tp", 2 * L, m.head_dim * pe)
        add("all_reduce", "tp", 1, 4 * n)                 # loss: the max of the logits
        add("all_reduce", "tp", 1, 8 * n)                 # loss: sum of exps and the target logit
        cp_attention(add, m, layout, batch, opts, L, ac)
        moe_collectives(add, m, layout, batch, opts, ac)      # the token exchanges, the aux loss
        if layout.sharded:
            synced = opts.sync_each_batch or micro == M - 1      # no_sync: only the last micro-batch
            for u in units(m, layout):
                N = shard_size(u, layout)
                add("all_gather", u.group, gathers(u, opts), _padded(u.numel, N) * e)
                if not lora:                              # a frozen unit is never reduced
                    add("reduce_scatter", u.group, int(synced), _padded(u.numel, N) * 4)
                    add("all_reduce", "dp_replicate", int(synced), _padded(u.numel, N) // N * 4)
    if lora:                                              # the adapters, whole on every dp rank
        ad = model.lora_tensors(layout.tp, opts.lora_r, opts.lora_targets) * L
        for nbytes in bucket_bytes([4 * x for x in ad]):
            add("all_reduce", "dp_cp", 1, nbytes)
    elif not layout.sharded:                              # DDP over dp_cp at the last micro-batch
        for nbytes in ddp_buckets(m, layout):
            add("all_reduce", "dp_cp", 1, nbytes)
    add("all_reduce", "dp_cp", 1, 8)                      # the logged loss (fp64)
    step_collectives(add, m, layout)                      # an MoE's metrics
    add("all_reduce", "tp", 1, 16)                        # the global norm (clipped by, or only logged):
    add("all_reduce", "dp_shard_cp", 1, 8)                # 2 fp64 sums over tp, 1 over the shard group
    return out


def cp_attention(add, model: ModelShape, layout: Layout, batch: Batch, opts: Options, layers: int,
                 recomputed: int, indices: Optional[Sequence[int]] = None) -> None:
    """add(op, group, calls, bytes) the cp collectives of one micro-batch through `layers` decoder
    layers, `recomputed` of which run their forward again in backward (the module docstring); their
    indices in the model (default the first `layers`) say which attend through a dense mask (a
    window that binds, capped logits: ModelShape.masked), whose K/V are all-gathered over cp."""
    T, C = layout.tp, layout.cp
    if C == 1:
        return
    e, u = DTYPE_BYTES[opts.dtype], layout.ulysses_size()
    b, s, D = batch.micro(layout), batch.sequence_len // C, model.head_dim
    masked = [i for i in (range(layers) if indices is None else indices) if model.masked(i, s * C)]
    if masked:   # window_attention.py: K and V of the whole sequence gathered over cp, in e, forward
        again = sum(recomputes(opts, i) for i in masked)         # (and recompute); dK/dV reduce-scattered
        gathered = 2 * b * s * C * (model.num_key_value_heads // T) * D * e
        add("all_gather", "cp", len(masked) + again, gathered)
        add("reduce_scatter", "cp", len(masked), gathered)
        layers, recomputed = layers - len(masked), recomputed - again
    kv = 2 * b * kv_repeat(model, layout) * (model.num_key_value_heads // T) * s * D
    hops = C // u - 1                    # the ring: all of cp (ring), C / u groups (usp), none (ulysses)
    ring = "cp" if layout.cp_impl == "ring" else "cp_ring"
    add("send_recv", ring, hops * (2 * layers + recomputed), kv * e)   # K/V, forward and backward
    add("send_recv", ring, hops * layers, kv * 4)                      # dK/dV, fp32 accumulators
    passes = 2 * layers + recomputed     # forward, backward, the recompute: 4 exchanges each
    q = b * (model.num_attention_heads // T) * s * D * e
    add("all_to_all", "cp_ulysses", 2 * passes, q)                     # q and out (dout and dq)
    add("all_to_all", "cp_ulysses", 2 * passes, kv * e // 2)           # k and v (dk and dv)


def ddp_buckets(model: ModelShape, layout: Layout, bucket_mb: float = 25) -> List[int]:
    """Bytes of each gradient bucket of data_parallel.replicate (reverse order, about 25 MiB of
    gradients), each followed by one 4-byte "used" flag per parameter (summed by the same all-reduce)."""
    emb, layer, head = model.tensors(layout.tp)
    return bucket_bytes([4 * x for x in emb + layer * model.num_hidden_layers + head], bucket_mb)


def bucket_bytes(sizes: List[int], bucket_mb: float = 25) -> List[int]:
    """replicate's buckets over gradients of these byte sizes (registration order), each with its
    4-byte used flags: the whole model (ddp_buckets) or one pipeline stage (pipeline_stage.py)."""
    out, current, count, limit = [], 0, 0, bucket_mb * 2 ** 20
    for nbytes in reversed(sizes):
        if current and current + nbytes > limit:
            out.append(current + 4 * count)
            current, count = 0, 0
        current, count = current + nbytes, count + 1
    return out + ([current + 4 * count] if current else [])


WIRE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0,
        "all_to_all": lambda n: (n - 1) / n,      # keeps its own slot, sends the other n - 1
        "all_to_all_uneven": lambda n: (n - 1) / n}   # balanced routing (moe.py)


def wire_bytes(op: str, group_size: int, nbytes: float) -> float:
    """Bytes a rank puts on the wire for `nbytes` of buffer (ring algorithms, as comm.py)."""
    return WIRE[op](group_size) * nbytes
