"""ZeRO-3's state-dict side: full tensors <-> this rank's shards, for every unit of a model.

    sd = ShardedStateDicts(model.zero3)     a view made by its user (the model's full_state_dict,
                                            the checkpoint, an export), not by the manager: ZeRO-3's
                                            own path (wrap.py, shard_manager.py) never needs it

No rank holds a full parameter after fully_shard: rank r of the N ranks of dp_shard_cp keeps
shard r of each unit's padded flat buffer (unit.py's FlatLayout), and within it only its tp
slice (an expert: its ep block). A full state dict (what save_pretrained writes, what an HF
checkpoint gives) is therefore a collective to build and a local cut to load; the tp and ep cuts
are those techniques' own helpers (tensor_parallel/layers.py's shard_tensor / gather_tensor,
expert_parallel/sharding.py's ep_shard / ep_gather), on each slot's tp_split_dim and ep_split_dim:

    full_from_shards   shards --all-gather over dp_shard_cp--> flat buffers --split, all-gather
                       over tp--> {HF name: full tensor}; every rank of dp_shard_cp and tp calls it
    iter_full          the same, one (name, full tensor) at a time: one unit gathered at once, each
                       full tensor handed out as soon as it exists (an export streams them to the host)
    shards_from_full   {HF name: full tensor} --tp slice, flatten, cut [start, stop)--> shards; local

Both take any shard-shaped tensors, not just the weights: the checkpoint converts the optimizer's
exp_avg and exp_avg_sq the same way. A sharded state dict is the other way to save: each rank's
shards as they are, plus the layout (name, TP-local shape, offset, tp_split_dim, full shape per
tensor) that lets trainer/checkpoint/layout.py place them into any other layout on load.

Communication: full_from_shards all-gathers every unit's padded buffer over dp_shard_cp once (P
elements of the shard dtype, wire (N-1)/N of that), then each tp-split tensor over tp (an experts
unit: over edp, then each expert tensor over ep); the other three methods communicate nothing.
"""
from __future__ import annotations

from typing import Dict

import torch

from .. import comm
from ..expert_parallel.sharding import ep_gather, ep_shard
from ..tensor_parallel.layers import gather_tensor, shard_tensor
from .unit import FlatLayout, Unit

FORMAT = "minipar.zero3.v1"        # sharded_state_dict's tag: checkpoints say which layout they hold


def gather_flat(shard: torch.Tensor, dim) -> torch.Tensor:
    """The whole padded flat buffer from every rank's shard (all-gather over the shard group)."""
    return comm.all_gather(shard.detach().contiguous(), dim)


def full_items(layout: FlatLayout, flat: torch.Tensor, tp, ep=None):
    """(name, full tensor) for each slot of a gathered (unsharded) flat buffer, each gathered over
    tp (and an expert over ep) only when asked for (collective: every tp and ep rank must take
    every item). A full tensor never shares the flat buffer's memory (a slot nothing was gathered
    for is copied out), so keeping one does not keep the unit alive."""
    for s in layout.slots:
        local = flat[s.offset:s.offset + s.numel].view(s.local_shape)
        full = ep_gather(gather_tensor(local.contiguous(), s.tp_split_dim, tp), s.ep_split_dim, ep)
        if full.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            full = full.clone()
        yield s.name, full
        del full                         # not alive while the next one is gathered


def shard_from_full(layout: FlatLayout, full: Dict[str, torch.Tensor], tp, dtype, device, source: str,
                    ep=None) -> torch.Tensor:
    """This rank's shard of `layout` from full tensors (no communication: the slices are cut locally)."""
    missing = [s.name for s in layout.slots if s.name not in full]
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} parameters of this model, e.g. {missing[:3]}")
    tensors = []
    for s in layout.slots:
        t = full[s.name]
        if tuple(t.shape) != tuple(s.full_shape):
            raise ValueError(f"{source}: {s.name} has shape {tuple(t.shape)}, this model expects "
                             f"{tuple(s.full_shape)}: the checkpoint is of another model shape")
        local = shard_tensor(t.to(device=device, dtype=dtype), s.tp_split_dim, tp)
        tensors.append(ep_shard(local, s.ep_split_dim, ep))
    if not tensors:
        return torch.zeros(layout.shard_numel, dtype=dtype, device=device)
    return layout.shard(layout.flatten(tensors, dtype)).clone()


