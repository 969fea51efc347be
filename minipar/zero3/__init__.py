"""ZeRO-3 / FSDP: parameters, gradients and optimizer states sharded over dp_shard_cp (and, HSDP,
replicated over dp_replicate). The files in reading order:

    wrap.py           what a step does and costs; fully_shard: the model cut into units (plan_units,
                      which parameters go into which unit), its parameters replaced by flat shards
                      (a meta model filled unit by unit), the Zero3 manager attached
    unit.py           one unit: its flat buffer (FlatLayout: which slot holds which parameter,
                      padding, shards), this rank's fp32 shard, the all-gather and the free
    shard_manager.py  Zero3: the hooks that gather a unit before its forward and backward,
                      prefetch the next one, free it after; GatherPolicy, which units each hook
                      gathers and frees, and the learned orders: pure, so the planner replays it
    grad_reduce.py    GradientReduction: reduce-scatter of each unit's gradient (+ HSDP all-reduce),
                      or (no_sync) unsharded accumulation
    state_dicts.py    ShardedStateDicts(model.zero3): full tensors <-> this rank's shards, the
                      sharded state dict; a view its users make (the model, the checkpoint)

    from minipar.zero3 import ShardedStateDicts, fully_shard
    fully_shard(model, pgm, prefetch=1)  # units: the model's zero3_unit_classes (embedding, layers)
    with model.zero3.no_sync():          # accumulate without communicating (or set_requires_gradient_sync)
        model(micro_batch_1).backward()
    model(micro_batch_2).backward()      # one reduce-scatter of the sum
    full = ShardedStateDicts(model.zero3).full_state_dict()   # collective: every rank calls it
"""
from .grad_reduce import GradientReduction
from .shard_manager import GatherPolicy, Zero3
from .state_dicts import ShardedStateDicts
from .unit import FlatLayout, Unit
from .wrap import fully_shard, plan_units

__all__ = ["FlatLayout", "GatherPolicy", "GradientReduction", "ShardedStateDicts", "plan_units", "Unit",
           "Zero3", "fully_shard"]
