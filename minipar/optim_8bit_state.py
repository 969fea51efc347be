"""bitsandbytes' optimizer states as checkpoints store them: fp32 moments under torch's names, shaped
like their parameter, and quantised back into blocks on load (optim_bnb.py builds the optimizers).

A block-wise 8-bit state (Dettmers et al., 2022) of a tensor of n elements is

    q       uint8, shaped like the parameter: one code index per element
    absmax  fp32 (ceil(n / 256),): the largest |value| of each block of 256 consecutive elements
    code    fp32 (256,): the code table, sorted; bnb's "dynamic" map (signed, for a first moment:
            -0.993 ... 1.0) or its unsigned twin (for a second moment: 0 ... 1.0)

    value[i] = code[q[i]] * absmax[i // 256]                                   (dequantise)
    q[i]     = the code nearest value[i] / absmax[i // 256]                    (quantise)

The blocks run along the tensor's flat view, so they depend on how a layout cuts it: a ZeRO-3
flat shard's blocks straddle the boundaries of its unit's tensors, a TP slice's start elsewhere.
minipar's checkpoints place every state by the segments of its parameter (trainer/checkpoint/
layout.py), so a state must be shaped like its parameter: the portable form is the dequantised
moments, `exp_avg`, `exp_avg_sq` (AdamW, torch's names), `exp_avg` (Lion), `exp_avg`,
`exp_avg_slow`, `exp_avg_sq` (AdEMAMix: its fast and slow first moments and its second), plus
`step`. A checkpoint is then the same on every layout, for either kind of optimizer: adamw_torch
reads an adamw_bnb_8bit one and the other way round.

Loading quantises the fp32 moments again. On the layout that saved them every block is found whole
and its dequantised values are reproduced EXACTLY: the block's largest |value| is code[j] x absmax
for a code of largest magnitude, +1.0, or -0.993 in the signed map (which has no -1), so absmax is
that value / 1.0 or / 0.993, give or take an ulp, and the one candidate that gives back every value
of the block is kept; the resumed run continues bit for bit. On another layout the blocks are cut
elsewhere and are quantised as bitsandbytes does (absmax = the largest |value|): each value moves by
at most half the gap between neighbouring codes at its magnitude, the error one optimizer step of
bnb makes anyway. Tensors bitsandbytes keeps in fp32 (32-bit optimizers, tensors under its
min_8bit_size) are copied as they are. No communication; on a GPU the work stays on the device.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, Iterator, List, Optional, Tuple

import torch

BLOCK = 256          # bitsandbytes' block for optimizer states (functional.py's blocksize)

# each kind's moments: (torch's name, bnb's state key, index into a stacked state or None,
# its absmax key, its code table's name in bnb's name2qmap)
MOMENTS: Dict[str, List[Tuple[str, str, Optional[int], str, str]]] = {
    "adam": [("exp_avg", "state1", None, "absmax1", "dynamic"),
             ("exp_avg_sq", "state2", None, "absmax2", "udynamic")],
    "lion": [("exp_avg", "state1", None, "absmax1", "dynamic")],
    "ademamix": [("exp_avg", "state1", 0, "absmax1", "dynamic"),
                 ("exp_avg_slow", "state1", 1, "absmax1", "dynamic"),
                 ("exp_avg_sq", "state2", None, "absmax2", "udynamic")],
}


def dequantise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """fp32 values shaped like q: code[q] x its block's absmax (bitsandbytes' own arithmetic)."""
    n = q.numel()
    blocks = absmax.numel()
    codes = code.to(q.device)[q.reshape(-1).long()]
    codes = torch.nn.functional.pad(codes, (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    return (codes * absmax.to(q.device).view(-1, 1)).reshape(-1)[:n].view(q.shape)


def _nearest(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The index of the nearest entry of `code` for every element of x."""
    order = torch.argsort(code)
    ordered = code[order]
    return order[torch.bucketize(x, (ordered[1:] + ordered[:-1]) / 2)]