class ShardedStateDicts:
    """The state dicts of one fully_shard'ed model, from its manager (`model.zero3`): its non-empty
    units (an empty unit, a root with nothing left over, has no shard and no entry) and their
    shards, in the order model.parameters() yields them, the order every shard-shaped list below
    follows; and the HF names of the parameters in model order (a tied parameter once), the order
    of every full dict."""

    def __init__(self, zero3):
        self.units = [u for u in zero3.units if not u.empty]
        self.shards = zero3.shards
        self.param_names, self.pgm = zero3.param_names, zero3.pgm

    def full_from_shards(self, tensors) -> Dict[str, torch.Tensor]:
        """{HF name: full tensor} from shard-shaped tensors aligned with self.shards (the weights,
        or an optimizer state). Collective over dp_shard_cp and tp: every rank must call it."""
        out = dict(self.iter_full(tensors))
        return {n: out[n] for n in self.param_names}

    def iter_full(self, tensors, meter=None):
        """full_from_shards one tensor at a time, in unit order: (HF name, full tensor), on the
        shards' device. At most one unit's gathered buffer and the one full tensor being handed out
        are alive here at once (what an export that moves each to the host needs: the whole model is
        never on the device). Collective: every rank of dp_shard_cp and tp must take every item.
        `meter` (an accounting hook, models/hf_shards.py HeldBytes) is shown each buffer and tensor."""
        tensors = list(tensors)
        if len(tensors) != len(self.units):
            raise ValueError(f"full_from_shards: {len(tensors)} tensors given, one per shard "
                             f"({len(self.units)}) needed")
        for u, t in zip(self.units, tensors):
            flat = gather_flat(t, u.dim)
            if meter is not None:
                meter.track(flat)
            for name, full in full_items(u.layout, flat, self.pgm.tp, u.ep):
                if meter is not None:
                    meter.track(full)
                yield name, full
                del full                     # (the loop variables would keep the last one alive)
            del flat

    def shards_from_full(self, full: Dict[str, torch.Tensor], source: str = "state dict") -> list:
        """This rank's shard-shaped tensors (aligned with self.shards) cut from full tensors; local."""
        return [shard_from_full(u.layout, full, self.pgm.tp, u.shard.dtype, u.shard.device, source, u.ep)
                for u in self.units]

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        return self.full_from_shards([s.detach() for s in self.shards])

    @torch.no_grad()
    def load_full_state_dict(self, full: Dict[str, torch.Tensor], source: str = "state dict"):
        # every shape is checked (from_full) before any shard is written: a bad file changes nothing
        for shard, t in zip(self.shards, self.shards_from_full(full, source)):
            shard.copy_(t)

    def sharded_state_dict(self) -> dict:
        """This rank's shards and the layout to place them from any other layout (what
        trainer/checkpoint/save_load.py saves as segments; it reshards them on load)."""
        pgm = self.pgm
        return dict(format=FORMAT, tp_rank=pgm.tp.rank, tp_size=pgm.tp.size,
                    dp_shard_cp_rank=pgm.dp_shard_cp.rank, dp_shard_cp_size=pgm.dp_shard_cp.size,
                    units={u.name: dict(flat_shard=u.shard.detach(), **u.layout.metadata(),
                                        **_ep_coords(u)) for u in self.units})


def _ep_coords(u: Unit) -> dict:
    """An experts unit's place in ep (which block of experts its slots hold), for resharding."""
    return {} if u.ep is None else dict(ep_rank=u.ep.rank, ep_size=u.ep.size)
