"""What DPO's reference costs beside the step it plans (rl: dpo; docs/dpo.md), from the step's own
compute counts (time_model.compute_seconds) of a batch whose rows are the pairs' 2 rows each:

    lora          the base with the adapters off: one more forward per micro-batch, no backward, its
                  activations freed at once (no memory beyond the step's peak). Each of the M
                  micro-batches runs the L layers' forward (layer_forward_s) and the lm_head's
                  matmul again: reference_s, added to the step's time. Under ZeRO-3 the forward's
                  all-gathers run again too (not counted: they hide behind the layers' compute
                  as the step's do)
    precomputed   one forward pass over the data before step 1, with the same per-batch cost:
                  reference_pass_s_per_batch (the pass takes pairs / global_batch_size of them),
                  nothing during training; 2 floats per pair kept on the host of every rank
                  (reference_host_bytes_per_pair, 8)

Pure arithmetic: no process group, no tensor.
"""
from __future__ import annotations

from minipar.plan.inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options
from minipar.plan.time_model import gemm_seconds

REFERENCES = ("lora", "precomputed")


def forward_seconds(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster,
                    parts: dict) -> float:
    """One forward of a step's rows (M micro-batches through every layer and lm_head), no backward."""
    M = batch.micro_steps(layout)
    rows = batch.micro(layout) * batch.sequence_len / layout.cp
    head = gemm_seconds(rows, model.hidden_size, model.vocab_size / layout.tp, DTYPE_BYTES[opts.dtype],
                        cluster)
    return M * (model.num_hidden_layers * parts["layer_forward_s"] + head)


def reference_cost(model: ModelShape, layout: Layout, batch: Batch, opts: Options, cluster,
                   parts: dict) -> dict:
    """{reference_s: seconds added to each step} (lora) or the precomputed pass's figures; {} without rl."""
    if not opts.dpo_reference:
        return {}
    if opts.dpo_reference not in REFERENCES:
        raise ValueError(f"dpo_reference {opts.dpo_reference!r} is not one of {list(REFERENCES)}")
    fwd = forward_seconds(model, layout, batch, opts, cluster, parts)
    if opts.dpo_reference == "lora":
        return dict(reference_s=fwd)
    return dict(reference_s=0.0, reference_pass_s_per_batch=fwd, reference_host_bytes_per_pair=8)
