"""Activation checkpointing of the decoder layers: full, or selective (torchtitan's two kinds).

Backward needs what forward computed; autograd keeps it (the saved tensors) from a layer's forward
to its backward, so without checkpointing a micro-batch holds every layer's activations at once
(minipar/plan/activation_bytes.py counts them). Checkpointing trades that memory for recomputation:

    full                   each layer keeps only its input h (e n d bytes: n tokens, hidden d, e
                           bytes per element) and runs its forward again in backward: a third more
                           FLOPs (a forward is 2 of the 6 per weight and token)
    selective, op          per operation: the outputs of the matmuls (q, k, v, o, gate, up, down)
                           and of attention (its output and log-sum-exp) are kept, everything else
                           (the norms' fp32 copies, RoPE, the KV repeat, SiLU and its product, the
                           residual adds) is recomputed in backward. The recompute is the cheap,
                           memory-bound part (no matmul runs twice), the memory per layer is about
                           half of keeping everything (a layer of SmolLM-135M, 256 tokens, fp32:
                           6.5 MB of 12.2 MB; full keeps 0.6 MB; minipar/plan/activation_bytes.py's counts)
    selective, n (an int)  every n-th layer (layers n-1, 2n-1, ... counted from 0) fully
                           checkpointed, the others keep everything: 1/n of full's recompute

This is torchtitan's `activation_checkpoint.mode: full | selective` with `selective_ac_option: op`
or an integer. torchtitan's op policy also recomputes every second matmul; this one keeps all
of them, as Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models",
2022) keep the matmul outputs and recompute what is cheap to recompute.

The op policy is torch.utils.checkpoint's selective checkpointing (create_selective_checkpoint_
contexts, torch >= 2.4): in forward a dispatch mode sees every aten op of the layer and caches the
outputs of those marked MUST_SAVE; the recompute in backward runs the layer again and takes the
cached outputs instead of running those ops. Collectives are not in the list: a cached in-place
all-reduce would be skipped, so they run again, exactly as under full checkpointing (the comm
ledger sees the same calls). Where torch lacks the API, `selective` is refused before any collective.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

import torch
import torch.utils.checkpoint as tuc

MODES = ("full", "selective")


def _aten_ops(*names):
    """The default overloads of these aten ops that this torch has (kernels come and go by version)."""
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}


# what the op policy keeps: matmuls (F.linear is mm or addmm below autograd; bmm in attention's
# math path) and the fused attention kernels of every backend
SAVED_OPS = _aten_ops("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                      "_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                      "_flash_attention_forward", "_efficient_attention_forward")


def selective_supported() -> bool:
    return hasattr(tuc, "create_selective_checkpoint_contexts") and hasattr(tuc, "CheckpointPolicy")


def check_option(mode, option) -> str:
    """Why (mode, option) cannot run, or '' (the config check calls it on every rank)."""
    if mode not in MODES:
        return f"gradient_checkpointing must be true, false or selective, got {mode!r}"
    if mode == "selective":
        if not (option == "op" or (isinstance(option, int) and not isinstance(option, bool) and option >= 1)):
            return (f"selective_ac_option must be op (keep matmul and attention outputs) or an integer "
                    f"n >= 1 (checkpoint every n-th layer), got {option!r}")
        if option == "op" and not selective_supported():
            return (f"gradient_checkpointing: selective with selective_ac_option op needs torch >= 2.4 "
                    f"(torch.utils.checkpoint.create_selective_checkpoint_contexts); this is torch "
                    f"{torch.__version__}: upgrade, or use an integer selective_ac_option or true")
    return ""


def _policy(ctx, op, *args, **kwargs):
    return tuc.CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else tuc.CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class ActivationCheckpointing:
    """How run_layers checkpoints a decoder layer: mode full or selective, option op or n."""
    mode: str = "full"
    option: Union[str, int] = "op"

    def __post_init__(self):
        problem = check_option(self.mode, self.option)
        if problem:
            raise ValueError(problem)

    def applies(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` (its index in the whole model) is checkpointed at all."""
        if self.mode == "selective" and self.option != "op":
            return (layer_idx + 1) % self.option == 0
        return True

    def __call__(self, layer, *inputs):
        """The layer's output, its activations kept as this policy says."""
        if self.mode == "selective" and self.option == "op":
            context = functools.partial(tuc.create_selective_checkpoint_contexts, _policy)
            return tuc.checkpoint(layer, *inputs, use_reentrant=False, context_fn=context)
        return tuc.checkpoint(layer, *inputs, use_reentrant=False)
