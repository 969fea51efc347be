"""ZeRO-3 / FSDP: parameters, gradients and optimizer states sharded over dp_shard_cp.

    flat_param.py     the flat buffer of a unit: which slot holds which parameter, padding, shards
    shard_manager.py  the hooks that gather a unit before its forward and backward, prefetch the
                      next one, free it after, and reduce-scatter its gradients

    from minipar.zero3 import fully_shard
    fully_shard(model, pgm, unit_classes=(LlamaDecoderLayer,), prefetch=1)
"""
from .flat_param import FlatLayout, ShardedStateDicts, plan_units
from .shard_manager import Unit, Zero3, fully_shard

__all__ = ["FlatLayout", "ShardedStateDicts", "plan_units", "Unit", "Zero3", "fully_shard"]
