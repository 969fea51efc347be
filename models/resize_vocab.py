"""A base model's vocabulary resized to its tokenizer's: the rows of the token embedding (and of an
untied lm_head) for tokens a run adds (Axolotl's special_tokens / tokens), as transformers'
`resize_token_embeddings(n, mean_resizing=...)` makes them, but read straight into each rank's slice.

    old rows   0 .. V_old-1         copied from the checkpoint
    new rows   V_old .. V_new-1     mean_resizing true:  the mean of the old rows (fp32), every new row
                                    mean_resizing false: N(0, initializer_range), transformers' own
                                    initialisation (Axolotl's default, mean_resizing_embeddings: false)
    shrunk     V_new < V_old        the first V_new rows (Axolotl's shrink_embeddings)

transformers' mean resizing samples the new rows from N(mean, 1e-9 x the rows' covariance), i.e.
the mean plus noise of about 3e-5 of the rows' spread; here every new row is the mean itself, the
same on every rank and layout without a shared draw. The N(0, std) rows are drawn from a generator
seeded by (seed, tensor), one full (V_new - V_old, d) block, then sliced: the same rows on every
layout too.

A weight source (models/llama_init.py) answers one parameter at a time; ResizedSource answers the
two vocabulary tensors itself and passes every other one to the checkpoint's reader:

    tp_local("model.embed_tokens.weight", (V_new, d), dim 0)
        old = the whole (V_old, d) tensor from the file    every new row needs the mean of all
        full = cat(old, new rows)                          (V_new, d)
        -> full.chunk(tp, 0)[tp_rank]                      this rank's vocabulary rows

So a rank holds one full embedding in flight, as it does any tensor it reads (ZeRO-3 asks only the
ranks whose flat shard overlaps it). No communication: every rank computes the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from minipar.tensor_parallel import shard_tensor

# the parameters whose first dimension is the vocabulary (minipar's names = the Hub's for these)
VOCAB_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class VocabResize:
    """V_old -> V_new rows, the new ones the mean (mean=True) or N(0, std) drawn from `seed`."""
    old: int
    new: int
    mean: bool = False
    std: float = 0.02
    seed: int = 0

    def file_shape(self, name: str, shape: tuple) -> tuple:
        """The shape of `name` in the checkpoint, for the model's shape `shape`."""
        return (self.old, *shape[1:]) if name in VOCAB_PARAMS else tuple(shape)

    def grow(self, name: str, old: torch.Tensor) -> torch.Tensor:
        """The full (new, d) tensor from the full (old, d) one, in float32."""
        old = old.float()
        if self.new <= self.old:
            return old[: self.new].clone()
        added = self.new - self.old
        if self.mean:
            rows = old.mean(dim=0, keepdim=True).expand(added, -1)
        else:
            gen = torch.Generator().manual_seed(self.seed * 1000003 + VOCAB_PARAMS.index(name) + 1)
            rows = torch.empty(added, old.shape[1]).normal_(0.0, self.std, generator=gen)
        return torch.cat([old, rows.to(old.device)])

    def wrap(self, source, tp) -> "ResizedSource":
        return ResizedSource(source, self, tp)


class ResizedSource:
    """A weight source whose vocabulary tensors have VocabResize's rows; the rest are `inner`'s."""

    def __init__(self, inner, resize: VocabResize, tp):
        self.inner, self.resize, self.tp = inner, resize, tp
        self.device = inner.device

    @property
    def bytes_read(self) -> int:
        return getattr(self.inner, "bytes_read", 0)

    def tp_local(self, name: str, full_shape, tp_split_dim: Optional[int], experts=None) -> torch.Tensor:
        if name not in VOCAB_PARAMS:
            return self.inner.tp_local(name, full_shape, tp_split_dim, experts=experts)
        if tuple(full_shape)[0] != self.resize.new:
            raise ValueError(f"{name}: the model asks for {tuple(full_shape)}, the resized vocabulary has "
                             f"{self.resize.new} rows")
        old = self.inner.tp_local(name, self.resize.file_shape(name, tuple(full_shape)), None)
        return shard_tensor(self.resize.grow(name, old), tp_split_dim, self.tp).to(self.device)
