"""graph_boundary: a function torch.compile never traces, without importing torch._dynamo eagerly.

    @graph_boundary
    def ring_attention(q, k, v, cp, ...): ...

Under torch.compile (compile: true, minipar/regional_compile.py) a call to such a function ends
the compiled graph, runs the function eagerly (its autograd Functions, collectives and host reads
as written; their backward eager too) and starts a new graph after it: a deliberate graph break.
Outside compilation the function is called directly, at no cost: torch._dynamo (1-2 s to import)
is imported only by a compiled run, through torch._disable_dynamo, torch's lazy
torch._dynamo.disable.

Which functions are boundaries and why: the tensor-parallel Functions (tensor_parallel/mappings.py,
async_linear.py), ring and Ulysses attention (context_parallel/), an MoE's feed-forward with its
routing and dispatch (models/moe.py). Each says so in its docstring.
"""
from __future__ import annotations

import functools

import torch


def graph_boundary(fn):
    """fn, run eagerly between two compiled graphs when called from compiled code."""
    disabled = torch._disable_dynamo(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():      # being traced: hand the call to dynamo's disable
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)
    return call
