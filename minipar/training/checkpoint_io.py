"""Atomic checkpoint directories: write into a temporary sibling, checksum, manifest last, rename.

A training job can die at any instant: out of memory, a preempted node, a full disk, kill -9 in
the middle of a save. The rule that makes resuming safe is that the last good checkpoint is never
touched and a half-written one never looks complete:

    output_dir/
      step-200/                      complete: manifest.json present, every file it lists checks out
      step-300.tmp-node7-4242-3f9c0a1b2c4d5e6f/   a save in progress, or one that died: its writer
                                     (host node7, pid 4242: rank 0 of that run) is in the name, so
                                     cleanup removes it only once that process is gone
      step-300/                      appears only by one rename(2), after everything inside is on disk

    one save, seen from the file system
      every rank   write its files into step-N.tmp-<token>/, fsync each one, and an index
                   index/rank-R.json: {file: {bytes, sha256}} (the writer hashes what it wrote)
      barrier
      rank 0       merge the indexes into manifest.json (format, step, layout, model config, files),
                   fsync it, rename step-N.tmp-<token> -> step-N, fsync output_dir
      barrier      (the directory is final when save_checkpoint returns on any rank)

rename(2) of a directory is atomic on POSIX file systems, so a reader sees either no step-N or the
whole of it. The manifest is written last, so "manifest present" means "every file was written";
its sizes and sha256 checksums catch what happened after (a truncated copy, a flipped bit, a
file from another save). Files first, the record that makes them valid last: the commit rule of
databases, and of torch.distributed.checkpoint (its .metadata file is written after the shards).

Communication per save: a broadcast of the temporary name (rank 0 draws it) and the two barriers,
which are all-reduces of a failure flag: if any rank fails to write (a full disk), every rank
learns it, rank 0 removes the temporary directory and all raise; none is left waiting. The small
per-rank pieces live here too, as they are only file formats: the RNG states (torch CPU and CUDA,
python, numpy) that make a resumed run draw the same numbers, and torch.save to bytes (hashed
before they reach the disk). Everything but atomic_save and agree works on one process, no groups.

Loading runs no code: every file is read with torch.load(weights_only=True), which unpickles
tensors and plain containers only. A file that needs more (a pickle that would call a function,
even one whose checksum was rewritten to match) is refused with a ValueError naming it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import socket
from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from .. import comm
from .run_lock import LOCK_NAME, process_alive

FORMAT = "minipar-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
INDEX_DIR = "index"
_STEP_RE = re.compile(r"^step-(\d+)$")
# step-N.tmp-<host>-<pid>-<token>: the owner (rank 0 of the saving run) is optional for the
# names of older minipar versions, which are always stale
_TMP_RE = re.compile(r"^(.+?)\.tmp-(?:([A-Za-z0-9._]+)-(\d+)-)?([0-9a-f]{16})$")
_OLD_RE = re.compile(r"^(.+?)\.old-(?:([A-Za-z0-9._]+)-(\d+)-)?([0-9a-f]{16})$")
_NAME_BYTES = 256


def owner_tag(host: Optional[str] = None, pid: Optional[int] = None) -> str:
    """host-pid of a save's writer, in characters a directory name keeps."""
    host = re.sub(r"[^A-Za-z0-9.]", "_", host if host is not None else socket.gethostname())[:64]
    return f"{host}-{pid if pid is not None else os.getpid()}"


def temp_dir_for(directory: str, token: int, owner: Optional[str] = None) -> str:
    """The sibling a save writes into: `owner` (owner_tag(); this process by default) and `token`
    are rank 0's, the same on every rank."""
    return (f"{os.path.abspath(directory).rstrip(os.sep)}.tmp-{owner or owner_tag()}-"
            f"{token & (2 ** 64 - 1):016x}")


