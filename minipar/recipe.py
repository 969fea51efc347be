"""The recipe: how the techniques are applied, beyond the grid's sizes (those are pgm.config's).

minipar/compose.py's build() reads it: the compute dtype (bf16 autocast, or ZeRO-3's gathered
bf16 weights), the seed every layout draws the same weights from, LoRA's settings, activation
checkpointing, the pipeline schedule and its cut, ZeRO-3's prefetch and resharding, DDP's form,
and regional compile. The trainer fills it from its config (TrainConfig.recipe()); a caller of
minipar.api.prepare fills it by hand. check() says everything wrong with one at once, before
anything is built. Nothing here communicates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

from minipar.pipeline_parallel import SCHEDULES, chunks_per_rank


@dataclass
class LoRA:
    """LoRA's settings (Axolotl's lora_* keys): rank, scale alpha / r, dropout, the projections."""
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Sequence[str] = ()
    target_linear: bool = True        # every linear of the layers when no module is named
    model_dir: Optional[str] = None   # adapters saved by PEFT (or minipar) to start from


@dataclass
class Recipe:
    """How the techniques are applied beyond the grid's sizes (those are pgm.config's)."""
    dtype: str = "float32"                       # or bfloat16: autocast, or ZeRO-3's param dtype
    seed: int = 42                               # the weights drawn from it, the same on every layout
    lora: Optional[LoRA] = None
    gradient_checkpointing: Union[bool, str] = False      # True (full) or "selective"
    selective_ac_option: Union[str, int] = "op"           # selective: per op, or every n-th layer
    pipeline_schedule: str = "1f1b"              # afab, 1f1b, interleaved_1f1b, zb_h1, zbv
    pipeline_virtual_stages: Optional[int] = None  # chunks per rank (None: the schedule's)
    pipeline_layers: Optional[List[int]] = None  # layers per virtual stage (None: even split)
    zero3_prefetch: int = 1                      # units gathered ahead of the one running
    reshard_after_forward: bool = True           # free a unit's gathered weights after its forward
    sync_each_batch: bool = True                 # ZeRO-3 reduce-scatters every micro-batch (or once)
    ddp: str = "bucketed"                        # or naive (one all-reduce per parameter)
    compile: bool = False                        # torch.compile each decoder layer (regional_compile.py)
    compile_backend: str = "inductor"            # or aot_eager, eager (no kernels: fast to compile)
    compile_mode: Optional[str] = None           # inductor's mode: default, reduce-overhead, max-autotune

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    def check(self) -> "Recipe":
        """Every wrong setting in one ValueError, before anything is built (the trainer's config
        checks these already; a caller of api.prepare meets them here)."""
        wrong = [f"{name}={getattr(self, name)!r} (use one of {', '.join(map(repr, allowed))})"
                 for name, allowed in (("dtype", ("float32", "bfloat16")), ("ddp", ("bucketed", "naive")),
                                       ("pipeline_schedule", SCHEDULES),
                                       ("gradient_checkpointing", (False, True, "full", "selective")))
                 if getattr(self, name) not in allowed]
        if self.zero3_prefetch < 0:
            wrong.append(f"zero3_prefetch={self.zero3_prefetch} (use 0 or more)")
        if wrong:
            raise ValueError(f"{len(wrong)} composition setting(s) wrong: " + "; ".join(wrong))
        return self

    @property
    def chunks(self) -> int:
        return chunks_per_rank(self.pipeline_schedule, self.pipeline_virtual_stages)
