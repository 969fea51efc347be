"""ZeRO-3 (FSDP): shard parameters, gradients and optimizer states over dp_shard_cp; gather a unit
only while it computes. This file is the manager's hooks, which run the gathers and frees that
gather_policy.py decides (prefetch, the learned orders); wrap.py's fully_shard cuts a model into
units and attaches it.

Rajbhandari et al., "ZeRO" (2020), stage 3; the unit-by-unit schedule of PyTorch FSDP (Zhao et
al., 2023) and FSDP2. Each unit (the embedding, each decoder layer; the root unit holds what is
left: the final norm and lm_head, and the embedding too when tied to lm_head) keeps its parameters
in one flat buffer (minipar/zero3/flat_param.py), and rank r of the N ranks of pgm.dp_shard_cp
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
              output gradient and never reads the weight (unit.py's LOOKUPS)
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

How the hooks find their moments, for any model:
  - before forward:  a forward pre-hook on the unit module gathers (waits for a prefetched
    gather) and points the module attributes (q_proj.weight, ...) at views of the flat buffer;
  - after forward:   a forward hook frees the gathered storage (storage().resize_(0): the views
    and the tensors autograd saved keep their shape but hold no memory), and hooks each output's
    gradient, which autograd computes just before the unit's backward;
  - before backward: that output-gradient hook gathers the storage again, in place, so every
    saved view is valid again; then prefetches the next unit of the backward order;
  - after backward:  the flat buffer is one autograd leaf; its post-accumulate-grad hook fires
    once all gradients of the unit are in its .grad: reduce-scatter, free;
  - after backward, a frozen unit (LoRA's base: no gradient, so no such hook): the pre-forward hook
    passes the unit's inputs through an identity Function (unit.py's AfterBackward) whose backward runs
    once their gradients are complete, i.e. once the unit's backward is done, and frees it;
  - end of backward: a callback queued on the autograd engine waits for the outstanding
    reduce-scatters, so when loss.backward() returns the shard gradients are final (queued by the
    first of these hooks to fire: a pipeline's W pass only reaches the post-accumulate-grad one).
Prefetching follows the execution orders (`prefetch` units ahead; 0 turns it off). Before the
first step they are a static guess, the registration order forward and its reverse (root first)
backward, so step 1 prefetches too; each forward and backward records the order it really ran and
replaces the guess when it differs (a model that runs units out of order, or skips one). Which
units each hook gathers and frees, and the learned orders, are gather_policy.py's GatherPolicy, a
pure state machine the planner replays too (minipar/plan/zero3_replay.py).
Activation checkpointing re-runs a unit's forward inside its backward: the hooks see that the unit
is already in its backward and leave its gathered parameters alone. A unit unused in a step is
never reduced (a learned prefetch may still gather it; it is freed again at the end of backward).
A unit's buffers, and how a gather refills the very storage autograd saved, are unit.py's.

Zero3 is this file's gathering and freeing plus two parts it builds and owns: `grads`
(grad_reduce.py: the reduce-scatters, no_sync, HSDP) and `state_dicts` (state_dicts.py: full
tensors <-> shards). Its public methods delegate to them, one line each, so callers see one
manager (model.zero3.no_sync(), model.zero3.full_state_dict(), ...), as FSDP2 gives its
sharded module set_requires_gradient_sync and the state-dict calls.

Under torch.compile (compile: true, minipar/regional_compile.py) only a unit's forward is compiled;
these hooks are the module call's and the tensors', so they run eagerly around the compiled code,
and the gathered views are graph inputs (tests/test_compile.py checks the same gathers, frees and
reduce-scatters, in the same order, compiled and eager).
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .. import comm_ledger
from .gather_policy import GatherPolicy
from .grad_reduce import GradientReduction
from .state_dicts import ShardedStateDicts
from .unit import LOOKUPS, AfterBackward, Unit


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


class Zero3:
    """The shard manager that fully_shard attaches as `model.zero3`: the hooks that gather and
    free the units as `policy` (a GatherPolicy: the learned orders) decides, the memory count;
    `grads` (a GradientReduction) for the gradient side and `state_dicts` (a ShardedStateDicts)
    for full tensors <-> shards."""

    def __init__(self, model, pgm, units: List[Unit], param_names, prefetch, reshard_after_forward):
        self.model, self.pgm, self.units, self.root = model, pgm, units, units[0]
        self.grads = GradientReduction(units, pgm)
        self.state_dicts = ShardedStateDicts(units, param_names, pgm)
        # owned by state_dicts, shared here: the checkpoint and the tests read them from the manager
        self.shards = self.state_dicts.shards    # what the optimizer steps: the non-empty units'
        self.param_names = self.state_dicts.param_names      # HF names in model order (tied once)
        # which units each hook gathers and frees, the learned orders: a pure policy (gather_policy.py)
        self.policy = GatherPolicy(units, prefetch, reshard_after_forward, lambda u: u.gather_for_backward)
        self._backward_running = False
        self.peak_gathered_bytes = 0
        # a root that holds an embedding too (tied to lm_head) is read in backward only by its other
        # modules (the final norm, lm_head: its "heads"); once their inputs' gradients are complete
        # it is freed, instead of at the end of backward, where the embedding's gradient completes it
        modules = {id(m): m for refs in self.root.refs for m, _ in refs}
        heads = [m for m in modules.values() if type(m) not in LOOKUPS]
        self._free_root_early = len(heads) < len(modules)
        self._heads_pending, self._heads_unknown = 0, False
        for m in heads if self._free_root_early else ():
            m.register_forward_pre_hook(lambda m, args: self._head_forward(args))
        for u in units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self._pre_forward(u, args))
            u.module.register_forward_hook(lambda m, args, out, u=u: self._post_forward(u, out))
            if u.flat.requires_grad:
                u.flat.register_post_accumulate_grad_hook(lambda flat, u=u: self._post_backward(u))

    # ------------------------------------------------------------------ the public face
    # the gradient side (grad_reduce.py)
    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        self.grads.set_requires_gradient_sync(requires_gradient_sync)

    def no_sync(self):
        """A context: backwards inside accumulate without communicating (GradientReduction.no_sync)."""
        return self.grads.no_sync()

    def accumulated_grad_bytes(self) -> int:
        return self.grads.accumulated_grad_bytes()

    # the state dicts (state_dicts.py); tensor lists follow self.shards
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        return self.state_dicts.full_state_dict()

    def load_full_state_dict(self, full: Dict[str, torch.Tensor], source: str = "state dict"):
        self.state_dicts.load_full_state_dict(full, source)

    def sharded_state_dict(self) -> dict:
        return self.state_dicts.sharded_state_dict()

    def full_from_shards(self, tensors) -> Dict[str, torch.Tensor]:
        return self.state_dicts.full_from_shards(tensors)

    def shards_from_full(self, full: Dict[str, torch.Tensor], source: str = "state dict") -> list:
        return self.state_dicts.shards_from_full(full, source)

    # ------------------------------------------------------------------ memory accounting
    def gathered_units(self) -> List[str]:
        return [u.name for u in self.units if u.gathered_bytes > 0]

    def gathered_bytes(self) -> int:
        return sum(u.gathered_bytes for u in self.units)

    def _note_memory(self):
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _gather_now(self, gather: List[Unit]):
        """gather: the unit about to run, then the ones the policy prefetches (in flight while it
        computes)."""
        for u in gather:
            u.start_gather()
        gather[0].wait_gather()
        self._note_memory()

    # ------------------------------------------------------------------ the hooks
    def _pre_forward(self, u: Unit, args=()):
        if u.in_backward:                        # activation checkpointing re-runs the forward
            u.start_gather()                     # (normally a no-op: gathered before backward)
            u.wait_gather()
            return None
        free, gather = self.policy.pre_forward(u)
        if u is self.root:
            self._heads_pending, self._heads_unknown = 0, False
        for v in free:                           # the root: all, left gathered by a forward without
            v.free()                             # backward; the shards may have changed (optimizer step)
        comm_ledger.mark(f"zero3.forward {u.name}")
        self._gather_now(gather)
        u.point_params_at(u.layout.views(u.flat))
        if u.flat.requires_grad or u is self.root or not torch.is_grad_enabled():
            return None
        # a frozen unit (LoRA's base) has no gradient whose hook says its backward is over: its
        # inputs' gradients say it instead (FSDP2's RegisterPostBackwardFunction)
        grads = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not grads:
            return None                          # (freed at the end of backward)
        out = AfterBackward.apply(lambda u=u: self._post_backward_frozen(u), *(args[i] for i in grads))
        args = list(args)
        for i, t in zip(grads, out):
            args[i] = t
        return tuple(args)

    def _post_forward(self, u: Unit, out):
        if u.in_backward:
            return
        comm_ledger.mark(f"zero3.forward_end {u.name}")
        grad = torch.is_grad_enabled()
        if grad:
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._pre_backward(u))
        # the root ends the forward: it is the first unit of backward, so (FSDP2's default) it
        # stays gathered into backward; units prefetched but unused are freed
        for v in self.policy.post_forward(u, grad):
            v.free()

    def _head_forward(self, args):
        """A head of the root starts its forward: count its inputs, whose gradients say when its
        backward is done (an input that needs none leaves the root gathered to the end)."""
        if self.root.in_backward or not torch.is_grad_enabled():
            return
        inputs = [t for t in _tensors(args) if t.requires_grad]
        self._heads_unknown |= not inputs
        for t in inputs:
            self._heads_pending += 1
            t.register_hook(lambda grad: self._head_input_done())

    def _head_input_done(self):
        self._heads_pending -= 1
        if self._heads_pending == 0 and not self._heads_unknown and self.root.in_backward:
            comm_ledger.mark("zero3.free_early <root>")
            self.root.free()                     # the lookups left never read the weights

    def _start_backward(self):
        if not self._backward_running:
            self._backward_running = True
            self.policy.start_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _pre_backward(self, u: Unit):
        self._start_backward()
        if u.in_backward:
            return
        u.in_backward = True
        gather = self.policy.pre_backward(u)
        if not gather:                           # an embedding: its backward needs no weights
            return
        comm_ledger.mark(f"zero3.backward {u.name}")
        self._gather_now(gather)

    def _post_backward_frozen(self, u: Unit):
        if u.in_backward:                        # not a recompute's inputs: the unit is done
            u.free()

    def _post_backward(self, u: Unit):
        # a backward that reaches the flat buffers without passing a unit's output (a pipeline's W
        # action: minipar/pipeline_parallel/split_backward.py) must still end with the callback
        self._start_backward()
        u.free()                                 # its backward is done; its gradient is in flat.grad
        self.grads.post_backward(u)

    def _finish_backward(self):
        self.grads.finish_backward()
        for u in self.policy.end_backward():     # prefetched but unused, or kept by reshard=False
            u.free()
        for u in self.units:
            u.in_backward = False
        self._backward_running = False
