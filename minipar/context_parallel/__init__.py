"""Context parallelism: the sequence split over cp ranks, attention as ring attention.

    ring_attention.py   the ring schedule, the forward merge and hand-written backward
    layouts.py          zigzag or contiguous: the sequence split the data, RoPE and the ring share
                        (zigzag_shard, zigzag_unshard, zigzag_positions)
    block_attention.py  the reference math of one query block against one key/value block: out,
                        log-sum-exp, and the six-step flash-attention backward (the unit of work
                        the ring repeats), with causal and document masks
    fused_attention.py  which kernel attends a block: torch's fused kernels (their aten schemas
                        checked before use) or the reference math; document masks classified

    from minipar.context_parallel import ring_attention, zigzag_shard
"""
from .layouts import sequence_positions, shard_sequence, zigzag_positions, zigzag_shard, zigzag_unshard
from .ring_attention import ring_attention, ring_schedule, schedule_score_elements

__all__ = ["ring_attention", "ring_schedule", "schedule_score_elements", "sequence_positions",
           "shard_sequence", "zigzag_positions",
           "zigzag_shard", "zigzag_unshard"]
