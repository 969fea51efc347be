"""ZeRO-3 (FSDP): shard parameters, gradients and optimizer states over dp_shard_cp; gather a unit
only while it computes. This file is where a reader starts: what a step does and costs, and
fully_shard, which cuts a model into units and attaches the manager whose hooks do it.

    fully_shard(model, pgm, prefetch=1, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

The files, in reading order: this one; unit.py (a unit's flat buffer, its shard, the all-gather
and the free); shard_manager.py (the hooks, and the pure policy of which units they gather and
free); grad_reduce.py (the reduce-scatter of each unit's gradient, no_sync, HSDP). Full tensors <->
shards (state_dicts.py) are a view the checkpoint and the model's state dict make of the manager.

Rajbhandari et al., "ZeRO" (2020), stage 3; the unit-by-unit schedule of PyTorch FSDP (Zhao et
al., 2023) and FSDP2. Each unit (the embedding, each decoder layer; the root unit holds what is
left: the final norm and lm_head, and the embedding too when tied to lm_head) keeps its parameters
in one flat buffer (unit.py's FlatLayout), and rank r of the N ranks of pgm.dp_shard_cp
keeps only shard r of it, an fp32 nn.Parameter: the only parameter that model.parameters()
yields, so the optimizer holds states for 1/N of the model.

    shard (P/N,) fp32 --all-gather--> flat (P,) param_dtype --split/view--> q_proj.weight, ...
                                        | forward / backward of the unit
    shard.grad (P/N,) <--reduce-scatter-- flat.grad (P,) reduce_dtype     (+ all-reduce over
                                                                           dp_replicate: HSDP)
One step, unit by unit (prefetch = 1; "AG" is an async all-gather, "RS" a reduce-scatter):

    forward   root: AG root, AG emb | emb: AG L0, compute, free | L0: AG L1, compute, free | ...
              root (norm, lm_head, loss) computes last and is NOT freed: it is the first unit of
              backward, so it stays gathered into it (FSDP2's default for its root)
    backward  root: AG L(n-1) | L(n-1): AG L(n-2), compute, RS, free | ... | L0 | emb: RS
              the embedding is not gathered for backward: its gradient is a scatter-add of the
              output gradient and never reads the weight (unit.py's backward_reads_weight)
              root's RS and free come as soon as its gradient is complete (right after lm_head's
              and the norm's backward); a RS is waited for when the next one starts, then
              all-reduced over dp_replicate (HSDP); the end-of-backward callback waits for the rest
              a root that holds the embedding too (tied to lm_head) completes its gradient only
              at the embedding's backward, the last; its buffer is freed earlier, as soon as its
              other modules (the norm, lm_head) have their inputs' gradients: the lookup left
              never reads it (at SmolLM-135M's shape, 108 MiB less at the end of backward)

Communication per micro-batch and rank, exact: a unit's bytes are its PADDED flat buffer,
B_u = ceil(numel_u / N) * N elements (numel_u summed over its tp-local tensors) times the element
size. P = sum_u B_u in param_dtype, G = sum_u B_u in reduce_dtype, P_root = B_root in param_dtype
(norm + lm_head untied; embedding + norm + lm_head tied), N = dp_shard_cp size, R = dp_replicate:

    all-gather      2 P - P_root - P_emb per forward+backward: every unit twice, the root and an
                    untied embedding unit once (P_emb = B_emb in param_dtype; 0 when tied, the
                    embedding then being in the root); wire (N-1)/N of that;
                    reshard_after_forward=False: P (every unit once)
    reduce-scatter  G per synced backward, wire (N-1)/N; under no_sync() (grad_reduce.py) none:
                    M micro-batches cost G once per step instead of M G
    HSDP            an all-reduce of the shard gradients, G/N, wire 2 (G/N)(R-1)/R, per synced backward

These are the bytes of torch FSDP2 with its defaults, whose root (embedding, norm, lm_head) is
gathered once too. Memory per rank: the fp32 shards, their grads and AdamW states, plus the gathered
buffers: the root from the start of forward to its backward, and 1 + prefetch other units at a
time; under no_sync() also the unsharded accumulated gradients (G, from the first micro-batch's
backward to the last one's).

Which modules become units is the model's to say: `model.zero3_unit_classes` (models/llama.py: the
vocab-parallel embedding and each decoder layer, as torchtitan wraps Llama, and as transformers'
_no_split_modules names what must stay whole). Every module of those classes is a unit; the root
unit keeps what is left. plan_units (below) decides it all, and checks it, before any parameter
moves. Then, per unit, in model order:
  - its original Parameters are deleted from their modules (before each forward, shard_manager.py's
    hook points those attributes at views of the gathered flat buffer);
  - a mixture of experts' stacked experts (the parameters that carry ep_split_dim, set by the
    layer that split them: models/moe.py) are cut out into a unit of their own, sharded over edp
    instead of dp_shard_cp (expert_parallel/sharding.py says why), so each rank gathers only the
    E/ep experts it computes;
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

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

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
        (params, refs), (expert_params, expert_refs) = _split_experts(params, refs)
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


def _split_experts(params: List[Tuple[str, object]], refs: list) -> Tuple[tuple, tuple]:
    """A unit's (params, refs) -> ((the rest), (the expert parameters: those split over ep, which
    carry ep_split_dim)), order kept."""
    expert = [getattr(p, "ep_split_dim", None) is not None for _, p in params]
    rest = [(pr, r) for pr, r, e in zip(params, refs, expert) if not e]
    experts = [(pr, r) for pr, r, e in zip(params, refs, expert) if e]
    return tuple(map(list, zip(*rest))) or ([], []), tuple(map(list, zip(*experts))) or ([], [])


def plan_units(model, unit_classes, ignored=()):
    """Which parameters go into which flat buffer: [(unit name, module, [(HF name, param)],
    [[(module, attr), ...] per param])], the root unit ("") first. `ignored` parameters (LoRA's
    adapters) go into none: they stay plain parameters of their modules. A unit is an outermost module
    of `unit_classes`; the root takes every parameter outside them. A unit that shares a parameter
    with the root (a tied embedding: lm_head.weight is embed_tokens.weight) joins the root, since
    one parameter lives in one flat buffer. Every place a (tied or shared) parameter is referenced
    is listed, so all of them can be pointed at the gathered view."""
    unit_names: List[str] = []
    for name, m in model.named_modules():
        inside = any(name.startswith(u + ".") for u in unit_names)   # nested: part of the outer unit
        if m is not model and isinstance(m, unit_classes) and not inside:
            unit_names.append(name)
    skip = {id(p) for p in ignored}
    names = {id(p): n for n, p in model.named_parameters() if id(p) not in skip}   # tied: its first name
    params = {id(p): p for _, p in model.named_parameters() if id(p) not in skip}
    while True:
        refs: Dict[int, list] = {i: [] for i in names}
        owner: Dict[int, set] = {i: set() for i in names}
        for mname, m in model.named_modules(remove_duplicate=False):    # a shared module: every path
            unit = next((u for u in unit_names if mname == u or mname.startswith(u + ".")), "")
            for attr, p in m._parameters.items():
                if p is not None and id(p) not in skip:
                    if not any(m is m2 and attr == a2 for m2, a2 in refs[id(p)]):
                        refs[id(p)].append((m, attr))
                    owner[id(p)].add(unit)
        tied_to_root = {u for units_of in owner.values() if "" in units_of for u in units_of} - {""}
        if not tied_to_root:
            break
        unit_names = [u for u in unit_names if u not in tied_to_root]
    for i, units_of in owner.items():
        if len(units_of) > 1:
            raise ValueError(f"fully_shard: parameter {names[i]} is shared by units {sorted(units_of)}; "
                             f"tied parameters must live in one unit (leave them in the root)")
        p, first = params[i], params[next(j for j in names if owner[j] == units_of)]
        if p.dtype != first.dtype or p.device != first.device or p.requires_grad != first.requires_grad:
            raise ValueError(f"fully_shard: {names[i]} is {p.dtype} on {p.device} (requires_grad="
                             f"{p.requires_grad}) but its unit also holds {first.dtype} on {first.device} "
                             f"(requires_grad={first.requires_grad}): one flat buffer needs one dtype, one "
                             f"device, and all or none of its parameters trainable")
    modules = dict(model.named_modules())
    plan = []
    for uname in [""] + unit_names:
        ids = [i for i in names if owner[i] == {uname}]
        plan.append((uname, modules[uname], [(names[i], params[i]) for i in ids], [refs[i] for i in ids]))
    return plan
