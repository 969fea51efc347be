"""ZeRO-3's shard manager, Zero3, which wrap.py's fully_shard attaches as `model.zero3`: the hooks
that gather a unit before its forward and its backward, prefetch the next ones, free it after, and
hand its gradient on to the reduction (grad_reduce.py); and GatherPolicy, the pure rule that says
which units each hook gathers and frees. What one step does and costs, unit by unit, is wrap.py's
docstring; a unit's buffers and collectives are unit.py's.

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
  - a forward that uses a unit's parameters without calling its module (generation's KV cache):
    forward_scope(module) runs the same two forward hooks around it (no gradient);
  - end of backward: a callback queued on the autograd engine waits for the outstanding
    reduce-scatters, so when loss.backward() returns the shard gradients are final (queued by the
    first of these hooks to fire: a pipeline's W pass only reaches the post-accumulate-grad one).

Which units each hook gathers and frees is GatherPolicy's (below): pure, no tensor, no process
group, so the planner replays the very decisions a run makes (minipar/plan/zero3_replay.py):

    event                    answer                                    (units[0] is the root)
    pre_forward(u)           free: every unit when u is the root (a new pass: a forward left
                             without backward may have gathered stale shards); gather: u, and if
                             u runs where the learned forward order expects it, the next
                             `prefetch` units of that order (0 turns prefetching off)
    post_forward(u, grad)    free: u (reshard_after_forward, or no grad: no backward will come);
                             at the root, the pass's end: every other unit (prefetched but unused
                             too), never the root while grad is on; the forward order relearned
    start_backward()         a new backward pass: its seen list restarts
    pre_backward(u)          gather: as pre_forward on the backward order; nothing for a unit
                             whose backward reads no weight (an embedding)
    end_backward()           free: every unit; the backward order relearned if the pass differed
                             (a pass that gathered nothing, a pipeline's W, teaches nothing)

Before the first step the orders are a static guess, so step 1 prefetches too: forward in
registration order, backward its reverse with the root first (the loss is its output). A model
that runs its units in another order, or skips one, is learned after its first pass. Under
pipeline parallelism the passes alternate between model chunks, and each relearns the order from
the other (plan/zero3_replay.py counts what that costs). Units are compared by identity where a
position is checked and by `==` where a pass is compared with the learned order.

Activation checkpointing re-runs a unit's forward inside its backward: the hooks see that the unit
is already in its backward and leave its gathered parameters alone. A unit unused in a step is
never reduced (a learned prefetch may still gather it; it is freed again at the end of backward).
A unit's buffers, and how a gather refills the very storage autograd saved, are unit.py's.

Zero3 is this file's gathering and freeing plus the gradient side it builds and owns, `grads`
(grad_reduce.py: the reduce-scatters, no_sync, HSDP), whose switches it passes on
(model.zero3.no_sync(), set_requires_gradient_sync, as FSDP2 gives its sharded module). Full
tensors <-> shards are a view its users make of it (state_dicts.py: ShardedStateDicts(model.zero3)).

Under torch.compile (compile: true, minipar/regional_compile.py) only a unit's forward is compiled;
these hooks are the module call's and the tensors', so they run eagerly around the compiled code,
and the gathered views are graph inputs (tests/test_compile.py checks the same gathers, frees and
reduce-scatters, in the same order, compiled and eager).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Sequence, Tuple

import torch

from .. import comm_ledger
from .grad_reduce import GradientReduction
from .unit import AfterBackward, Unit, backward_reads_weight


# ------------------------------------------------------------------ the policy (pure)
def gather_with(order: Sequence, position: int, unit, prefetch: int) -> list:
    """The units to gather when `unit` runs as the position-th of its pass: itself first, and, if
    the learned order has it there, the next `prefetch` units of that order (in flight while it
    computes)."""
    ahead = order[position + 1:position + 1 + prefetch] if position < len(order) and order[position] is unit \
        else []
    return [unit] + list(ahead)


class GatherPolicy:
    """The decisions of ZeRO-3's hooks over the units (root first), and the learned orders (the
    table of the module docstring)."""

    def __init__(self, units: Sequence, prefetch: int, reshard_after_forward: bool,
                 gather_for_backward: Callable[[object], bool]):
        self.units, self.root = list(units), units[0]
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.gather_for_backward = gather_for_backward
        self.forward_order: List = list(units)
        self.backward_order: List = [self.root] + [u for u in reversed(self.units[1:])
                                                   if gather_for_backward(u)]
        self._fwd_seen: List = []
        self._bwd_seen: List = []

    def pre_forward(self, u) -> Tuple[list, list]:
        """(free, gather) before u's forward: the root starts a pass and frees everything first."""
        free = []
        if u is self.root:
            self._fwd_seen = []
            free = list(self.units)
        self._fwd_seen.append(u)
        return free, gather_with(self.forward_order, len(self._fwd_seen) - 1, u, self.prefetch)

    def post_forward(self, u, grad: bool = True) -> list:
        """What to free after u's forward (grad: autograd records, so a backward will come)."""
        if u is not self.root:
            return [u] if self.reshard_after_forward or not grad else []
        free = [v for v in self.units if (v is not self.root and self.reshard_after_forward) or not grad]
        if grad and self._fwd_seen != self.forward_order:
            self.forward_order = list(self._fwd_seen)           # relearn: this pass ran otherwise
        return free

    def start_backward(self) -> None:
        self._bwd_seen = []

    def pre_backward(self, u) -> list:
        """What to gather before u's backward (nothing where its backward reads no weight)."""
        if not self.gather_for_backward(u):
            return []
        self._bwd_seen.append(u)
        return gather_with(self.backward_order, len(self._bwd_seen) - 1, u, self.prefetch)

    def end_backward(self) -> list:
        """What to free when the backward pass ends: everything (prefetched but unused, or kept)."""
        if self._bwd_seen and self._bwd_seen != self.backward_order:
            self.backward_order = list(self._bwd_seen)          # relearn (a W pass gathers nothing)
        return list(self.units)


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
    `grads` (a GradientReduction) for the gradient side."""

    def __init__(self, model, pgm, units: List[Unit], param_names, prefetch, reshard_after_forward):
        self.model, self.pgm, self.units, self.root = model, pgm, units, units[0]
        self.grads = GradientReduction(units, pgm)
        self.shards = [u.shard for u in units if not u.empty]   # what the optimizer steps
        self.param_names = list(param_names)     # HF names in model order (tied once)
        # which units each hook gathers and frees, the learned orders: the pure policy above
        self.policy = GatherPolicy(units, prefetch, reshard_after_forward, lambda u: u.gather_for_backward)
        self._backward_running = False
        self.peak_gathered_bytes = 0
        # a root that holds an embedding too (tied to lm_head) is read in backward only by its other
        # modules (the final norm, lm_head: its "heads"); once their inputs' gradients are complete
        # it is freed, instead of at the end of backward, where the embedding's gradient completes it
        modules = {id(m): m for refs in self.root.refs for m, _ in refs}
        heads = [m for m in modules.values() if backward_reads_weight(m)]
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

    @contextlib.contextmanager
    def forward_scope(self, module):
        """The hooks a call of `module` runs, around code that uses its parameters without calling it
        (generation's KV cache walks a layer's pieces: models/kv_cache.py): its units (a layer and its
        experts) gathered, the next ones prefetched in the learned order, freed after; the root a
        whole pass (every unit freed at its end). A module that is no unit: nothing. Without
        gradients only: what a pass with backward does is the module call's."""
        if torch.is_grad_enabled():
            raise RuntimeError("Zero3.forward_scope is for forwards without gradient (torch.no_grad())")
        units = [u for u in self.units if u.module is module]
        for u in units:
            self._pre_forward(u)
        try:
            yield
        finally:
            for u in units:
                self._post_forward(u, None)      # no gradient: frees, never relearns an order

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
