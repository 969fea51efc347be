"""What one training step costs a rank, from the shapes alone: memory, collectives, FLOPs.

A pure function of (model shape, layout, batch, dtype; the four inputs are inputs.py's): no
process group, no tensor. Every count follows minipar's code path by path, so tests/test_plan.py
holds it EXACTLY against real forked runs (persistent state, the comm ledger) and within 15 % for
activations.

Notation: d hidden, f intermediate, L layers, H / K query / KV heads, D head_dim, V vocab,
T = tp, C = cp, S = dp_shard, R = dp_replicate, N = S * C (the ZeRO-3 shard group dp_shard_cp),
b micro-batch rows, s = seq / C local tokens per row, n = b * s local tokens, e = bytes of the
compute dtype (4 fp32, 2 bf16), M micro-batches per step.

Persistent state per rank (what lives between steps, after backward):
    parameters  fp32 masters                4 B x P_rank
    gradients   fp32                        4 B x P_rank
    AdamW       exp_avg, exp_avg_sq fp32    8 B x P_rank, + 4 B per tensor (torch's `step` counter)
  P_rank = the TP-local parameters; under ZeRO-3 (S > 1) the sum over units of ceil(P_unit / N),
  each unit's flat buffer padded to a multiple of N, and one tensor per unit.
  With LoRA (adapter: lora) the base keeps its 4 B x P_rank of fp32 weights only, and the adapters,
  A_rank = L x their TP-local elements (whole over dp, inputs.py's lora_tensors), take the 16 B.
  Its collectives (`collectives`): no reduce-scatter of the frozen units, the adapters' all-reduce
  over dp_cp, one tp all-reduce per adapter's whole piece, and fewer backward f/g at layer 0; its
  FLOPs and a pipeline stage's memory and collectives (pipeline_stage.py) are a full fine-tune's.
Gathered (ZeRO-3 only): full unit buffers in the compute dtype: the root (final norm, lm_head) from
  the start of forward into its backward, plus a window of 1 + prefetch units (the embedding, then
  decoder layers) moving through the forward and backward orders. With fsdp.sync_each_batch false
  (no_sync) the unsharded fp32 gradients of every unit are held between micro-batches as well.

Activations: the bytes autograd saves for backward in one micro-batch's forward, counted
storage by storage (what `torch.autograd.graph.saved_tensors_hooks` sees), parameters excluded:
    per layer, no SP:  2 norms x (4nd + 4n + 2 e nd)      fp32 copy of x, rsqrt, x_hat, output
                       attention  e n (2 H + 2 K') D / T + 4 b H s / T   q, k, v, out; fp32 lse
                                  (K' = H: SDPA gets K/V repeated to the query heads; under cp
                                   ring attention keeps K heads and o_proj's input is a copy: + e n H D / T)
                                  ulysses / usp: the same count with K' = f K, f = u / gcd(K / T, u)
                                  the KV repeat: ring_attention saves the head-split q, k, v, out (u s
                                  tokens of H / u heads: the local elements, f times for k and v) and
                                  its lse; the all-to-alls and repeat_interleave save nothing
                       MLP        4 e n f / T                gate, silu(gate), up, product
    under SP the norms see n / T tokens and save their input's gathered copy (e n d) instead
    of their output; with activation checkpointing a layer keeps only its input, and one layer's
    activations come back during its recompute in backward. Selective checkpointing per op
    (models/activation_checkpoint.py) keeps a layer's input and what its matmuls and attention
    output, everything else recomputed (o and down before their reduction, all n tokens under SP):
        e ns d + e n ((2 H + 2 K) D + 2 d + 2 f) / T + 4 b H s / T      (cp counted as without it)
    and selective every n-th layer fully checkpoints layers n-1, 2n-1, ... (`as_configured`: the
    peak of the mode the options name, `kept_per_layer`: what each layer keeps).
    root: ids, cos/sin (2 e n D), final norm, and the vocab-parallel loss's fp32 softmax 4 n V / T.

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
Packed documents (document ids) are not modelled: the planner has no packing option, so it leaves
out the ids' all-gather over cp_ulysses and their ring hops (b u s and b s int64 per call).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from minipar.context_parallel.ulysses import kv_repeats
from models.flops import layers_matmul_weights, matmul_weights, step_flops

from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options
from .moe import collectives as moe_collectives
from .moe import gathered_window, mlp_activations, split_layer, step_collectives


# --------------------------------------------------------------------------------------- memory
@dataclass
class Unit:
    name: str
    numel: int                     # TP-local elements in the flat buffer (before padding)
    tensors: int
    kind: str = "layer"            # "root", "embedding", "layer" or an MoE layer's "experts"
    group: str = "dp_shard_cp"     # its ZeRO-3 shard group (an MoE layer's experts: edp, moe.py)


def units(model: ModelShape, layout: Layout) -> List[Unit]:
    """ZeRO-3 units as the trainer builds them: the root (final norm, lm_head; the embedding too
    when tied to lm_head) first, the embedding, then one per decoder layer."""
    emb, layer, head = model.tensors(layout.tp, layout.ep)
    if model.tie_word_embeddings:
        out = [Unit("<root>", sum(emb) + sum(head), len(emb) + len(head), "root")]
    else:
        out = [Unit("<root>", sum(head), len(head), "root"),
               Unit("model.embed_tokens", sum(emb), len(emb), "embedding")]
    rest, experts = split_layer(model, layer)
    for i in range(model.num_hidden_layers):
        out.append(Unit(f"model.layers.{i}", sum(rest), len(rest)))
        if experts:
            out.append(Unit(f"model.layers.{i}.experts", sum(experts), len(experts), "experts", "edp"))
    return out


def shard_size(u: Unit, layout: Layout) -> int:
    """The ranks a unit is sharded over: dp_shard_cp, or edp for an MoE layer's experts."""
    return layout.sizes()[u.group]


