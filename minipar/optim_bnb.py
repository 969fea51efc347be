"""The optimizer a config names: torch's AdamW (optim.py) or bitsandbytes' 8-bit and paged ones, by
the HF Trainer's `optim` names (Axolotl's `optimizer:`), with minipar's weight-decay rule on every
layout.

8-bit block-wise states (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022).
AdamW keeps two fp32 moments per parameter, 8 bytes, twice the fp32 weight itself. bitsandbytes
stores each moment as one uint8 code per element plus one fp32 scale (absmax) per block of 256
consecutive elements: value = code_table[q] x absmax. The code table is "dynamic": an exponent and
a fraction packed in 8 bits, so a small moment keeps its relative precision beside a large one in
the same block (signed for the first moment, unsigned for the second). Each step dequantises a
block, updates it in fp32 and quantises it again with its new absmax (in registers, on a GPU).

    optimizer              moments   bytes per parameter (n >= 4096)       fp32 states
    adamw_bnb_8bit         2         2 x (1 + 4 / 256) = 2.03              8
    lion_8bit              1         1 + 4 / 256       = 1.02              4
    ademamix_8bit          3         3.05                                  12

Tensors under 4096 elements (bitsandbytes' min_8bit_size: norms, biases) keep fp32 states, and the
two code tables are 2 KiB in all; `state_bytes` counts it as the optimizers allocate it, for the
planner (plan/model.py). The 32-bit names keep bitsandbytes' fp32 states.

Paged optimizers keep their states (tensors of 1e5 elements or more) in CUDA unified memory, which
the driver moves to host RAM when the GPU runs short and back when a step touches them: a memory
spike pages out instead of failing. Without CUDA there is nothing to page: the same optimizer runs
unpaged, with one note in the run's header.

minipar's rules around them (the class `build` makes: the mixin _MiniparDecay before bitsandbytes'):
  - weight decay: optim.decay_ (p <- p x (1 - lr x wd), matrices only, ZeRO-3's no_decay_segments)
    before bitsandbytes' update, which runs at weight_decay 0; its own decay of AdamW, Lion and
    AdEMAMix is the same p x (1 - lr x wd), so 1-D tensors, shards and LoRA decay as adamw_torch's;
  - a ZeRO-3 flat shard is ONE tensor to bitsandbytes: its blocks straddle the unit's tensors, and
    each layout cuts the blocks differently (the quantisation error differs by layout, within a
    code step; tests/test_optim_bnb.py measures it);
  - checkpoints hold the moments dequantised, shaped like their parameter (optim_8bit_state.py):
    resumable on any layout, and by adamw_torch.
  The HF Trainer keeps nn.Embedding states in 32-bit (GlobalOptimManager overrides); minipar keeps
  one rule for every tensor, bitsandbytes' own (8-bit from 4096 elements). On a GPU bitsandbytes
  synchronises the device after each tensor's update (Optimizer8bit.step's sync_gpu): one host
  sync per local tensor per step that torch's AdamW does not make (few under ZeRO-3: one per unit).

bitsandbytes is optional (pip install bitsandbytes, or the project's extra: pip install -e .[bnb]).
A config naming one of its optimizers where it is not installed is refused in the config's one
message with the line to write instead; imported only when an optimizer is built (its import
takes seconds: it pulls in torch._dynamo).
"""
from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .optim import OPTIMIZERS, DecayThenStep, build_optimizer, decay_group, resume_group, trainable
from .optim_8bit_state import BLOCK, MOMENTS, PortableState, bnb_state

MIN_8BIT_SIZE = 4096        # bitsandbytes' default min_8bit_size: smaller tensors keep fp32 states
INSTEAD = ("write optimizer: adamw_torch_fused (torch's fused AdamW; Axolotl's default) or optimizer: "
           "adamw_torch")


@dataclass(frozen=True)
class BnbSpec:
    kind: str        # "adam" (bnb.optim.AdamW), "lion" (Lion), "ademamix" (AdEMAMix)
    bits: int        # 8: block-wise 8-bit states; 32: fp32 states
    paged: bool      # states in CUDA unified memory

    def unpaged(self) -> str:
        """The name of the same optimizer unpaged (paged_adamw_32bit has none in HF's list)."""
        same = [n for n, s in BNB_OPTIMIZERS.items() if s == BnbSpec(self.kind, self.bits, False)]
        return same[0] if same else f"bitsandbytes' {self.bits}-bit {CLASSES[self.kind]}"