def quantise(values: torch.Tensor, code: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q uint8 shaped like values, absmax fp32 per block) of fp32 values; a block that is the
    dequantisation of some (q, absmax) under this code is given back exactly (see the docstring)."""
    n = values.numel()
    blocks = -(-n // BLOCK)
    x = torch.nn.functional.pad(values.reshape(-1).float(), (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    code = code.to(x.device)
    top = x.abs().amax(dim=1)

    def attempt(absmax):
        scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax)).view(-1, 1)
        q = _nearest(x / scale, code)
        return q, (code[q] * absmax.view(-1, 1) == x).all(dim=1)

    q, absmax = attempt(top)[0], top.clone()             # bitsandbytes' rule: absmax = the largest |value|
    found = torch.zeros(blocks, dtype=torch.bool, device=x.device)
    for largest in (code.max(), -code.min()):              # 1.0, and the signed map's 0.993
        if largest <= 0:
            continue
        guess = top / largest
        for cand in (guess, torch.nextafter(guess, guess + 1), torch.nextafter(guess, guess - 1)):
            cq, exact = attempt(cand)
            take = exact & ~found
            q[take], absmax[take] = cq[take], cand[take]
            found |= exact
    return q.reshape(-1)[:n].to(torch.uint8).view(values.shape), absmax


def portable_moments(kind: str, state: dict, like: torch.Tensor) -> dict:
    """One parameter's bnb state -> {torch's name: fp32 tensor shaped like it, "step": float}."""
    out = {"step": float(state["step"])}
    for name, key, index, absmax, _ in MOMENTS[kind]:
        s = state[key] if index is None else state[key][index]
        if s.dtype == torch.uint8:
            a = state[absmax] if index is None else state[absmax][index]
            qmap = state["qmap1" if absmax == "absmax1" else "qmap2"]
            out[name] = dequantise(s, a, qmap).to(like.device).view(like.shape)
        else:
            out[name] = s.to(like.device).view(like.shape)
    return out


class PortableState(Mapping):
    """{param: its portable moments} of a bnb optimizer, each dequantised when asked for (one
    parameter's fp32 moments at a time, not the whole model's)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def _stepped(self) -> Iterator[torch.Tensor]:
        return (p for p, st in self.optimizer.state.items() if st)

    def __getitem__(self, p):
        st = self.optimizer.state.get(p)
        if not st:
            raise KeyError(p)
        return portable_moments(self.optimizer.kind, st, p)

    def __iter__(self):
        return self._stepped()

    def __len__(self):
        return sum(1 for _ in self._stepped())


def bnb_state(optimizer, p: torch.Tensor, config: dict, saved: dict) -> dict:
    """The bnb state of parameter p from its portable moments (`saved`, any device), in buffers as
    the optimizer's init_state makes them (paged ones on CUDA): 8-bit where bitsandbytes would
    make it 8-bit (optim_bits 8 and at least min_8bit_size elements), else fp32."""
    kind = optimizer.kind
    missing = [name for name, *_ in MOMENTS[kind] if name not in saved]
    if missing:
        raise ValueError(f"the checkpoint's optimizer state has {sorted(k for k in saved if k != 'step')}, "
                         f"not {missing}, which {type(optimizer).__name__} needs: it was saved by another "
                         f"kind of optimizer; resume with that optimizer, or load the model only")
    eight = config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]
    dtype = torch.uint8 if eight else torch.float32
    state = {"step": int(round(float(saved["step"])))}
    stacked = kind == "ademamix"
    state["state1"] = (optimizer._get_state_double_buffer(p, dtype=dtype) if stacked
                       else optimizer.get_state_buffer(p, dtype=dtype))
    if len(MOMENTS[kind]) > 1:
        state["state2"] = optimizer.get_state_buffer(p, dtype=dtype)
    if eight:
        if "dynamic" not in optimizer.name2qmap:
            optimizer.fill_qmap()
        absmax: Dict[str, list] = {}
        for name, key, index, akey, table in MOMENTS[kind]:
            code = optimizer.name2qmap[table] = optimizer.name2qmap[table].to(p.device)
            state["qmap1" if akey == "absmax1" else "qmap2"] = code
            q, a = quantise(saved[name].to(p.device).reshape(-1), code)
            (state[key] if index is None else state[key][index]).copy_(q.view(p.shape))
            absmax.setdefault(akey, []).append(a)
        for akey, parts in absmax.items():
            state[akey] = torch.stack(parts) if stacked and akey == "absmax1" else parts[0]
    else:
        for name, key, index, *_ in MOMENTS[kind]:
            (state[key] if index is None else state[key][index]).copy_(
                saved[name].to(torch.float32).view(p.shape))
    return state
