"""The peak memory of a step: the largest of what is alive at each of its phases, counted from the
code path (model.py has the notation; bytes per rank), for the whole model or one pipeline stage.

A sum of everyone's maximum (the state + the gathered buffers + the activations + every transient)
overcounts what never meets, and a transient counted too small hides the phase where it does meet:
at SmolLM-135M's shape (benchmarks/bench_memory.py) the tied embedding's full-vocabulary gradients
at the end of backward, not the activations, set the peak of a 1-layer model (until their sum, a
third such buffer, was made in place). So the planner walks the step and takes the maximum of these
phases:

    S     params + AdamW states (the persistent state less its gradients: zero_grad sets them to None)
    Gs    the shard (or, without ZeRO-3, the whole) fp32 gradients, Gacc the no_sync accumulators
    R     the gathered root (final norm, lm_head, the embedding when tied); W the gathered window of
          the layers' backward (1 + prefetch units), W1 the `prefetch` units the root's backward
          prefetches; under reshard_after_forward false every unit is gathered all along (R + W)
    A     one micro-batch's activations (activation_bytes.py, as configured), sm its softmax 4 n V/T,
          a what one layer keeps (+ what its recompute brings back)
    H     lm_head's weight gradient, V/T x d in the weights' dtype (the compute dtype under ZeRO-3,
          fp32 without); U the largest decoder unit's flat gradient (its padded elements, same dtype)
    e     the compute dtype's bytes; M micro-batches (earlier ones leave Gs behind, or under no_sync
          Gacc instead, the shard gradients coming with the last backward: "+ g")

    loss forward     S + R + A + n V/T (e + 4)                 + g   the logits and z - max beside the
                                                                     softmax (exp), fp32
    head backward    S + R + W1 + A + H (+ n V/T e, bf16)      + g   lm_head's weight gradient; the
                                                                     logits' gradient is the softmax, in
                                                                     place (and its bf16 copy); untied
                                                                     under ZeRO-3 the root's gradient is
                                                                     then complete: + max(0, H - sm),
                                                                     its concatenation
    layer backward   S + H' + W + A - sm - a + 2 U             + g   the first layer's, when its pieces'
                                                                     gradients are concatenated
                                                                     (unit.py's split); tied,
                                                                     S + R + H + W + A - sm + g as it
                                                                     starts (it gathers its window
                                                                     before the root is freed)
    backward end     the embedding's backward: its dense gradient (V/T x d, torch's embedding
                     backward), with, tied, lm_head's gradient held since the head backward,
                     which takes it in place (tensor_parallel/layers.py's _SummableGrad hands it
                     on as a tensor of its own, not F.linear's transposed view, which autograd
                     cannot add into: it made a third buffer for the sum), and which the root's
                     split then concatenates; untied, that
                     concatenation of the embedding unit's flat gradient E. ZeRO-3 tied:
                     S + Gs - its root shard + H + Rg + U4 (the sum in place, then the root's
                     flat gradient Rg), untied: S + Gs - its shard + 2 E + U4 (U4: the last
                     layer's fp32 reduce-scatter source, still in flight; under bf16 the
                     reduce-scatter's fp32 copy of Rg or E beside it, if more); without ZeRO-3,
                     tied S + Gs + H (the sum becomes the weight's .grad; + H with M > 1, added
                     into it), untied S + Gs
    optimizer        S + Gs + max(4 P_rank, 8 x the largest shard)   AdamW's sqrt / div temporaries:
                     the foreach kernels (CUDA's default) over every shard at once, the per-tensor
                     loop (CPU's) two of the largest shard

A pipeline stage (pipeline.py, `Holds`) has the same phases over its own units (the root empty off
the last stage, the embedding only on the first): the loss's forward and the head's backward on the
last stage only, a "forward" on the others (S + W + A + g: its last forward's window gathered), and
A is every micro-batch its schedule keeps in flight at the worst moment (pipeline_stage.py's replay of
the action list); a backward's end adds what is still in flight after it (earlier micro-batches'
backwards end with later ones' activations alive).

H' is lm_head's gradient where it is still held: tied, to the end of backward (untied under ZeRO-3
it is reduce-scattered right after the head's backward). R is freed once the head is done either way:
the root's post-backward hook, or, tied, once the heads' inputs have their gradients (the embedding's
lookup never reads the weights: shard_manager.py). Megatron-LM's distributed
optimizer (time and memory as that trainer runs them) keeps its fp32 main gradients all along (in S)
and steps with a fused Adam (no temporaries). Not counted: the collectives' own buffers (NCCL needs
none; gloo's all-gather and reduce-scatter copy one unit at a time), DDP's buckets, the allocator's
rounding and fragmentation (`reserve`); except, with Options.reduce_scatter_copies_input (gloo), the
copy where it sets a phase's peak: at the end of backward the root's (tied) or the embedding's flat
gradient G reduce-scatters from a copy into its new shard, S + Gs - shard + 2 G + shard.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from .activation_bytes import kept_per_layer, recompute_peak
from .inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options, param_bytes
from .model import Unit, _padded, shard_size, units


@dataclass(frozen=True)
class Holds:
    """What one rank runs, for `phases`: the whole model (pp 1, `whole`), or one pipeline stage
    (pipeline.py): its ZeRO-3 units (the root first, empty off the last stage), the activations
    alive at its schedule's worst moment (A: every micro-batch it keeps in flight, as configured),
    those still alive when a backward ends (earlier micro-batches' under pp, 0 without), the layer
    whose backward comes first (its global index: the every-n-th policy's) and whether it computes
    lm_head and the loss."""
    units: List[Unit]
    activations: int
    after_backward: int
    first_backward_layer: int
    head: bool

    @classmethod
    def whole(cls, model: ModelShape, layout: Layout, act: Dict[str, int]) -> "Holds":
        return cls(units(model, layout), act["as_configured"], 0, model.num_hidden_layers - 1, True)


def phases(model: ModelShape, layout: Layout, batch: Batch, opts: Options, mem: Dict[str, int],
           act: Dict[str, int], holds: Optional[Holds] = None) -> Dict[str, int]:
    """Bytes alive at each phase of the step (the module docstring); the peak is their max. `act` is
    activation_bytes.activations' per-micro-batch count, `holds` what the rank runs (the whole model
    by default)."""
    holds = holds or Holds.whole(model, layout, act)
    e = DTYPE_BYTES[opts.dtype]
    eg = param_bytes(layout, opts)                          # the dtype autograd's weight gradients have
    V, d, T = model.vocab_size, model.hidden_size, layout.tp
    n = batch.micro(layout) * batch.sequence_len // layout.cp
    us, head_here = holds.units, holds.head
    tied = model.tie_word_embeddings
    trains = not opts.lora_r                                # LoRA's base has no gradient at all
    S = mem["persistent"] - mem["grads"] + mem.get("kept", 0)   # + post-validation's copy (pipeline)
    Gs, Gacc = mem["grads"], mem["accumulated_grads"]
    # Megatron-LM's distributed optimizer (estimate.py's distributed_optimizer_memory) keeps its
    # fp32 main gradients in buffers that live all along, and steps with a fused Adam (no temporaries)
    megatron = opts.distributed_optimizer and not layout.sharded and layout.sizes()["dp_cp"] > 1 and trains
    if megatron:
        S, Gs = S + Gs, 0
    # what earlier micro-batches leave: no_sync's accumulators (the shard gradients come only with
    # the last backward's reduce-scatter), else the gradients summed into so far
    g = Gacc or (Gs if batch.micro_steps(layout) > 1 else 0)
    A = holds.activations
    # what the first layer of backward has freed when it concatenates its gradient: its activations
    # (and what its recompute brought back)
    done = kept_per_layer(act, opts, holds.first_backward_layer) + recompute_peak(act, opts)
    softmax = 4 * n * V // T if head_here else 0
    logits = n * V // T if head_here else 0                 # elements of this rank's logits
    H = V // T * d * eg if trains and head_here else 0
    all_along = not opts.reshard_after_forward or opts.gather_once_per_step   # every unit gathered
    R = W = first = U = in_flight = emb = root_shard = emb_shard = root_grad = 0
    # a bf16 flat gradient is copied to fp32 for its reduce-scatter (grad_reduce.py), beside it
    fp32_copy = (lambda nbytes: nbytes * 4 // eg) if eg != 4 else (lambda nbytes: 0)
    largest_shard = max(u.numel for u in us)
    if layout.sharded:
        padded = [_padded(u.numel, shard_size(u, layout)) for u in us]
        shards = [p // shard_size(u, layout) for u, p in zip(us, padded)]
        R, W, largest_shard = padded[0] * e, mem["gathered"] - padded[0] * e, max(shards)
        layers = [p for u, p in zip(us, padded) if u.kind in ("layer", "experts")]
        layer = max(layers, default=0)
        # the root's pre-backward hook prefetches the first `prefetch` units of the backward order
        # (the last layers'); the window of the layers' backward is W
        first = W if all_along else sum(layers[::-1][:opts.prefetch]) * e
        if trains:
            U, in_flight, root_shard, root_grad = layer * eg, layer * 4, 4 * shards[0], padded[0] * eg
            for u, p, sh in zip(us, padded, shards):
                if u.kind == "embedding":
                    emb, emb_shard = p * eg, 4 * sh
    # what the layers' backward finds still there: lm_head's gradient, tied held for the embedding's,
    # untied in its .grad without ZeRO-3 (the tied root itself is freed once its head is done:
    # shard_manager.py's _head_input_done)
    held = H if tied or not layout.sharded else 0
    # untied, the root's gradient is complete after the final norm's: lm_head's and its concatenation
    head = H if tied or not layout.sharded else max(H, 2 * H - softmax)
    if head_here:
        out = {"loss forward": S + R + (W if all_along else 0) + A + logits * (e + 4) + g,
               "head backward": S + R + first + A + head + (logits * e if e != 4 else 0) + g}
    else:   # a pipeline stage without the head: its last forward, its layers' window gathered
        out = {"forward": S + W + A + g}
    out["layer backward"] = S + held + W + A - softmax - done + 2 * U + g
    if tied and layout.sharded:     # the first layer gathers its window just before the root goes
        out["layer backward"] = max(out["layer backward"], S + R + H + W + A - softmax + g)
    if not trains:
        end = S + Gs
    elif tied and layout.sharded:
        # the root's shard gradient is not there yet; the last layer's is. lm_head's gradient, held
        # since the head's backward, takes the embedding's dense one in place (2 H, layers.py's
        # _SummableGrad); the root's split concatenates the sum into its flat gradient (H + root_grad),
        # which bf16 then copies to fp32 for the reduce-scatter
        end = S + Gs - root_shard + max(H + root_grad, root_grad + fp32_copy(root_grad)) + in_flight
    elif tied:      # the sum, in lm_head's gradient, becomes the weight's .grad (one of Gs), beside it
        # the embedding's dense gradient (and with an earlier .grad to add into, the sum too)
        end = S + Gs + (2 * H if batch.micro_steps(layout) > 1 else H)
    else:           # the embedding unit: its dense gradient and their concatenation (and bf16's copy)
        end = S + Gs - emb_shard + emb + max(emb, fp32_copy(emb)) + in_flight
    if opts.reduce_scatter_copies_input and trains and layout.sharded:   # gloo: G, its copy, the shard
        end = max(end, S + Gs + 2 * (root_grad if tied else emb) + in_flight)
    out["backward end"] = end + Gacc + holds.after_backward
    out["optimizer"] = S + Gs + (max(4 * mem["param_elements"], 8 * largest_shard)
                                 if trains and not megatron else 0)
    return out