CLASSES = {"adam": "AdamW", "lion": "Lion", "ademamix": "AdEMAMix"}     # bnb.optim's, by kind
# the HF Trainer's names (transformers' OptimizerNames) for bitsandbytes, and what each builds
BNB_OPTIMIZERS = {
    "adamw_bnb_8bit": BnbSpec("adam", 8, False), "adamw_8bit": BnbSpec("adam", 8, False),
    "paged_adamw_8bit": BnbSpec("adam", 8, True), "paged_adamw_32bit": BnbSpec("adam", 32, True),
    "lion_8bit": BnbSpec("lion", 8, False), "lion_32bit": BnbSpec("lion", 32, False),
    "paged_lion_8bit": BnbSpec("lion", 8, True), "paged_lion_32bit": BnbSpec("lion", 32, True),
    "ademamix": BnbSpec("ademamix", 32, False), "ademamix_8bit": BnbSpec("ademamix", 8, False),
    "paged_ademamix_8bit": BnbSpec("ademamix", 8, True),
    "paged_ademamix_32bit": BnbSpec("ademamix", 32, True),
}
# names people write for other libraries' low-bit optimizers, and the one to write here
OTHER_LOW_BIT = {"adamw_torch_8bit": "torchao", "ao_adamw_8bit": "torchao", "ao_adamw_4bit": "torchao",
                 "adamw_torch_4bit": "torchao", "ao_adamw_fp8": "torchao"}


def bnb_installed() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def optimizer_problem(name: str) -> Optional[str]:
    """Why `name` cannot be this run's optimizer (None: it can), in the words of the config's message."""
    if name in OPTIMIZERS:
        return None
    if name in BNB_OPTIMIZERS:
        if bnb_installed():
            return None
        return (f"optimizer {name!r} is not supported: it needs bitsandbytes (not installed here): pip "
                f"install bitsandbytes (or pip install -e .[bnb]), or {INSTEAD}")
    if name in OTHER_LOW_BIT:
        return (f"optimizer {name!r} is not supported: it is {OTHER_LOW_BIT[name]}'s, which minipar does "
                f"not use; for 8-bit states write optimizer: adamw_bnb_8bit (bitsandbytes), or {INSTEAD}")
    close = difflib.get_close_matches(str(name), [*OPTIMIZERS, *BNB_OPTIMIZERS], n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (f"optimizer {name!r} is not supported; supported: {list(OPTIMIZERS)} and, with bitsandbytes, "
            f"{list(BNB_OPTIMIZERS)}; {INSTEAD}.{hint}")


def state_bytes(name: str, numels: Sequence[int]) -> int:
    """Bytes of optimizer state for tensors of these sizes, as optimizer `name` allocates them:
    torch's AdamW 8 per element + its 4-byte step tensor per tensor; bitsandbytes' 1 per element per
    moment + 4 per block of 256 (8-bit, n >= 4096), else 4 per element per moment (its step is a
    Python int), + the code tables (256 fp32 each) once."""
    spec = BNB_OPTIMIZERS.get(name)
    if spec is None:
        return sum(8 * n + 4 for n in numels)
    k, total, tables = len(MOMENTS[spec.kind]), 0, set()
    for n in numels:
        if spec.bits == 8 and n >= MIN_8BIT_SIZE:
            total += k * (n + 4 * -(-n // BLOCK))
            tables |= {table for *_, table in MOMENTS[spec.kind]}
        else:
            total += 4 * k * n
    return total + 4 * 256 * len(tables)


class _MiniparDecay(DecayThenStep):
    """Put before a bitsandbytes optimizer class: minipar's decay, then its update at weight_decay 0;
    its state read and loaded in the portable form (optim_8bit_state.py)."""
    kind = "adam"

    def portable_state(self) -> PortableState:
        return PortableState(self)

    def load_state_dict(self, state_dict, move_to_device=True):
        """bitsandbytes' own state dict, or the portable one a checkpoint holds (moments by torch's
        names, as trainer/checkpoint/save_load.py hands it), quantised into this optimizer's blocks."""
        states = state_dict["state"].values()
        if not any(k in st for st in states for k in ("exp_avg", "exp_avg_sq")):
            return super().load_state_dict(state_dict, move_to_device)
        groups = [resume_group(g, saved) for g, saved in zip(self.param_groups, state_dict["param_groups"])]
        for g, saved in zip(groups, state_dict["param_groups"]):
            g["params"] = saved["params"]
        super().load_state_dict(dict(state={}, param_groups=groups), move_to_device)
        where = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])]
        for i, saved in state_dict["state"].items():
            gi, pi, p = where[i]
            self.state[p] = bnb_state(self, p, self.get_config(gi, pi, self.param_groups[gi]), saved)


