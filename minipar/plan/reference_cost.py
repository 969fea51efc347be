"""What DPO's reference costs beside the step it plans (rl: dpo; docs/dpo.md, minipar/dpo_reference.py),
from the step's own compute counts (time_model.compute_seconds) of a batch whose rows are the pairs'
2 rows each. M micro-batches per step, L layers, P_rank this rank's parameter elements (its ZeRO-3
shards, or its tp / pp slice):

    lora          the base with the adapters off: one more forward per micro-batch, no backward, its
                  activations freed at once (no memory beyond the step's peak). Each of the M
                  micro-batches runs the L layers' forward (layer_forward_s) and the lm_head's
                  matmul again (+ an MoE's expert matmuls and the forward's share of its ep token
                  exchanges): reference_s, added to the step's time. Under ZeRO-3 the forward's
                  all-gathers run again too (reference_gather_bytes; not in reference_s: they hide
                  behind the layers' compute as the step's do, overlap.py)
    frozen        a frozen copy of the weights (compose.build(frozen=True)): the same forward per
                  micro-batch as lora, its own ZeRO-3 gathers, and the copy itself in memory all
                  along: reference_bytes = P_rank x 4 (x 2 when ZeRO-3 shards it under bf16), added
                  to the persistent state, hence to every phase of peak.py. Its gathered window while
                  it runs is not added: between steps the policy's units are all freed, so the
                  copy's window (the same units, in the compute dtype) replaces the policy's, and its
                  no-grad activations are less than the training forward's
    precomputed   one forward pass over the data before step 1, with the same per-batch cost:
                  reference_pass_s_per_batch (the pass takes pairs / global_batch_size of them),
                  nothing during training; 2 floats per pair kept on the host of every rank
                  (reference_host_bytes_per_pair, 8)

Under pipeline parallelism (pipeline.py) the reference's forwards of the step's M micro-batches go
down the pipeline together (the pipeline's forward_only over the list, the forward half of AFAB):
stage s runs micro-batch m while stage s + 1 runs m - 1, so they take simulate.forward_span(M)
stage forwards (M + p - 1; (M v + p - 1) / v interleaved), each a stage's share of the model's
forward (1/p of it), plus the forward half of the step's critical sends (M v + p - 1 messages):
`pipelined(one_s, n)`, the time of n items of one_s whole-model seconds each. One micro-batch at a
time it was M p stage forwards (M whole-model forwards) plus M (p - 1) sends. The precomputed pass
sends pipeline_parallel's forward_window(p) batches down together: each batch pipelined(fwd, W) / W.

Pure arithmetic: no process group, no tensor.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

from minipar.plan.activation_bytes import recompute_shares
from minipar.plan.inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options
from minipar.plan.model import _padded, shard_size, units
from minipar.plan.moe import matmul_seconds
from minipar.plan.time_model import gemm_seconds

REFERENCES = ("lora", "precomputed", "frozen")


def forward_seconds(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster,
                    parts: dict, groups: Optional[Dict[str, dict]] = None) -> float:
    """One forward of a step's rows (M micro-batches through every layer and lm_head), no backward;
    for an MoE + its expert matmuls' forward share and its ep exchanges' (a forward's two of the
    step's 2 + recomputed all-to-all pairs)."""
    M = batch.micro_steps(layout)
    e = DTYPE_BYTES[opts.dtype]
    rows = batch.micro(layout) * batch.sequence_len / layout.cp
    head = gemm_seconds(rows, model.hidden_size, model.vocab_size / layout.tp, e, cluster)
    out = M * (model.num_hidden_layers * parts["layer_forward_s"] + head)
    if model.is_moe:
        out += matmul_seconds(model, layout, batch, opts, lambda m, k, n: gemm_seconds(m, k, n, e, cluster),
                              0.0) / 3
        ep = (groups or {}).get("ep", {}).get("seconds", 0.0)
        out += ep / (2 + recompute_shares(model, opts)[0])
    return out


def reference_bytes(mem: dict, layout: Layout, opts: Options) -> int:
    """Bytes per rank of the frozen copy (0 for another reference): this rank's parameter elements
    (mem["param_elements"], model.memory's) in fp32, or bf16 when ZeRO-3 shards them under bf16."""
    if opts.dpo_reference != "frozen":
        return 0
    per = 2 if layout.sharded and opts.dtype == "bfloat16" else 4
    return per * mem["param_elements"]


def with_reference(mem: dict, layout: Layout, opts: Options) -> dict:
    """mem with the frozen copy's bytes as `reference` and in `persistent` (so in every phase)."""
    if opts.dpo_reference == "frozen" and opts.lora_r:
        raise ValueError("dpo_reference 'frozen' with LoRA: the adapters-off base is the reference "
                         "(dpo_reference 'lora'); a frozen copy is a full fine-tune's")
    b = reference_bytes(mem, layout, opts)
    return dict(mem, reference=b, persistent=mem["persistent"] + b) if b else mem


def gather_bytes(model: ModelShape, layout: Layout, batch: Batch, opts: Options, us=None) -> float:
    """What the reference's forwards all-gather per step under ZeRO-3: every unit (`us`: a pipeline
    stage's; the whole model's by default) once per micro-batch, in the compute dtype (0 without
    ZeRO-3)."""
    if not layout.sharded:
        return 0.0
    e = DTYPE_BYTES[opts.dtype]
    return batch.micro_steps(layout) * sum(_padded(u.numel, shard_size(u, layout)) * e
                                           for u in (us if us is not None else units(model, layout)))


def reference_cost(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster,
                   parts: dict, groups: Optional[Dict[str, dict]] = None, us=None,
                   pipelined: Optional[Callable[[float, int], float]] = None, window: int = 1) -> dict:
    """{reference_s: seconds added to each step, ...} (lora, frozen) or the precomputed pass's
    figures; {} without rl. us: a pipeline stage's units (the gathers); pipelined(one_s, n): under pp,
    the seconds of n items of one_s whole-model forward seconds each down the pipeline (the module
    docstring; None: one process, n one_s); window: the precomputed pass's batches sent together."""
    if not opts.dpo_reference:
        return {}
    if opts.dpo_reference not in REFERENCES:
        raise ValueError(f"dpo_reference {opts.dpo_reference!r} is not one of {list(REFERENCES)}")
    fwd, M = forward_seconds(model, layout, batch, opts, cluster, parts, groups), batch.micro_steps(layout)
    if opts.dpo_reference == "precomputed":
        per_batch = fwd if pipelined is None else pipelined(fwd, window) / window
        return dict(reference_s=0.0, reference_pass_s_per_batch=per_batch, reference_host_bytes_per_pair=8)
    step = fwd if pipelined is None else pipelined(fwd / M, M)
    return dict(reference_s=step, reference_gather_bytes=gather_bytes(model, layout, batch, opts, us))
