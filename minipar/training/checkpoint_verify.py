"""Which checkpoints are good: reading manifest.json, verifying every file it lists, and finding
the newest complete step-N (what `resume_from_checkpoint: latest` resolves to).

checkpoint_io.py writes a checkpoint directory so that it appears whole or not at all; this file
reads one back without trusting it:

    output_dir/step-N/manifest.json    {format, version, step, layout, model_config,
                                        files: {relpath: {bytes, sha256}}, ...}

    read_manifest(step-N)      the manifest, or a ValueError saying why it is not one (missing: a
                               save that did not finish; unreadable JSON; another format/version)
    verify(step-N)             every listed file present, of the listed size, and (checksums=True)
                               of the listed sha256: catches a truncated copy, a flipped bit, a
                               file from another save
    list_checkpoints(dir)      the complete step-N, oldest first (sizes only: cheap, for rotation)
    find_latest_verified(dir)  the newest step-N whose every checksum holds, and the newer ones it
                               skipped with the reason (a crash mid-copy does not cost the run)

All of it is local file reads on one process: no groups, no communication. Hashing reads the
whole checkpoint once (sha256 at disk speed), which is why listing skips it and loading does not.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import List, Optional

FORMAT = "minipar-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d+)$")


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(directory: str) -> dict:
    """The parsed manifest, or a ValueError that names the file and what is wrong with it."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise ValueError(f"checkpoint directory {directory} does not exist")
    if not os.path.exists(path):
        raise ValueError(f"{path} is missing: {directory} is not a complete checkpoint (a save that "
                         f"did not finish, or not a minipar checkpoint); resume from an earlier step-N")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON ({e}): the checkpoint is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise ValueError(f"{path} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{path} has format version {manifest.get('version')}, this minipar reads version "
                         f"{VERSION}")
    return manifest


def verify(directory: str, checksums: bool = True) -> dict:
    """Check the manifest and every file it lists (presence, size, and sha256 when `checksums`);
    returns the manifest or raises a ValueError naming the first bad file."""
    manifest = read_manifest(directory)
    for rel, entry in manifest["files"].items():
        path = os.path.join(directory, rel)
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint file {path} is missing (listed in {MANIFEST}): the checkpoint "
                             f"is incomplete")
        size = os.path.getsize(path)
        if size != entry["bytes"]:
            raise ValueError(f"checkpoint file {path} has {size} bytes, the manifest says {entry['bytes']}: "
                             f"the file is truncated or damaged")
        if checksums and sha256_file(path) != entry["sha256"]:
            raise ValueError(f"checkpoint file {path} fails its sha256 checksum: the file is damaged")
    return manifest


def list_checkpoints(output_dir: str) -> List[str]:
    """Complete step-N directories under output_dir, oldest first. Complete means a valid manifest
    whose files are all present with the right sizes (checksums are left to load time)."""
    found = []
    for path in _step_dirs(output_dir):
        try:
            verify(path, checksums=False)
        except ValueError:
            continue
        found.append(path)
    return found


def _step_dirs(output_dir: str) -> List[str]:
    """The step-N directories under output_dir, oldest first (step-N.tmp-... of a crashed save and
    anything else left out)."""
    steps = []
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        m = _STEP_RE.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            steps.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [p for _, p in sorted(steps)]


def find_latest_checkpoint(output_dir: str) -> Optional[str]:
    """The newest complete output_dir/step-N, or None."""
    done = list_checkpoints(output_dir)
    return done[-1] if done else None


def find_latest_verified(output_dir: str):
    """(the newest output_dir/step-N whose every file checks out, sha256 included, or None;
    [(path, why)] of the newer ones skipped). What `resume_from_checkpoint: latest` resumes from:
    a truncated and a bit-flipped newest checkpoint are skipped alike, and named."""
    skipped = []
    for path in reversed(_step_dirs(output_dir)):
        try:
            verify(path, checksums=True)
            return path, skipped
        except ValueError as e:
            skipped.append((path, str(e)))
    return None, skipped