def _owner_gone(host: Optional[str], pid: Optional[str], parent: str) -> bool:
    """Whether the writer of a temporary directory has ended, so that its directory is stale."""
    if host is None:
        return True                            # no owner in the name: an older minipar's
    if host == owner_tag(pid=0).rsplit("-", 1)[0]:
        return int(pid) == os.getpid() or not process_alive(int(pid))   # ours: only `keep` is in use
    # another host's: stale only if this process holds the output_dir's lock (so no other run
    # writes here); otherwise we cannot tell, and leave it alone
    try:
        with open(os.path.join(parent, LOCK_NAME)) as f:
            lock = json.load(f)
        return lock.get("pid") == os.getpid() and lock.get("host") == socket.gethostname()
    except (OSError, ValueError, AttributeError):
        return False


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    try:                       # makes a rename durable; some file systems cannot fsync directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def write_file(root: str, relpath: str, data: bytes) -> Dict[str, dict]:
    """Write bytes to root/relpath durably; returns its manifest entry {relpath: {bytes, sha256}}."""
    path = os.path.join(root, relpath)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {relpath: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def write_index(root: str, rank: int, entries: Dict[str, dict]) -> None:
    write_file(root, os.path.join(INDEX_DIR, f"rank-{rank:05d}.json"), json.dumps(entries).encode())


def commit(root: str, directory: str, manifest: dict) -> str:
    """Rank 0, after every rank has written its files and index: write the manifest (files merged
    from the indexes), then rename the temporary directory to its final name."""
    files: Dict[str, dict] = {}
    index_dir = os.path.join(root, INDEX_DIR)
    for name in sorted(os.listdir(index_dir)):
        with open(os.path.join(index_dir, name)) as f:
            files.update(json.load(f))
    shutil.rmtree(index_dir)
    manifest = dict(manifest, format=FORMAT, version=VERSION, files=dict(sorted(files.items())))
    tmp_manifest = os.path.join(root, MANIFEST + ".partial")
    with open(tmp_manifest, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_manifest, os.path.join(root, MANIFEST))
    _fsync_dir(root)
    directory = os.path.abspath(directory)
    old = None
    if os.path.exists(directory):          # saving the same step again: swap, then drop the old one
        old = ".old-".join(root.rsplit(".tmp-", 1))
        os.replace(directory, old)
    os.replace(root, directory)
    _fsync_dir(os.path.dirname(directory))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def agree(failed: bool, pgm, device) -> bool:
    """A barrier over the world that tells every rank whether any rank failed."""
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    comm.all_reduce(flag, pgm.world, op="max")
    return bool(flag.item())


def atomic_save(directory: str, pgm, device, write: Callable[[str], Dict[str, dict]],
                manifest: Callable[[], dict], keep_last: Optional[int] = None) -> str:
    """The protocol of the picture above. `write(tmp)` runs on every rank and returns the manifest
    entries of the files it wrote (write_file's); `manifest()` runs on rank 0 before the commit.
    Collective."""
    rank, parent = pgm.global_rank, os.path.dirname(os.path.abspath(directory))
    name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)   # rank 0's temporary name, to every rank
    if rank == 0:
        drawn = os.path.basename(temp_dir_for(directory, random.SystemRandom().getrandbits(62))).encode()
        name[:len(drawn)] = torch.tensor(list(drawn), dtype=torch.uint8)
    name = name.to(device)
    comm.broadcast(name, pgm.world)
    tmp = os.path.join(parent, bytes(name.cpu().tolist()).rstrip(b"\0").decode())
    error = None
    try:
        if rank == 0:
            clean_stale(parent, keep=tmp)
        write_index(tmp, rank, write(tmp))
    except Exception as e:                       # noqa: BLE001 - every rank learns of it below
        error = e
    if agree(error is not None, pgm, device):    # barrier 1: every rank's files are on disk
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error or RuntimeError(f"another rank failed to write its part of checkpoint {directory}; "
                                    f"nothing was committed (see that rank's error)")
    if rank == 0:
        try:
            commit(tmp, directory, manifest())
            if keep_last:
                rotate_checkpoints(parent, keep_last)
        except Exception as e:                   # noqa: BLE001
            error = e
    if agree(error is not None, pgm, device):    # barrier 2: the directory is final on every rank
        raise error or RuntimeError(f"rank 0 failed to commit checkpoint {directory} (see its error)")
    return directory


def clean_stale(parent: str, keep: Optional[str] = None) -> List[str]:
    """Remove the temporary directories that crashed saves left under `parent` (except `keep`). A
    save that died while replacing step-N by a new step-N left the old one as step-N.old-<...>:
    it is complete, so it is put back. A directory whose writer still runs (on this host: its pid
    is alive) or may run (another host) is never touched: it is a live run's save in progress."""
    removed = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        path = os.path.join(parent, name)
        m = _TMP_RE.match(name) or _OLD_RE.match(name)
        if not m or not os.path.isdir(path) or (keep and os.path.abspath(path) == os.path.abspath(keep)):
            continue
        if not _owner_gone(m.group(2), m.group(3), parent):
            continue
        final = os.path.join(parent, m.group(1))
        if _OLD_RE.match(name) and not os.path.exists(final):
            os.replace(path, final)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


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


def rotate_checkpoints(output_dir: str, save_total_limit: Optional[int]) -> List[str]:
    """Delete the oldest complete checkpoints beyond `save_total_limit` (rank 0 only; None or 0
    keeps all), and stale temporary directories. Returns what was removed."""
    removed = clean_stale(output_dir)
    if save_total_limit:
        for path in list_checkpoints(output_dir)[:-save_total_limit]:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# ------------------------------------------------------------------------- formats of the files
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
    saved = manifest.get("model_config")
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
