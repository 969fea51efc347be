"""Choosing the next token from the logits: greedy, or a draw after temperature, top-k and top-p.

    logits (b, V) fp32  ->  / temperature  ->  top-k  ->  top-p  ->  softmax  ->  multinomial  -> (b,)
                        ->  argmax (greedy: do_sample false)                                    -> (b,)

The same operations in the same order as transformers' generate (its TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, then `torch.multinomial(softmax(scores), 1)`), so that the
same seed draws the same tokens from the same logits:

  temperature  scores / T: below 1 sharpens the distribution, above 1 flattens it
  top-k        every score below the k-th largest set to -inf (ties at the k-th kept)
  top-p        nucleus (Holtzman et al. 2019): sorted ascending, the smallest tokens whose
               cumulative probability stays <= 1 - p removed; the most likely token always kept

The draw uses a torch.Generator seeded once per generate call (`seed`), never the global RNG; on tp
ranks every rank holds the same gathered logits and the same generator, so every rank draws the
same token without a collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Sampling:
    do_sample: bool = False        # False: greedy (argmax)
    temperature: float = 1.0
    top_k: int = 0                 # 0: off
    top_p: float = 1.0             # 1.0: off
    seed: int = 0

    def check(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature} (for greedy decoding "
                             f"leave do_sample off)")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off), got {self.top_p}")


def warp(scores: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The scores a draw is made from: temperature, top-k, top-p (transformers' order), as -inf."""
    if s.temperature != 1.0:
        scores = scores / s.temperature
    if s.top_k:
        k = min(s.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if s.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - s.top_p)
        remove[..., -1:] = False                               # the most likely token stays
        scores = scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))
    return scores


def next_tokens(logits: torch.Tensor, s: Sampling, generator: Optional[torch.Generator]) -> torch.Tensor:
    """(b,) token ids from the last position's logits (b, V)."""
    logits = logits.float()
    if not s.do_sample:
        return logits.argmax(dim=-1)
    probs = torch.softmax(warp(logits, s), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
