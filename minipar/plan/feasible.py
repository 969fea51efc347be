"""Whether a layout can run the model at all: the trainer's own checks, asked of the planner's
question (inputs.py's ModelShape, Layout, Batch) before anything is counted, so that a plan is only
made for a layout that runs. layout_search.py drops a candidate that fails them; estimate.py's plan
refuses one with a ValueError that lists them.

    check(model, layout, batch) -> [why not, ...]     empty when the layout runs
      tp divides num_attention_heads, num_key_value_heads, vocab_size, intermediate_size
                                  (column-parallel q/k/v and gate/up, the vocab-parallel embedding)
      2 cp divides sequence_len   (the zigzag layout: 2 cp chunks, two per cp rank)
      tp divides sequence_len / cp under sequence parallelism (the stream split along the sequence)
      ulysses / usp: the heads split over the Ulysses group u (the trainer's check_ulysses itself,
                                  minipar/context_parallel/ulysses.py, not a copy of it; u from
                                  ParallelismConfig.ulysses_size, which refuses a u not dividing cp)
      dp x micro_batch_size divides global_batch_size
      expert_problems: ep divides dp_shard x cp and the experts (ParallelismConfig.expert_problems,
                                  the trainer's own); what the planner does not count yet
                                  (dense layers between MoE layers)

Each problem is one line that names the values, as the trainer's ValueErrors do. Pure data: no
process group, no tensor, no communication.
"""
from __future__ import annotations

from typing import List

from minipar.config import ParallelismConfig
from minipar.context_parallel.ulysses import check_ulysses

from .inputs import Batch, Layout, ModelShape


def check(model: ModelShape, layout: Layout, batch: Batch) -> List[str]:
    """Why this layout cannot run (empty when it can): the trainer's own checks."""
    T, C, m = layout.tp, layout.cp, model
    out = [f"tp {T} does not divide {what} {v}" for what, v in
           (("num_attention_heads", m.num_attention_heads), ("num_key_value_heads", m.num_key_value_heads),
            ("vocab_size", m.vocab_size), ("intermediate_size", m.intermediate_size)) if v % T]
    if batch.sequence_len % (2 * C):
        out.append(f"sequence_len {batch.sequence_len} is not divisible by 2 x cp = {2 * C}")
    elif layout.sp and (batch.sequence_len // C) % T:
        out.append(f"sequence parallelism needs sequence_len / cp = {batch.sequence_len // C} divisible "
                   f"by tp {T}")
    heads_by_tp = m.num_attention_heads % T == 0 and m.num_key_value_heads % T == 0   # said above if not
    if C > 1 and layout.cp_impl != "ring" and heads_by_tp:
        try:
            out += check_ulysses(m.num_attention_heads, m.num_key_value_heads, T, C, layout.ulysses_size())
        except ValueError as err:         # u that ParallelismConfig refuses (not a divisor of cp)
            out.append(str(err))
    out += expert_problems(model, layout)
    dp = layout.dp_replicate * layout.dp_shard
    if batch.global_batch_size % (dp * batch.micro(layout)):
        out.append(f"global_batch_size {batch.global_batch_size} is not a multiple of dp {dp} x "
                   f"micro_batch_size {batch.micro(layout)}")
    return out


def expert_problems(model: ModelShape, layout: Layout) -> List[str]:
    """The trainer's expert-parallel checks (ep divides dp_shard x cp and E), and what the planner
    does not count yet: a model with dense layers between its MoE layers."""
    ep = layout.ep
    out = ParallelismConfig(dp_shard_size=layout.dp_shard, cp_size=layout.cp, ep_size=ep).expert_problems()
    if not model.is_moe:
        return out + ([f"ep {ep} needs a mixture-of-experts model (num_local_experts > 0)"] if ep > 1 else [])
    if model.num_local_experts % ep:
        out.append(f"ep {ep} does not divide the {model.num_local_experts} experts of each MoE layer")
    if len(model.moe_layers) != model.num_hidden_layers:
        out.append(f"the planner counts MoE models whose every layer is MoE; this one has dense layers "
                   f"{sorted(set(range(model.num_hidden_layers)) - set(model.moe_layers))} "
                   f"(mlp_only_layers / decoder_sparse_step): not planned yet")
    return out
