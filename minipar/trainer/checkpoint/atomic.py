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
file from another save: verify.py checks them, and finds the latest good step-N).
Files first, the record that makes them valid last: the commit rule of databases, and of
torch.distributed.checkpoint (its .metadata file is written after the shards).

Communication per save: a broadcast of the temporary name (rank 0 draws it) and the two barriers,
which are all-reduces of a failure flag: if any rank fails to write (a full disk), every rank
learns it, rank 0 removes the temporary directory and all raise; none is left waiting (an OS error,
a full disk, is one CheckpointWriteError line naming the checkpoint and the older one left intact).
Rotation keeps the newest save_total_limit checkpoints whose checksums hold, at least one, and the
one just saved; a damaged one is moved aside (step-N.corrupt) and said so. Everything but
atomic_save and agree works on one process, no groups.

What goes inside the directory, and how it is read back, is files.py: torch.save to bytes
(hashed before they reach the disk), loading with torch.load(weights_only=True), which runs no
code, the RNG states, and the check that a checkpoint is of the loading model.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import socket
import sys
from typing import Callable, Dict, List, Optional

import torch

from minipar import comm
from minipar.trainer.checkpoint.verify import (
    FORMAT,
    MANIFEST,
    VERSION,
    list_checkpoints,
    quarantine,
    step_dirs,
    verify_once,
)
from minipar.trainer.run_lock import LOCK_NAME, process_alive

INDEX_DIR = "index"
# step-N.tmp-<host>-<pid>-<token>: the owner (rank 0 of the saving run) is optional for the
# names of older minipar versions, which are always stale
_TMP_RE = re.compile(r"^(.+?)\.tmp-(?:([A-Za-z0-9._]+)-(\d+)-)?([0-9a-f]{16})$")
_OLD_RE = re.compile(r"^(.+?)\.old-(?:([A-Za-z0-9._]+)-(\d+)-)?([0-9a-f]{16})$")
_NAME_BYTES = 256


class CheckpointWriteError(OSError):
    """A save that failed on an OS error (a full disk, a quota, a read-only file system), on every
    rank: nothing was committed, the temporary directory is gone, the older checkpoints are intact.
    train.py prints it as one line and exits 1 (a failure of the machine, not of the config)."""


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)      # rotation runs on rank 0 only: one line per run


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
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:                   # a full disk fails in write() or fsync(): name the file
        if e.filename is None:
            e.filename = path
        raise
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


def agree(failed, pgm, device, over=None) -> int:
    """A barrier over the world that tells every rank whether any rank failed: the largest of the
    ranks' codes (False/0 none, 1 an error, 2 an OS error, atomic_save's), truthy if any failed.
    `over`: another MeshDim of every rank than pgm.world (async_save.py's checkpoint group)."""
    flag = torch.tensor([float(failed)], device=device)
    comm.all_reduce(flag, over or pgm.world, op="max")
    return int(flag.item())


def _code(error) -> int:
    return 0 if error is None else 2 if isinstance(error, OSError) else 1


def _raise_failed(failed: int, error, directory: str, parent: str, others: str):
    """After a failed barrier: an OS error anywhere becomes one CheckpointWriteError (each rank
    names its own cause, or says `others`: which rank had one); any other error is raised as is."""
    if isinstance(error, OSError) or (error is None and failed == 2):
        cause = (f"{others} (see that rank's error)" if error is None else
                 f"{error.strerror or error}" + (f" (writing {error.filename})" if error.filename else ""))
        done, fix = list_checkpoints(parent), "free space (or set another output_dir) and"
        prev = (f"the previous checkpoint {done[-1]} is intact; {fix} resume with resume_from_checkpoint: "
                f"latest" if done else f"there is no earlier checkpoint in {parent}; {fix} run again")
        raise CheckpointWriteError(f"could not write checkpoint {directory}: {cause}; nothing was committed "
                                   f"and its temporary directory was removed; {prev}") from error
    raise error or RuntimeError(f"{others}: checkpoint {directory} was not committed (see that rank's error)")


