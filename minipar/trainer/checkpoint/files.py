"""The files inside a checkpoint directory: tensors to bytes, loading that runs no code, RNG
states, and the check that a checkpoint belongs to the model that loads it.

atomic.py makes a directory appear atomically; this file is what goes into it, one process
at a time (no groups, no communication):

    to_bytes(obj)          torch.save into memory, so the writer hashes exactly the bytes it writes
    load(path)             torch.load(weights_only=True): tensors and plain containers (dict, list,
                           tuple, str, numbers, None), never code. A file that needs more (a pickle
                           that would call a function, even one whose checksum was rewritten to
                           match) is refused with a ValueError naming it
    rng_state()            this rank's generators (torch CPU and CUDA, python, numpy) as tensors and
    set_rng_state(state)   lists, so that a resumed run draws the same dropout masks and samples
    config_dict(model)     model.config as JSON values: recorded in manifest.json
    check_model(...)       refuse a checkpoint of another model: config fields, parameter names and
                           full (unsharded) shapes, the optimizer's group count

The shapes compared are the full ones, not this rank's shard, so a checkpoint written by one layout
is accepted by any other (save_load.py reshards on load).
"""
from __future__ import annotations

import dataclasses
import io
import json
import pickle
import random
from typing import Dict, Optional

import numpy as np
import torch

# config fields that name tokens, not shapes: a checkpoint of an older minipar (which recorded
# none) or of another tokenizer's ids still loads
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")

def to_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load(path: str):
    """A checkpoint file, unpickled with weights_only=True: tensors and plain containers (dict,
    list, tuple, str, numbers, None), never code. Anything else is refused, naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"checkpoint file {path} holds more than tensors and plain data, and loading it "
                         f"could run code: refused ({first})") from None


def rng_state() -> dict:
    """This process's random number generators, in types that torch.load(weights_only) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = dict(torch=torch.get_rng_state(), python=random.getstate(),
                 numpy=(kind, keys.tolist(), int(pos), int(has_gauss), float(cached)))
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()      # the current device's generator
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def config_dict(model) -> Optional[dict]:
    """model.config as JSON-able values (for the manifest and the shape check), or None."""
    cfg = getattr(model, "config", None)
    if dataclasses.is_dataclass(cfg):
        d = dataclasses.asdict(cfg)
    elif hasattr(cfg, "to_dict"):
        d = cfg.to_dict()
    else:
        return None
    return json.loads(json.dumps(d, default=str))


def check_model(directory: str, manifest: dict, config: Optional[dict], shapes: Dict[str, list],
                optimizer_groups: Optional[int] = None) -> None:
    """Refuse a checkpoint of another model (config fields, parameter names, full shapes), or one
    without the optimizer state asked for (optimizer_groups: the loading optimizer's group count)."""
    saved, config = (None if c is None else {k: v for k, v in c.items() if k not in TOKEN_ID_KEYS}
                     for c in (manifest.get("model_config"), config))
    if saved is not None and config is not None and saved != config:
        diff = [f"{k}: checkpoint {saved.get(k)!r}, model {config.get(k)!r}"
                for k in sorted(set(saved) | set(config)) if saved.get(k) != config.get(k)]
        raise ValueError(f"checkpoint {directory} is of another model shape: " + "; ".join(diff))
    theirs = manifest["params"]
    bad = sorted(set(shapes) ^ set(theirs)) + [n for n in shapes if n in theirs and shapes[n] != theirs[n]]
    if bad:
        raise ValueError(f"checkpoint {directory} is of another model shape: parameters missing, extra or "
                         f"of another shape: {bad[:5]}")
    if optimizer_groups is None:
        return
    if manifest.get("optimizer") is None:
        raise ValueError(f"checkpoint {directory} holds no optimizer state; pass optimizer=None to load "
                         f"the model only")
    if manifest["optimizer_groups"] != optimizer_groups:
        raise ValueError(f"checkpoint {directory}: its optimizer has {manifest['optimizer_groups']} "
                         f"parameter groups, this one {optimizer_groups}")
