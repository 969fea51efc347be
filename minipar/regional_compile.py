"""Regional compilation: torch.compile of each decoder layer's computation, the hand-written
parallel machinery left around it (torchtitan compiles per transformer block the same way).

A whole-model torch.compile would have to trace ZeRO-3's gathers and frees, DDP's buckets, the
pipeline's sends and every collective; compiling one layer's forward instead compiles the one
piece that repeats L times (the same code for every layer, so it is traced once and reused:
parameters are graph inputs) and leaves the machinery where it was. Where each region starts and
ends (docs/compile.md has the picture):

    layer(h, cos, sin, docs)                  the MODULE call: eager
      ZeRO-3 pre-forward hook                 gather the layer's flat shard (shard_manager.py)
      layer.forward  <- compiled here         norm, q/k/v, RoPE, attention, o, residual, norm, MLP
        TP f / g, SP gather / scatter         graph BOUNDARIES (tensor_parallel/mappings.py): the
                                              hand-written autograd Functions run eagerly between
                                              two compiled graphs, their backward too
        async TP's fused column Function      a BOUNDARY (tensor_parallel/async_linear.py): the
                                              async collective and the overlapped backward eager
        ring / Ulysses / USP attention        a BOUNDARY (context_parallel/ring_attention.py,
                                              ulysses.py): blocks, hops and their backward eager
        an MoE feed-forward                   a BOUNDARY (models/moe.py): routing's data-dependent
                                              shapes (bincount, the splits read on the host) and
                                              the all-to-all dispatch run eagerly
        LoRA adapters                         INSIDE (output addends of the linears)
        activation checkpointing              INSIDE where the layer has no boundary: the checkpoint
                                              call is traced with the layer (torch's checkpoint
                                              operator, selective policies included), so the hooks
                                              run once, outside. With a boundary (tp, cp, MoE) it
                                              stays OUTSIDE, around the module call, eager (full or
                                              every n-th layer; the op policy is refused)
      ZeRO-3 post-forward hook, output hooks  free the gathered storage, arm the pre-backward gather
    DDP's, ZeRO-3's gradient hooks            on the parameters (AccumulateGrad): outside any graph
                                              (HSDP: ZeRO-3's reduce-scatter, then the all-reduce
                                              over dp_replicate, zero3/grad_reduce.py)
    the pipeline schedule                     eager: 1f1b, interleaved_1f1b (each chunk's layers
                                              compiled, one graph for all), stages stepping alone

The embedding, the final norm, the lm_head and the vocab-parallel loss stay eager (they run once
per step, and the loss's all-reduces would be boundaries anyway).

Recompilation. Dynamo guards each graph on what it read (shapes, dtypes, grad mode, the layer's
settings). A training run repeats the same shapes every step, so every graph is compiled during the
first step and never again (`CompileStats.graphs` stays flat from step 2; tests/test_compile.py).
What does recompile: an evaluation (grad mode off: its own graphs, once), a new sequence length.
Shapes are static (dynamic=False): a varying length is a recompile, not a slower symbolic graph.

A layer dynamo cannot trace at all runs eagerly, and the first step's line says so: packed
documents at cp 1 (ring attention's per-document path, a boundary) inside a checkpointed layer,
whose checkpoint operator cannot hold that break (the layout check cannot see the data).

Backends: "inductor" (the default: Triton kernels on GPU, C++ on CPU) with torch's modes
(default, reduce-overhead, max-autotune...), or "aot_eager" (traces forward and backward but
runs them eagerly: no kernel generation, fast to compile; the tests' choice on CPU), "eager".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")


def check_compile(compile: bool, backend: str, mode: Optional[str], pipeline_schedule: str = "1f1b",
                  checkpointing=False, selective_ac_option="op", boundaries: bool = False) -> str:
    """Why these settings cannot compile, or '' (the config check calls it on every rank, and
    compose.build again). boundaries: the layer holds a graph boundary (tp > 1, cp > 1, an MoE)."""
    if not compile:
        return ""
    if backend not in BACKENDS:
        return f"torch_compile_backend must be one of {BACKENDS}, got {backend!r}"
    if mode is not None and backend != "inductor":
        return (f"torch_compile_mode {mode!r} is an inductor setting; with torch_compile_backend "
                f"{backend!r} leave it unset, or use inductor")
    if not hasattr(torch, "compile") or not hasattr(torch, "_disable_dynamo"):
        return f"compile: true needs torch.compile (torch >= 2.4); this is torch {torch.__version__}"
    if pipeline_schedule in ("zb_h1", "zbv"):
        return (f"compile: true with pipeline_schedule {pipeline_schedule}: the zero-bubble schedules "
                f"split each linear's backward by hand (pipeline_parallel/split_backward.py keeps (x, dy) "
                f"for a later W action), which a compiled graph cannot hold; use 1f1b or "
                f"interleaved_1f1b, or compile: false")
    if checkpointing == "selective" and selective_ac_option == "op" and boundaries:
        return ("compile: true with gradient_checkpointing: selective (op) on a layer with graph "
                "boundaries (tp > 1, cp > 1 or an MoE): the op policy runs inside the compiled region, "
                "where torch's checkpoint operator cannot hold a graph break, and outside it its "
                "dispatch mode cannot see the compiled ops; use gradient_checkpointing: true or an "
                "integer selective_ac_option, or compile: false")
    return ""


@dataclass
class CompileStats:
    """What dynamo did, read from its counters: graphs compiled, graph breaks and their reasons,
    the seconds spent compiling. Counters are per process, so the figures are this rank's."""
    backend: str
    mode: Optional[str]
    layers: int
    reported: bool = field(default=False)

    @staticmethod
    def _counters():
        from torch._dynamo.utils import counters
        return counters

    @property
    def graphs(self) -> int:
        """Graphs dynamo has compiled so far (a recompile adds one)."""
        return int(self._counters()["stats"]["unique_graphs"])

    @property
    def graph_breaks(self) -> int:
        return int(sum(self._counters()["graph_break"].values()))

    def break_reasons(self) -> List[str]:
        return sorted(self._counters()["graph_break"])

    @staticmethod
    def seconds() -> float:
        """Seconds dynamo spent compiling (tracing, AOT autograd, the backend), all graphs."""
        from torch._dynamo.utils import compilation_time_metrics
        return float(sum(sum(v) for k, v in compilation_time_metrics.items()
                         if k.endswith("compile_inner") or k == "_compile.<locals>.compile_inner"))

    def line(self) -> str:
        mode = f", mode {self.mode}" if self.mode else ""
        if self.graphs == 0:          # dynamo gave up on every frame: the layers ran as written
            reasons = self.break_reasons()
            why = reasons[0].strip().splitlines()[0] if reasons else "no frame traced"
            return (f"[minipar] torch.compile ({self.backend}{mode}) of {self.layers} decoder layers "
                    f"compiled nothing: the layers run eagerly ({why}; e.g. a graph boundary inside a "
                    f"checkpointed layer: packed documents at cp 1 with gradient_checkpointing)")
        return (f"[minipar] torch.compile ({self.backend}{mode}) of {self.layers} decoder layers: "
                f"{self.graphs} graphs, {self.graph_breaks} graph breaks (the collectives' "
                f"boundaries), {self.seconds():.1f} s compiling")

    def report_once(self, echo: Callable[[str], None]) -> None:
        """Print the line after the first step (compilation happens in it), once per run."""
        if not self.reported:
            self.reported = True
            echo(self.line())


