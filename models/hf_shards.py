"""A Hugging Face directory's weights written as they arrive: one full tensor at a time, moved to
host memory at once, into safetensors shards of at most max_shard_bytes, with the Hub's index.

An export gathers the model tensor by tensor (the ZeRO-3 units one at a time, the pipeline stages
in turn: models/full_state.py full_state_items) and hands each to ShardWriter.add, which copies it to
the host and drops nothing else: the device holds one full tensor (plus the unit being gathered)
beyond training, the host one open shard. When the next tensor would push the open shard past
max_shard_bytes it is written out (safetensors.torch.save_file of that shard's dict) and emptied;
a tensor larger than the limit is written alone, as huggingface_hub's split_state_dict_into_shards
does. close() names the files as transformers does:

    one shard      model.safetensors                   (byte-identical to one save_file of the
                                                         whole dict: safetensors orders the tensors
                                                         by dtype and name, not by arrival)
    N shards       model-00001-of-0000N.safetensors ... + model.safetensors.index.json
                   {"metadata": {"total_parameters", "total_size"}, "weight_map": {name: file}}

The peak, per rank, of what an export holds: max(max_shard_bytes, the largest tensor) on the host
+ one full tensor + one ZeRO-3 unit's gathered buffer (on the device; on a CPU run the host copy is
the tensor itself). HeldBytes counts it: every buffer and tensor the export makes is shown to it, and
it sums those still alive (weakref finalizers: a tensor counts until its last reference goes), so a
test holds the export to that bound by counting, not by timing.

The host copies are ordinary (pageable) memory: torch keeps freed pinned blocks in its own cache,
rounded up to a power of two and not returned to the system, so pinning a model's worth of shards
would leave that much pinned for the rest of the run; an export is once per run and waits on the
disk anyway. Shards are written under temporary names first; a cut export leaves no index.
"""
from __future__ import annotations

import json
import os
import re
import weakref
from typing import Dict, Iterable, Optional, Tuple

import torch
from safetensors.torch import save_file

from models.hf_names import hub_tensors

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
MAX_SHARD_BYTES = 5 * 10 ** 9        # the Hub's "5GB" (huggingface_hub's MAX_SHARD_SIZE)
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors$")


class HeldBytes:
    """The bytes of the tracked tensors still alive (`now`) and the most at once (`peak`)."""

    def __init__(self):
        self.now = self.peak = 0
        self._alive: Dict[int, int] = {}

    def track(self, t: torch.Tensor) -> None:
        if id(t) in self._alive:             # already counted (a CPU tensor is its own host copy)
            return
        n = t.numel() * t.element_size()
        self._alive[id(t)] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(t, self._free, id(t))

    def _free(self, key: int) -> None:
        self.now -= self._alive.pop(key)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """An fp32, contiguous CPU tensor of t's values (what save_pretrained has always written): a
    copy from a device, t itself when it already is one."""
    if t.device.type != "cpu":
        return t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return t.detach().contiguous().float()


def hub_items(items: Iterable[Tuple[str, torch.Tensor]], model_type: str, tied: bool):
    """(minipar name, full tensor) -> (Hub name, tensor): stacked experts cut into one per expert,
    Phi-3's q/k/v and gate/up fused (models/hf_names.py hub_tensors: a fused tensor holds its parts
    until the last arrives), lm_head.weight left out when tied (as transformers saves it). One at a
    time, as they come."""
    kept = ((name, t) for name, t in items if not (tied and name == "lm_head.weight"))
    yield from hub_tensors(kept, model_type)


class ShardWriter:
    """Safetensors shards of at most max_shard_bytes in `directory`, filled as tensors arrive."""

    def __init__(self, directory: str, max_shard_bytes: int = MAX_SHARD_BYTES,
                 meter: Optional[HeldBytes] = None):
        if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
        self.directory, self.max_shard_bytes, self.meter = directory, max_shard_bytes, meter
        self.open: Dict[str, torch.Tensor] = {}
        self.open_bytes = self.total_bytes = self.total_params = 0
        self.files: list = []                 # temporary file names, in the order written
        self.weight_map: Dict[str, int] = {}  # name -> index into files
        os.makedirs(directory, exist_ok=True)

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.weight_map or name in self.open:
            raise ValueError(f"{name} was written twice to {self.directory}")
        host = to_host(t)
        if self.meter is not None:
            self.meter.track(host)
        n = host.numel() * host.element_size()
        self.total_bytes += n
        self.total_params += host.numel()
        if n > self.max_shard_bytes:          # alone in its own shard; the open one goes on
            self._write({name: host})
            return
        if self.open and self.open_bytes + n > self.max_shard_bytes:
            self._write(self.open)
            self.open, self.open_bytes = {}, 0
        self.open[name] = host
        self.open_bytes += n

    def _write(self, tensors: Dict[str, torch.Tensor]) -> None:
        tmp = f"model-{len(self.files) + 1:05d}.safetensors.tmp"
        save_file(tensors, os.path.join(self.directory, tmp), metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(tensors, len(self.files)))
        self.files.append(tmp)

    def close(self) -> list:
        """Write the open shard, give the files their final names (and the index); returns them."""
        if self.open or not self.files:
            self._write(self.open)
            self.open, self.open_bytes = {}, 0
        count = len(self.files)
        names = [SINGLE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                             for i in range(count)]
        for tmp, final in zip(self.files, names):
            os.replace(os.path.join(self.directory, tmp), os.path.join(self.directory, final))
        self._remove_stale(set(names))
        if count > 1:
            index = dict(metadata=dict(total_parameters=self.total_params, total_size=self.total_bytes),
                         weight_map={k: names[i] for k, i in sorted(self.weight_map.items())})
            tmp = os.path.join(self.directory, INDEX + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, os.path.join(self.directory, INDEX))
        return names

    def _remove_stale(self, keep: set) -> None:
        """A previous export's weights in the same directory (one file or shards of another count),
        which a loader would otherwise read beside or instead of these."""
        for f in os.listdir(self.directory):
            if f not in keep and (f in (SINGLE, INDEX) or SHARD_NAME.match(f)):
                os.remove(os.path.join(self.directory, f))
