"""ZeRO-3 / FSDP: parameters, gradients and optimizer states sharded over dp_shard_cp.

    flat_param.py     the flat buffer of a unit: which slot holds which parameter, padding, shards
    unit.py           one unit: its flat buffer, this rank's fp32 shard, the all-gather and the free
    shard_manager.py  the hooks that gather a unit before its forward and backward, prefetch the
                      next one, free it after
    grad_reduce.py    reduce-scatter of each unit's gradient, or (no_sync) unsharded accumulation

    from minipar.zero3 import fully_shard
    fully_shard(model, pgm, unit_classes=(VocabParallelEmbedding, LlamaDecoderLayer), prefetch=1)
    with model.zero3.no_sync():       # accumulate without communicating (or set_requires_gradient_sync)
        model(micro_batch_1).backward()
    model(micro_batch_2).backward()   # one reduce-scatter of the sum
"""
from .flat_param import FlatLayout, ShardedStateDicts, plan_units
from .shard_manager import Unit, Zero3, fully_shard

__all__ = ["FlatLayout", "ShardedStateDicts", "plan_units", "Unit", "Zero3", "fully_shard"]