def _bnb_class(spec: BnbSpec):
    import bitsandbytes as bnb  # optional, and seconds to import: only when one is built
    base = getattr(bnb.optim, CLASSES[spec.kind])
    return type(f"Minipar{base.__name__}", (_MiniparDecay, base), dict(kind=spec.kind))


def _bnb_kwargs(spec: BnbSpec, lr, betas, eps, paged) -> dict:
    """The HF Trainer's arguments (transformers' _get_bitsandbytes_optimizer): AdamW takes
    adam_beta1/2 and adam_epsilon; Lion the two betas only; AdEMAMix beta3 0.9999 and alpha 5.0
    (optim_args' defaults; minipar refuses optim_args)."""
    kwargs = dict(lr=lr, weight_decay=0.0, optim_bits=spec.bits, is_paged=paged)
    if spec.kind == "adam":
        return dict(kwargs, betas=tuple(betas), eps=eps)
    if spec.kind == "lion":
        return dict(kwargs, betas=tuple(betas))
    return dict(kwargs, betas=(*betas, 0.9999), alpha=5.0, eps=eps)


def device_problem(name: str, device: torch.device) -> Optional[str]:
    """Why bitsandbytes cannot run optimizer `name` on `device` (None: it can): one 8-bit step of a
    small tensor there, before the model is built, so a broken install is one line, not a crash
    after the first step."""
    spec = BNB_OPTIMIZERS.get(name)
    if spec is None:
        return None
    try:
        p = torch.nn.Parameter(torch.zeros(MIN_8BIT_SIZE, device=device))
        p.grad = torch.ones_like(p)
        _bnb_class(spec)([p], **_bnb_kwargs(spec, 1e-3, (0.9, 0.999), 1e-8, False)).step()
    except Exception as err:       # noqa: BLE001 - whatever bitsandbytes raises, said in one line
        return (f"optimizer {name!r}: bitsandbytes cannot step on {device} ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); {INSTEAD}")
    return None


def build_named_optimizer(model_or_params, name: str, lr: float, weight_decay: float,
                          betas: Tuple[float, float], eps: float,
                          device: torch.device) -> Tuple[torch.optim.Optimizer, List[str]]:
    """(the optimizer `name` over the trainable parameters, one group, minipar's decay; the notes
    for the run's header). adamw_torch_fused: torch's fused kernel."""
    if name in OPTIMIZERS:
        fused = dict(fused=True) if name == "adamw_torch_fused" else {}
        return build_optimizer(model_or_params, lr, weight_decay, betas, eps, **fused), []
    problem = optimizer_problem(name)
    if problem:
        raise ValueError(problem)
    if lr <= 0 or weight_decay < 0:
        raise ValueError(f"learning_rate must be > 0 (got {lr}) and weight_decay >= 0 (got {weight_decay})")
    spec, notes = BNB_OPTIMIZERS[name], []
    paged = spec.paged and device.type == "cuda"
    if spec.paged and not paged:
        notes.append(f"optimizer: {name}: paging moves optimizer states through CUDA unified memory, and "
                     f"this run is on {device.type}: it runs {spec.unpaged()} (the same update and "
                     f"states, unpaged)")
    group = decay_group(trainable(model_or_params), weight_decay)
    return _bnb_class(spec)([group], **_bnb_kwargs(spec, lr, betas, eps, paged)), notes