def atomic_save(directory: str, pgm, device, write: Callable[[str], Dict[str, dict]],
                manifest: Callable[[], dict], keep_last: Optional[int] = None, over=None) -> str:
    """The protocol of the picture above. `write(tmp)` runs on every rank and returns the manifest
    entries of the files it wrote (write_file's); `manifest()` runs on rank 0 before the commit.
    Collective over pgm.world, or over `over` (a MeshDim of every rank: async_save.py's own group,
    so that a background save never shares a group with training's collectives)."""
    rank, parent = pgm.global_rank, os.path.dirname(os.path.abspath(directory))
    name = torch.zeros(_NAME_BYTES, dtype=torch.uint8)   # rank 0's temporary name, to every rank
    if rank == 0:
        drawn = os.path.basename(temp_dir_for(directory, random.SystemRandom().getrandbits(62))).encode()
        name[:len(drawn)] = torch.tensor(list(drawn), dtype=torch.uint8)
    name = name.to(device)
    comm.broadcast(name, over or pgm.world)
    tmp = os.path.join(parent, bytes(name.cpu().tolist()).rstrip(b"\0").decode())
    error = None
    try:
        if rank == 0:
            clean_stale(parent, keep=tmp)
        write_index(tmp, rank, write(tmp))
    except Exception as e:                       # noqa: BLE001 - every rank learns of it below
        error = e
    failed = agree(_code(error), pgm, device, over)    # barrier 1: every rank's files are on disk
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_failed(failed, error, directory, parent, "another rank could not write its part")
    if rank == 0:
        try:
            commit(tmp, directory, manifest())
        except Exception as e:                   # noqa: BLE001
            error = e                            # (a full disk while writing the manifest)
            shutil.rmtree(tmp, ignore_errors=True)
            try:                                 # puts back step-N.old-... if the swap was half done
                clean_stale(parent)
            except OSError:                      # (never skip the barrier below: peers wait in it)
                pass
        if error is None and keep_last:
            try:
                rotate_checkpoints(parent, keep_last, keep=directory)
            except OSError as e:                 # the save itself is done: say so, train on
                _warn(f"warning: could not rotate the checkpoints in {parent} ({e}); {directory} is saved")
    failed = agree(_code(error), pgm, device, over)    # barrier 2: the directory is final on every rank
    if failed:
        _raise_failed(failed, error, directory, parent, "rank 0 could not commit it")
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


def rotate_checkpoints(output_dir: str, save_total_limit: Optional[int], keep: Optional[str] = None,
                       warn: Callable[[str], None] = _warn) -> List[str]:
    """Keep the newest `save_total_limit` checkpoints whose checksums hold (None or 0: all), delete
    older ones and stale temporary directories (rank 0 only); returns what was removed. The newest
    good checkpoint and `keep` (just saved) are never removed: a limit below 1 keeps one. A damaged
    one among the newest is moved aside (quarantine(): step-N.corrupt) with a `warn` line and not
    counted, so an older good one stays in its place; `keep` damaged stays too, not counted. Past
    the limit a checkpoint goes either way, so it is not hashed; a step-N without a manifest (no
    minipar checkpoint) is left alone."""
    removed = clean_stale(output_dir)
    if not save_total_limit:
        return removed
    limit, keep, kept = max(int(save_total_limit), 1), os.path.abspath(keep) if keep else None, 0
    for path in reversed(step_dirs(output_dir)):             # newest first
        mine = os.path.abspath(path) == keep
        if not os.path.isfile(os.path.join(path, MANIFEST)) or (mine and kept >= limit):
            continue
        if kept >= limit:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        try:
            verify_once(path)                  # hashed once a run (verify.py says why)
            kept += 1
        except ValueError as e:
            fate = ("it was just saved: kept, but not counted" if mine else
                    f"moved it aside to {quarantine(path)}, where no resume or rotation counts it")
            warn(f"warning: checkpoint {path} is damaged ({e}); {fate}")
    return removed