def gathers(u: Unit, opts: Options) -> int:
    """All-gathers of a unit per micro-batch: the root stays gathered from forward into backward
    and an embedding's backward never reads its weight (once each); a layer is gathered for its
    forward and again for its backward (once without reshard_after_forward)."""
    return 1 if u.kind not in ("layer", "experts") or not opts.reshard_after_forward else 2


def _padded(numel: int, n: int) -> int:
    return -(-numel // n) * n


def memory(model: ModelShape, layout: Layout, opts: Options) -> Dict[str, int]:
    """Bytes per rank: persistent params / grads / optimizer, and the gathered ZeRO-3 buffers."""
    e = DTYPE_BYTES[opts.dtype]
    us = units(model, layout)
    accumulated = 0
    if layout.sharded:
        padded = [_padded(u.numel, shard_size(u, layout)) for u in us]
        elems, tensors = sum(p // shard_size(u, layout) for u, p in zip(us, padded)), len(us)
        root, rest = padded[0], padded[1:]
        if not opts.reshard_after_forward:
            gathered = root + sum(rest)
        else:   # the root all along; a module's units (a layer and its experts) + prefetch more
            modules: List[List[int]] = []
            for u, p in zip(us[1:], rest):
                if u.kind == "experts":
                    modules[-1].append(p)
                else:
                    modules.append([p])
            gathered = root + gathered_window(modules, opts.prefetch)
        gathered *= e
        if not opts.sync_each_batch:   # no_sync: unsharded fp32 gradients held between micro-batches
            accumulated = 4 * (root + sum(rest))
    else:
        elems, tensors, gathered = sum(u.numel for u in us), sum(u.tensors for u in us), 0
    if opts.lora_r:     # LoRA: the base (sharded or not) has no gradient or state; the adapters do
        ad = model.lora_tensors(layout.tp, opts.lora_r, opts.lora_targets) * model.num_hidden_layers
        a = sum(ad)
        return dict(params=4 * (elems + a), grads=4 * a, optimizer=8 * a + 4 * len(ad),
                    persistent=4 * elems + 16 * a + 4 * len(ad), gathered=gathered, accumulated_grads=0,
                    param_elements=elems + a)
    return dict(params=4 * elems, grads=4 * elems, optimizer=8 * elems + 4 * tensors,
                persistent=16 * elems + 4 * tensors, gathered=gathered, accumulated_grads=accumulated,
                param_elements=elems)


def activations(model: ModelShape, layout: Layout, batch: Batch, opts: Options) -> Dict[str, int]:
    """Saved-for-backward bytes of one micro-batch (see the module docstring)."""
    m, T, C = model, layout.tp, layout.cp
    e = DTYPE_BYTES[opts.dtype]
    b, s = batch.micro(layout), batch.sequence_len // C
    n, d, D, f = b * s, m.hidden_size, m.head_dim, m.intermediate_size
    H, K = m.num_attention_heads // T, m.num_key_value_heads // T
    ns = n // T if layout.sp else n                     # tokens the norms and residuals see

    def norm(output_saved: bool) -> int:                # fp32 x, rsqrt, x_hat; output or gathered copy
        return 4 * ns * d + 4 * ns + e * ns * d + e * n * d * (1 if output_saved or layout.sp else 0)

    kv_heads = K * kv_repeat(model, layout) if (C > 1 or H == K) else H
    attention = e * n * (2 * H + 2 * kv_heads) * D + 4 * b * H * s + (e * n * H * D if C > 1 else 0)
    mlp = mlp_activations(model, layout, batch, e) if model.is_moe else 4 * e * n * f // T
    layer = 2 * norm(True) + attention + mlp
    root = 8 * n + 2 * e * n * D                        # ids (int64; under tp the local ids), cos, sin
    if T > 1:
        root += n                                       # the mask of ids outside the vocab shard
    root += norm(True) + 4 * n * m.vocab_size // T + 8 * n + 2 * n   # softmax fp32, target, 2 masks
    layer_input = e * ns * d
    selective = layer_input + e * n * ((2 * H + 2 * K) * D + 2 * d + 2 * f // T) + 4 * b * H * s
    L = m.num_hidden_layers
    out = dict(per_layer=layer, root=root, full=L * layer + root, layer_input=layer_input,
               selective_layer=selective, checkpointed=L * layer_input + root,
               checkpointed_peak=L * layer_input + root + layer)
    kept = sum(kept_per_layer(out, opts, i) for i in range(L))
    out.update(as_configured_kept=kept + root, as_configured=kept + root + recompute_peak(out, opts))
    return out


def activations_beside_grads(activation: int, grads: int, micro_steps: int) -> int:
    """What the activations add to the persistent state (which counts the gradient shards) at the
    peak. With one micro-batch per step they never meet the gradients: zero_grad sets every gradient
    to None after the optimizer step, so the forward and the start of backward hold none, and a
    layer's gradient shard appears only once its backward has freed its activations; the peak is
    then the larger of the start of backward (activations, no gradients) and its end (gradients, no
    activations). Accumulating micro-batches hold the earlier ones' gradients: both count.
    (benchmarks/bench_memory.py measures it: at SmolLM-135M's shape the gradients would be 3.4 MiB
    of the 25 per layer.)"""
    if micro_steps > 1:
        return activation
    return max(activation - grads, 0)


def kept_per_layer(act: Dict[str, int], opts: Options, i: int) -> int:
    """Bytes decoder layer i (its index in the model) keeps for backward under the options'
    checkpointing, from activations()' per-layer counts."""
    ac = opts.gradient_checkpointing
    if not ac:
        return act["per_layer"]
    if ac == "selective" and opts.selective_ac_option == "op":
        return act["selective_layer"]
    if ac == "selective" and (i + 1) % opts.selective_ac_option:
        return act["per_layer"]                          # not an n-th layer: keeps everything
    return act["layer_input"]


def recompute_peak(act: Dict[str, int], opts: Options) -> int:
    """What a layer's recompute in backward brings back on top of what it kept: all of its
    activations (full, every n-th), or the ones the op policy did not keep."""
    if not opts.gradient_checkpointing:
        return 0
    if opts.gradient_checkpointing == "selective" and opts.selective_ac_option == "op":
        return act["per_layer"] - act["selective_layer"] + act["layer_input"]
    return act["per_layer"]


def recompute_shares(model: ModelShape, opts: Options) -> Tuple[float, float]:
    """(the share of the layers' matmul and attention work, of their memory-bound work) that runs
    again in backward: full 1 and 1, selective per op 0 and 1 (only the cheap ops), every n-th
    layer the share of layers it checkpoints."""
    ac, L = opts.gradient_checkpointing, model.num_hidden_layers
    if not ac:
        return 0.0, 0.0
    if ac == "selective" and opts.selective_ac_option == "op":
        return 0.0, 1.0
    share = (L // opts.selective_ac_option) / L if ac == "selective" else 1.0
    return share, share


def recomputed_layers(model: ModelShape, opts: Options, layers: int) -> int:
    """Of `layers` decoder layers, how many run (part of) their forward again in backward, and so
    repeat its collectives (the op policy caches no collective: each runs again)."""
    ac = opts.gradient_checkpointing
    if ac == "selective" and opts.selective_ac_option != "op":
        return layers // opts.selective_ac_option
    return layers if ac else 0


# ---------------------------------------------------------------------------------- collectives
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
    # ZeRO-3 gathers parameters in the compute dtype; otherwise fp32 masters (and so fp32 norm grads)
    pe = e if layout.sharded else 4
    # LoRA (frozen base): layer 0's input needs no gradient (embedding and norm frozen), so the f
    # before its q/k/v runs no backward, nor (unless attention is adapted) the one before gate/up;
    # under SP the embedding's g runs no backward, nor (unless attention is adapted) layer 0's o_proj's
    lora = opts.lora_r > 0
    attn = any(t in ("q_proj", "k_proj", "v_proj", "o_proj") for t in opts.lora_targets)
    skipped = (2 - attn) if lora else 0
    for micro in range(M):
        act = n * d * e
        if layout.sp:   # f / g become all-gather / reduce-scatter along the sequence
            add("all_gather", "tp", fg + fg - skipped + (1 + mlp) * ac, act)
            add("reduce_scatter", "tp", fg + fg - skipped + ac, act)
            if not lora:
                add("all_reduce", "tp", 2 * L + 1, d * pe)  # norm weight grads (they saw n / tp tokens)
        else:           # fwd: embedding, o_proj, down_proj; bwd: the f before qkv, gate/up, lm_head
            add("all_reduce", "tp", fg + fg - skipped + ac, act)
        for t in opts.lora_targets:   # the whole pieces' gradients: column A in the input's dtype
            row = t in ("o_proj", "down_proj")                    # (the norm's), row B in e
            a, b_ = model.lora_tensors(1, opts.lora_r, [t])
            add("all_reduce", "tp", L, b_ * e if row else a * pe)
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
    if opts.max_grad_norm:
        add("all_reduce", "tp", 1, 16)                    # the global norm: 2 fp64 sums over tp
        add("all_reduce", "dp_shard_cp", 1, 8)            # and 1 over the shard group
    return out


def kv_repeat(model: ModelShape, layout: Layout) -> int:
    """f, how often Ulysses repeats each KV head of a tp rank (1 under ring): ulysses.py's rule."""
    T = layout.tp
    return kv_repeats(model.num_attention_heads // T, model.num_key_value_heads // T, layout.ulysses_size())


def cp_attention(add, model: ModelShape, layout: Layout, batch: Batch, opts: Options, layers: int,
                 recomputed: int) -> None:
    """add(op, group, calls, bytes) the cp collectives of one micro-batch through `layers` decoder
    layers, `recomputed` of which run their forward again in backward (the module docstring)."""
    T, C = layout.tp, layout.cp
    if C == 1:
        return
    e, u = DTYPE_BYTES[opts.dtype], layout.ulysses_size()
    b, s, D = batch.micro(layout), batch.sequence_len // C, model.head_dim
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


# ---------------------------------------------------------------------------------------- FLOPs
def flops(model: ModelShape, layout: Layout, batch: Batch, opts: Options) -> Dict[str, float]:
    """FLOPs of one step, models/flops.py's count (the one the trainer's `mfu` divides too):
    `model` (6 x matmul weights x tokens + the causal half of attention: what MFU divides),
    `model_full_attention` (attention counted whole, torchtitan's convention), `rank` (executed
    by one rank, + the forward again under activation checkpointing)."""
    m = model
    step = step_flops(m, batch.global_batch_size, batch.sequence_len)
    model_flops = step.causal
    layers_share = (step.matmul * layers_matmul_weights(m) / matmul_weights(m)
                    + step.attention_causal) / model_flops
    again = recompute_shares(model, opts)[0]          # the matmul / attention share that runs again
    rank = model_flops * (1 + again * layers_share / 3) / layout.world
    attn_rank = step.attention_causal * (1 + again / 3) / layout.world
    return dict(model=model_flops, model_full_attention=step.full, rank=rank, attention_rank=attn_rank,
                attention_model=step.attention_causal,
                params=m.num_params())
