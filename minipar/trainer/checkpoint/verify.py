"""Which checkpoints are good: reading manifest.json, verifying every file it lists, and finding
the newest complete step-N (what `resume_from_checkpoint: latest` resolves to).

atomic.py writes a checkpoint directory so that it appears whole or not at all; this file
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
    verify_once(step-N)        verify(), remembered for this process while no file of it changes
                               (what rotation asks: atomic.rotate_checkpoints)
    quarantine(step-N)         a damaged one renamed step-N.corrupt: out of every listing (no
                               step-N name), so nothing counts, resumes from or deletes it

All of it is local file reads on one process: no groups, no communication. Hashing reads the
whole checkpoint once (sha256 at disk speed), which is why listing skips it and loading does not.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Dict, List, Optional

FORMAT = "minipar-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
CORRUPT = ".corrupt"                      # step-N.corrupt: a damaged checkpoint, moved aside
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
    for path in step_dirs(output_dir):
        try:
            verify(path, checksums=False)
        except ValueError:
            continue
        found.append(path)
    return found


def step_dirs(output_dir: str) -> List[str]:
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
    for path in reversed(step_dirs(output_dir)):
        try:
            verify(path, checksums=True)
            return path, skipped
        except ValueError as e:
            skipped.append((path, str(e)))
    return None, skipped


def quarantine_skipped(skipped) -> List[tuple]:
    """Move aside the damaged checkpoints that find_latest_verified skipped ([(path, why)]): those
    with a manifest (a step-N without one is no checkpoint and is left alone). Returns [(path,
    new path)]. Rank 0, once every rank has chosen its checkpoint (after load_checkpoint)."""
    return [(path, quarantine(path)) for path, _ in skipped
            if os.path.isfile(os.path.join(path, MANIFEST))]


def quarantine(directory: str) -> str:
    """Rename a damaged step-N to step-N.corrupt (step-N.corrupt-2, ... if taken) and return the new
    path. Renamed, not deleted: what was damaged, and how, can still be looked at; no listing,
    resume or cleanup matches the name (only step-N does), so it is never counted as a checkpoint."""
    base = os.path.abspath(directory).rstrip(os.sep) + CORRUPT
    target, i = base, 1
    while os.path.exists(target):
        i += 1
        target = f"{base}-{i}"
    os.rename(directory, target)
    _VERIFIED.pop(os.path.abspath(directory), None)
    return target


# Rotation's checksum checks, remembered per path for this process. Rotation runs after every
# save and must not keep a damaged checkpoint, but hashing each kept one every time would re-read
# save_total_limit whole checkpoints per save (gigabytes each save_steps, for a large model). minipar
# writes a checkpoint once and never changes it, so one full check per run suffices: each one is
# hashed by the rotation of its own save (its files then likely still in the page cache: a cheap
# read), the checkpoints of earlier runs by the first rotation of this one, a resumed one by its
# load. The remembered key holds every file's (inode, size, mtime), a cheap stat, so a checkpoint
# replaced or rewritten since (the same step saved again, a copy put back) is hashed again. A bit
# that rots in place later in the run changes no stat and is not seen here; loading hashes every
# file anyway, so such a checkpoint is refused there, never loaded.
_VERIFIED: Dict[str, tuple] = {}


def _signature(directory: str, manifest: dict) -> tuple:
    rels = [MANIFEST, *sorted(manifest["files"])]
    stats = [os.stat(os.path.join(directory, rel)) for rel in rels]
    return tuple((rel, st.st_ino, st.st_size, st.st_mtime_ns) for rel, st in zip(rels, stats))


def verify_once(directory: str) -> dict:
    """verify(directory) with checksums, skipped when this process verified the same files before;
    returns the manifest or raises verify's ValueError."""
    key, manifest = os.path.abspath(directory), read_manifest(directory)
    try:
        signature = _signature(directory, manifest)
    except OSError:                       # a listed file is missing: verify names it
        signature = None
    if signature is None or _VERIFIED.get(key) != signature:
        manifest = verify(directory, checksums=True)
        _VERIFIED[key] = signature
    return manifest


def remember_verified(directory: str, manifest: dict) -> None:
    """Record that `directory` was just verified with checksums elsewhere (load_checkpoint does)."""
    try:
        _VERIFIED[os.path.abspath(directory)] = _signature(directory, manifest)
    except OSError:
        pass