def _checkpointed(policy, forward):
    """The layer's forward under its checkpointing policy, as one function dynamo traces whole."""
    def run(*inputs):
        return policy(forward, *inputs)
    return run


def compile_layers(layers, backend: str = "inductor", mode: Optional[str] = None,
                   checkpointing=None, boundaries: bool = False) -> Tuple[CompileStats, bool]:
    """Compile each decoder layer's forward in place (the module call and its hooks stay eager).
    Returns the stats and whether `checkpointing` (the model's ActivationCheckpointing, or False)
    was moved INSIDE the compiled regions, in which case the caller must stop applying it. It is
    moved where the layer traces whole (boundaries False: torch's checkpoint operator cannot hold
    a graph break); otherwise it stays around the module call, eager, and its recompute runs the
    compiled forward again."""
    mode_name = getattr(checkpointing, "mode", False) if checkpointing else False
    problem = check_compile(True, backend, mode, checkpointing=mode_name,
                            selective_ac_option=getattr(checkpointing, "option", "op"), boundaries=boundaries)
    if problem:
        raise ValueError(problem)
    layers = list(layers)
    inside = bool(checkpointing) and not boundaries
    for layer in layers:
        forward = layer.forward                   # the bound eager forward
        if inside and checkpointing.applies(layer.layer_idx):
            forward = _checkpointed(checkpointing, forward)
        layer.forward = torch.compile(forward, backend=backend, mode=mode, dynamic=False)
    return CompileStats(backend, mode, len(layers)), inside
