"""Context parallelism: the sequence split over cp ranks, attention as ring attention.

    ring_attention.py   the zigzag split, the ring schedule, the forward merge and hand-written backward
    layouts.py          zigzag or contiguous: the sequence split the data, RoPE and the ring share
    block_attention.py  attention of one query block against one key/value block, with its
                        log-sum-exp (the unit of work the ring repeats)

    from minipar.context_parallel import ring_attention, zigzag_shard
"""
from .ring_attention import (LAYOUTS, ring_attention, ring_schedule, schedule_score_elements, zigzag_positions,
                             zigzag_shard, zigzag_unshard)
from .layouts import sequence_positions, shard_sequence

__all__ = ["LAYOUTS", "ring_attention", "ring_schedule", "schedule_score_elements", "sequence_positions",
           "shard_sequence", "zigzag_positions",
           "zigzag_shard", "zigzag_unshard"]
