"""fully_shard: cut a model into ZeRO-3 units, replace their parameters by flat shards, and attach
the manager (shard_manager.py's Zero3) whose hooks gather and free them.

    fully_shard(model, pgm, prefetch=1, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

Which modules become units is the model's to say: `model.zero3_unit_classes` (models/llama.py: the
vocab-parallel embedding and each decoder layer, as torchtitan wraps Llama, and as transformers'
_no_split_modules names what must stay whole). Every module of those classes is a unit; the root
unit keeps what is left (the final norm and lm_head, and the embedding too when it is tied to
lm_head). plan_units (flat_param.py) decides it all, and checks it, before any parameter moves.

Per unit, in model order:
  - its original Parameters are deleted from their modules (before each forward, shard_manager.py's
    hook points those attributes at views of the gathered flat buffer);
  - a mixture of experts' stacked experts are cut out into a unit of their own, sharded over edp
    instead of dp_shard_cp (expert_parallel/sharding.py: split_experts), so each rank gathers only
    the E/ep experts it computes;
  - the unit's shard, rank r's 1/N of the padded flat buffer in fp32, is registered on the module
    as `zero3_flat_shard` (`zero3_expert_shard`): the only parameters model.parameters() then
    yields, so an optimizer made afterwards holds states for 1/N of the model.

A model built on the meta device (models/llama_init.py) is filled here, unit by unit: `init`, a
weight source, writes each shard from the full tensors' slices, and no full model ever exists on
the rank. `ignored_params` stay whole and outside every flat buffer, never gathered nor reduced
(LoRA's adapters over a frozen base, which the caller all-reduces). Bad arguments raise a
ValueError naming the value and the fix, before the model is changed.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..expert_parallel.sharding import split_experts
from .flat_param import plan_units
from .shard_manager import Zero3
from .unit import Unit


def fully_shard(model: nn.Module, pgm, unit_classes=None, prefetch: int = 1,
                reshard_after_forward: bool = True, param_dtype: Optional[torch.dtype] = None,
                reduce_dtype: Optional[torch.dtype] = None, init=None, ignored_params=()) -> nn.Module:
    """Shard `model` in place over pgm.dp_shard_cp (HSDP over pgm.dp_replicate); returns it, with
    the manager as `model.zero3`. unit_classes defaults to what the model declares as
    `model.zero3_unit_classes` (models/llama.py: the embedding and each decoder layer, as
    torchtitan wraps Llama); the root keeps the rest (the final norm and lm_head, and the
    embedding too when it is tied to lm_head).
    Call it after moving the model to its device and BEFORE creating the optimizer (which must see
    the shards).
    init: a weight source (models/llama_init.py) for a model built on the meta device; each unit's
    shard is then filled from it, unit by unit, on init.device, and nothing else is materialised.
    ignored_params (FSDP's name): parameters left whole and out of every flat buffer, never gathered
    nor reduced here (LoRA's adapters over a frozen base: the caller all-reduces their gradients)."""
    if getattr(model, "zero3", None) is not None:
        raise ValueError("fully_shard: this model is already sharded (model.zero3 exists)")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"fully_shard: prefetch must be an integer >= 0 (0 turns it off), got {prefetch!r}")
    for what, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and (not isinstance(dt, torch.dtype) or not dt.is_floating_point):
            raise ValueError(f"fully_shard: {what} must be a floating torch.dtype or None, got {dt!r}")
    if unit_classes is None:                      # the model knows its structure; ZeRO-3 asks it
        unit_classes = getattr(model, "zero3_unit_classes", None)
        if unit_classes is None:
            raise ValueError(f"fully_shard: {type(model).__name__} declares no zero3_unit_classes: pass "
                             f"unit_classes=(the module classes to gather and free as units)")
    unit_classes = tuple(unit_classes) if isinstance(unit_classes, (tuple, list, set)) else (unit_classes,)
    if not all(isinstance(c, type) for c in unit_classes):
        raise ValueError(f"fully_shard: unit_classes must be module classes, got {unit_classes!r}")

    ignored = {id(p) for p in ignored_params}
    meta = [n for n, p in model.named_parameters() if p.is_meta and id(p) not in ignored]
    if meta and init is None:
        raise ValueError(f"fully_shard: {len(meta)} parameters are on the meta device (e.g. {meta[0]}): "
                         f"pass init=<weight source> (models/llama_init.py) to fill the shards")
    plan = plan_units(model, unit_classes, ignored_params)   # checks everything before any change
    names = [n for n, p in model.named_parameters() if id(p) not in ignored]   # HF names, model order
    units = []
    for uname, module, params, refs in plan:
        for ref in refs:
            for m, attr in ref:                            # the original Parameters go away
                del m._parameters[attr]
        # a unit's experts get a flat buffer of their own, sharded over edp (expert_parallel/sharding.py)
        (params, refs), (expert_params, expert_refs) = split_experts(params, refs)
        unit = Unit(uname, module, params, refs, pgm, param_dtype, reduce_dtype, init)
        if not unit.empty:
            module.register_parameter("zero3_flat_shard", unit.shard)
        units.append(unit)
        if expert_params:
            unit = Unit(f"{uname}.experts", module, expert_params, expert_refs, pgm, param_dtype,
                        reduce_dtype, init, experts=True)
            module.register_parameter("zero3_expert_shard", unit.shard)
            units.append(unit)
    model.zero3 = Zero3(model, pgm, units, names, prefetch, reshard_after_forward)
    return model
