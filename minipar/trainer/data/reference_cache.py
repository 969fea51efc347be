"""The precomputed DPO reference, kept with the prepared data: a rerun loads its numbers instead of
running the pass again (rl: dpo with the 'precomputed' reference: minipar/trainer/dpo_run.py).

The pass (one forward of every train and held-out pair with the starting weights, before step 1)
gives each split (P, 2) float32: the chosen and rejected rows' log p_ref(y | x). They depend on
nothing the run changes while it trains, so they are saved under a name made of everything they do
depend on, next to the prepared rows (prepared.py's root):

    <root>/reference/<key>.pt      torch.save of {inputs, splits: [(P, 2) per split]}, written to a
                                   temporary name and renamed (os.replace: a reader sees all of it
                                   or nothing)

The key is the sha256 of cache_inputs():

    code        the sha256 of the files that compute the numbers (every file of models/, minipar/dpo/
                objective.py, minipar/dpo_step.py, minipar/dpo_reference.py), torch's version and
                the device type: a fix to the forward must not load old numbers
    pairs       each split's fingerprint (data/preference.py: a hash of its ids and labels) and size
    weights     base_model's files by the sha256 of every byte (about a second per GB, read by one
                rank), else the seed (the seeded initialisation) with the model's config
    forward     the model config, the recipe (dtype, LoRA: its base runs with the adapters off,
                compile), the layout (the order of the sums, an MoE's capacity per rank),
                global_batch_size (the pass's batches) and whether dpo_loss_type averages log p per
                token (ipo) or sums it (sigmoid, robust, hinge: one cache); dpo_label_smoothing and
                dpo_beta are not in it (the loss's, not the log-probs')

learning_rate, max_steps, output_dir and the rest are not in it: a rerun that changes them loads
the numbers. Pure file work, no communication: dpo_run.py has one rank read and write, and
broadcasts (the folder need not be shared between nodes).
"""
from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import warnings
from typing import List, Optional

import torch

from minipar.dpo.objective import MEAN_LOGPS
from minipar.trainer.checkpoint.atomic import owner_tag
from minipar.trainer.checkpoint.verify import sha256_file
from minipar.trainer.data.prepared import prepared_root

FORMAT_VERSION = 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CODE = ("minipar/dpo/objective.py", "minipar/dpo_step.py", "minipar/dpo_reference.py")


def _plain(x):
    """A config value as JSON sees it (dataclasses as dicts, anything else by its str)."""
    return json.loads(json.dumps(dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x, default=str,
                                 sort_keys=True))


def weights_inputs(cfg, base_model) -> dict:
    """The starting weights: the checkpoint's files by content, or the seed that draws them."""
    if base_model is None:
        return dict(seed=int(cfg.seed))
    files = sorted({entry[0] for entry in base_model.tensors.values()})
    files.append(os.path.join(base_model.directory, "config.json"))
    return {os.path.basename(f): sha256_file(f) for f in files if os.path.isfile(f)}


def cache_inputs(cfg, pconf, base_model, splits, device_type: str) -> dict:
    """Everything the precomputed numbers depend on (the module docstring), as plain JSON values
    (what torch.load(weights_only=True) reads back)."""
    code = sorted(glob.glob(os.path.join(ROOT, "models", "*.py"))) + [os.path.join(ROOT, c) for c in CODE]
    return _plain(dict(format=FORMAT_VERSION, torch=str(torch.__version__), device=device_type,
                       code={os.path.relpath(f, ROOT): sha256_file(f) for f in code},
                       pairs=[[s.fingerprint, s.num_rows] for s in splits],
                       weights=weights_inputs(cfg, base_model), model=_plain(cfg.model),
                       recipe=_plain(cfg.recipe()), layout=_plain(pconf),
                       global_batch_size=int(cfg.global_batch_size),
                       logps="mean" if cfg.dpo_loss_type in MEAN_LOGPS else "sum"))


def cache_path(cfg, inputs: dict) -> str:
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]
    return os.path.join(prepared_root(cfg), "reference", f"{key}.pt")


def load(path: str, inputs: dict, sizes: List[int]) -> Optional[List[torch.Tensor]]:
    """The saved (P, 2) numbers of each split, or None (absent; or damaged, unreadable or of other
    inputs: warned, and the pass runs again)."""
    if not os.path.isfile(path):
        return None
    try:
        saved = torch.load(path, weights_only=True)
        splits = saved["splits"]
        if saved["inputs"] != inputs or [s.shape for s in splits] != \
                [torch.Size([n, 2]) for n in sizes]:
            raise ValueError("its inputs or shapes differ from this run's")
        return [s.float() for s in splits]
    except Exception as err:                           # noqa: BLE001 - any damage means recompute
        warnings.warn(f"the cached DPO reference {path} is not usable ({err}); computing it again")
        return None


def save(path: str, inputs: dict, splits: List[torch.Tensor]) -> Optional[str]:
    """Write the numbers atomically; a folder that cannot be written is a warning (the run goes on).
    Returns the path written, or None."""
    tmp = f"{path}.tmp-{owner_tag()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(dict(inputs=inputs, splits=[s.float().cpu() for s in splits]), tmp)
        os.replace(tmp, path)
        return path
    except OSError as err:
        warnings.warn(f"the DPO reference could not be cached at {path} ({err}); the next start computes it "
                      f"again")
        if os.path.exists(tmp):
            os.remove(tmp)
        return None
