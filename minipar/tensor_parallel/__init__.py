"""Tensor parallelism (Megatron-LM): weight matrices, heads and the vocabulary split over tp.

    parallelize.py          the plan applied to a plain decoder from outside: which module becomes
                            which tp layer, what each costs (picotron's apply_tensor_parallel)
    mappings.py             Megatron's f/g conjugate functions, the sequence-parallel pairs
    layers.py               Column/RowParallelLinear, VocabParallelEmbedding, the shard layout;
                            sequence_parallel_off, the plain-TP mode for generation's steps
    async_linear.py         the column-parallel backward with its input-gradient collective
                            overlapped with the weight-gradient matmul (tp_async_overlap)
    vocab_parallel_loss.py  cross-entropy over logits whose vocabulary is split across tp

    from minipar import tensor_parallel as tpl
    tpl.parallelize(model, pgm.tp, sequence_parallel=True)        # a plain decoder's layers swapped
    tpl.ColumnParallelLinear(hidden, 3 * hidden, pgm.tp), tpl.vocab_parallel_cross_entropy(...)
"""
from .async_linear import AsyncColumnParallelLinear, async_column_parallel
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel_group,
    gather_tensor,
    sequence_parallel_off,
    shard_tensor,
)
from .mappings import (
    SEQ_DIM,
    CopyToTPRegion,
    GatherFromSequenceParallelRegion,
    GatherFromTPRegion,
    ReduceFromTPRegion,
    ReduceScatterToSequenceParallelRegion,
    ScatterToTPRegion,
    copy_to_tp_region,
    enter_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    sequence_parallel_weight,
)
from .parallelize import parallelize
from .vocab_parallel_loss import vocab_parallel_cross_entropy

__all__ = ["AsyncColumnParallelLinear", "async_column_parallel", "SEQ_DIM", "CopyToTPRegion",
           "GatherFromSequenceParallelRegion", "GatherFromTPRegion", "ReduceFromTPRegion",
           "ReduceScatterToSequenceParallelRegion", "ScatterToTPRegion", "copy_to_tp_region",
           "enter_tp_region",
           "gather_from_sequence_parallel_region", "gather_from_tp_region", "reduce_from_tp_region",
           "reduce_scatter_to_sequence_parallel_region", "scatter_to_tp_region", "sequence_parallel_weight",
           "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "column_parallel_group",
           "gather_tensor", "parallelize", "sequence_parallel_off", "shard_tensor",
           "vocab_parallel_cross_entropy"]
