"""The prepared dataset: tokenize and pack once, then load it (Axolotl's `dataset_prepared_path`).

Reading and tokenizing `datasets` (datasets.py) and packing the rows (packing.py) is a pure
function of its inputs, and on a real data set (hundreds of thousands of chat rows, a 128k-vocab
tokenizer) it takes minutes. So the result is saved under a folder named by a hash of everything
that determines it, and a later start with the same inputs loads it in seconds:

    dataset_prepared_path: DIR          default $MINIPAR_CACHE/prepared, else ~/.cache/minipar/prepared
                                        ($XDG_CACHE_HOME): one folder for every run, so a new output_dir
                                        with the same data loads what an earlier run prepared
    DIR/<key>/data.pt                   torch.save of {train, val}: each split's four row tensors
                                        (input_ids, labels, position_ids, document_ids as int32,
                                        (num_rows, sequence_len)), its packing plan and counts
    DIR/<key>/meta.json                 written last: the key, its inputs, the sha256 and size of
                                        data.pt, the run's data notes. No meta.json = not complete

The key is the sha256 of cache_inputs(): the format version; the source of the data modules
(datasets.py, sources.py, formats.py, chat_format.py, packing.py, tokenizer.py, batches.py,
chat_templates.py, special_tokens.py: a fix to tokenization must not load old rows); every
`datasets` entry's settings (type, field, the chat keys, split, ...) with the sha256 of each file it
reads, not its path (every byte, on every rank: about a second per GB, against minutes of
tokenizing; the same data under another path or output_dir is the same key); the tokenizer (the
bytes of its tokenizer files, the tokens and chat template the run added, and the transformers /
tokenizers versions; the class name for the byte tokenizer); train_on_inputs, sequence_len,
sample_packing, val_set_size and seed (which draws
both the validation split and the packing order). The model, batch sizes and layout do not change
the rows and are not in it. Axolotl's key (md5 of the entries' names, the tokenizer's name and a
few settings) reads no file, so an edited data file or tokenizer loads the old rows there; here
it prepares anew. The loaded rows are the saved tensors themselves: the same PackedData
fingerprint (checked on load), so a resumed run's data-order check and every loss are unchanged.

Who writes. Preparing happens in run_setup before minipar.init creates any process group (so that
a bad config or bad data is a ValueError on every rank before any collective), hence the ranks
agree through the folder itself, not a barrier:

    local rank 0 of each node   loads a complete entry, or prepares, writes DIR/<key>.tmp-<host>-<pid>
                                and renames it to DIR/<key> (one atomic os.replace); a rename that
                                loses to another node's identical entry is dropped
    every other rank            polls for DIR/<key>/meta.json for up to ddp_timeout seconds, then
                                loads and checks it like the writer

Local rank 0 per node (not global rank 0) makes a folder that is not shared between nodes work too;
on a shared one each node prepares once at the first start and every later start loads. A ValueError
in the data (a bad row, names the file and line) is written by the writer to DIR/<key>.error.json
before it raises, and every waiting rank raises the same ValueError: it is a fact about these inputs
(the key covers them), so a marker left by an earlier start says the same. Any other failure of the
writer (killed, out of memory) leaves the waiters to time out after ddp_timeout, naming the folder;
under torchrun the agent stops them as soon as the writer's process dies. The temporary folder of a
writer that died is never read (only DIR/<key> is) and is removed by the next writer on that host.

A damaged entry (a truncated or altered data.pt: its size or sha256 differ from meta.json, or it does
not load) is never used: the writer warns, moves it aside and prepares again; waiters wait for that.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import warnings
from typing import List, Optional, Tuple

import torch

from minipar.trainer.checkpoint.atomic import owner_tag
from minipar.trainer.checkpoint.verify import sha256_file
from minipar.trainer.data.datasets import check_entries
from minipar.trainer.data.packing import DatasetRun, PackedData
from minipar.trainer.data.sources import source_files
from minipar.trainer.run_lock import process_alive

FORMAT_VERSION = 2
CODE_FILES = ("datasets.py", "sources.py", "formats.py", "chat_format.py", "packing.py", "tokenizer.py",
              "batches.py", "chat_templates.py", "chat_template_table.py",
              "special_tokens.py")                                       # what decides the rows
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
ROW_KEYS = ("input_ids", "labels", "position_ids", "document_ids")
POLL_S = 0.2


def prepared_root(cfg) -> str:
    """dataset_prepared_path, else one cache shared by every run of this user: the key names the
    content, so a new output_dir with the same data loads it instead of tokenizing again."""
    if cfg.dataset_prepared_path:
        return cfg.dataset_prepared_path
    if os.environ.get("MINIPAR_CACHE"):
        return os.path.join(os.environ["MINIPAR_CACHE"], "prepared")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "minipar", "prepared")


def entry_inputs(entry: dict) -> dict:
    """One `datasets` entry as the key sees it: its settings and the sha256 of each file it reads
    (by name relative to the entry's folder, so moving the data elsewhere keeps the key)."""
    path, files = entry["path"], source_files(entry)
    names = [os.path.relpath(f, path) if os.path.isdir(path) else "" for f in files]
    settings = {k: v for k, v in entry.items() if k not in ("path", "data_files")}
    return dict(settings, files=[[n, sha256_file(f)] for n, f in zip(names, files)])


def tokenizer_inputs(tokenizer) -> dict:
    """What identifies a tokenizer's behaviour: its files' bytes and the library versions."""
    source = getattr(tokenizer, "source", None)
    if source is None:
        return dict(kind=type(tokenizer).__name__)
    import tokenizers
    import transformers
    files = {name: sha256_file(os.path.join(source, name)) for name in TOKENIZER_FILES
             if os.path.isfile(os.path.join(source, name))}
    return dict(kind=type(tokenizer.tok).__name__, files=files, transformers=transformers.__version__,
                tokenizers=tokenizers.__version__, changes=getattr(tokenizer, "changes", {}))


def cache_inputs(cfg, tokenizer) -> dict:
    """Everything the prepared rows depend on (see the module docstring), as a JSON-able mapping."""
    here = os.path.dirname(os.path.abspath(__file__))
    return dict(format=FORMAT_VERSION,
                code={name: sha256_file(os.path.join(here, name)) for name in CODE_FILES},
                datasets=[entry_inputs(e) for e in check_entries(cfg.datasets)],
                tokenizer=tokenizer_inputs(tokenizer), train_on_inputs=bool(cfg.train_on_inputs),
                sequence_len=int(cfg.sequence_len), sample_packing=bool(cfg.sample_packing),
                val_set_size=float(cfg.val_set_size), seed=int(cfg.seed))


def cache_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------ one entry
def _split_state(data: Optional[PackedData]) -> Optional[dict]:
    if data is None:
        return None
    return dict(**{k: data.rows[k].to(torch.int32) for k in ROW_KEYS},     # ids < 2^31: half the bytes
                plan=torch.tensor([i for p in data.plan for i in p], dtype=torch.long),
                plan_sizes=torch.tensor([len(p) for p in data.plan], dtype=torch.long),
                num_examples=data.num_examples, sequence_len=data.sequence_len, seed=data.seed,
                packing=data.packing, fingerprint=data.fingerprint)


def _split_from_state(s: Optional[dict]) -> Optional[PackedData]:
    if s is None:
        return None
    flat, sizes = s["plan"].tolist(), s["plan_sizes"].tolist()
    starts = [0]
    for k in sizes:
        starts.append(starts[-1] + k)
    plan = [flat[a:a + k] for a, k in zip(starts, sizes)]
    rows = {k: s[k].long() for k in ROW_KEYS}
    data = PackedData.from_rows(rows, plan, s["sequence_len"], s["seed"], s["packing"], s["num_examples"])
    if data.fingerprint != s["fingerprint"] or data.num_rows != len(rows["input_ids"]):
        raise ValueError(f"rows with fingerprint {data.fingerprint}, prepared as {s['fingerprint']}")
    return data


def save_entry(root: str, key: str, inputs: dict, run: DatasetRun) -> str:
    """Write the entry into a private temporary folder, then rename it into place (atomic)."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, key)
    tmp = os.path.join(root, f"{key}.tmp-{owner_tag()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    data_path = os.path.join(tmp, "data.pt")
    torch.save(dict(train=_split_state(run.train), val=_split_state(run.val)), data_path)
    meta = dict(key=key, inputs=inputs, notes=run.notes, sha256=sha256_file(data_path),
                size=os.path.getsize(data_path), created=time.time())
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.replace(tmp, final)
    except OSError:                     # another writer (another node on a shared folder) was first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def clean_stale(root: str, key: str) -> List[str]:
    """Remove DIR/<key>.tmp-<host>-<pid> folders whose writer on this host has ended."""
    removed, here = [], owner_tag(pid=0).rsplit("-", 1)[0]
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if not name.startswith(f"{key}.tmp-"):
            continue
        host, _, pid = name[len(key) + 5:].rpartition("-")
        if host == here and pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


class DamagedEntry(Exception):
    pass


def load_entry(path: str, key: str, tokenizer) -> Optional[DatasetRun]:
    """The entry at `path`, checked; None when it is not complete; DamagedEntry when it is bad."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        data_path = os.path.join(path, "data.pt")
        size = os.path.getsize(data_path)
        if meta.get("key") != key or size != meta["size"] or sha256_file(data_path) != meta["sha256"]:
            raise DamagedEntry(f"data.pt has {size} bytes, meta.json records {meta.get('size')} bytes and a "
                               f"sha256 it does not match: a truncated or altered file")
        state = torch.load(data_path, weights_only=True)
        train, val = _split_from_state(state["train"]), _split_from_state(state["val"])
    except DamagedEntry:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError) as err:
        raise DamagedEntry(f"{type(err).__name__}: {err}") from None
    return DatasetRun(tokenizer, train, val, list(meta["notes"]))


# ------------------------------------------------------------------------------ the run's data
def _check_writable(root: str) -> None:
    """Every rank, at once: a folder nobody can write would leave the waiters waiting."""
    probe = os.path.abspath(root)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
        raise ValueError(f"dataset_prepared_path={root!r}: {probe!r} is not a writable folder; set "
                         f"dataset_prepared_path to a folder this job can write")


def load_or_prepare(cfg, tokenizer, prepare_fn, progress: bool = False, local_rank: Optional[int] = None,
                    world_size: Optional[int] = None) -> DatasetRun:
    """The DatasetRun of cfg: loaded from dataset_prepared_path, or prepared (prepare_fn(cfg,
    tokenizer, progress), packing.prepare in run_setup) and saved there. Communicates only
    through the folder."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    root = prepared_root(cfg)
    _check_writable(root)
    start = time.perf_counter()
    inputs = cache_inputs(cfg, tokenizer)
    key = cache_key(inputs)
    path, error_path = os.path.join(root, key), os.path.join(root, f"{key}.error.json")

    def loaded(run: DatasetRun) -> DatasetRun:
        run.notes.append(f"loaded prepared dataset from {path} in {time.perf_counter() - start:.1f} s "
                         f"(dataset_prepared_path; delete that folder to prepare it again)")
        return run

    if local_rank != 0 and world_size > 1:
        return loaded(_wait(path, error_path, key, tokenizer, cfg.ddp_timeout, root))
    notes: List[str] = []
    try:
        run = load_entry(path, key, tokenizer)
    except DamagedEntry as err:
        msg = f"the prepared dataset {path} is damaged ({err}); preparing it again"
        warnings.warn(msg)
        notes.append("warning: " + msg)
        aside = f"{path}.damaged-{owner_tag()}"
        try:
            os.replace(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError:
            pass                        # another writer moved it already
        run = None
    if run is not None:
        return loaded(run)
    clean_stale(root, key)
    if os.path.exists(error_path):
        os.remove(error_path)
    try:
        run = prepare_fn(cfg, tokenizer, progress)
    except ValueError as err:           # bad data: every waiting rank raises it too
        os.makedirs(root, exist_ok=True)
        tmp = f"{error_path}.tmp-{owner_tag()}"
        with open(tmp, "w") as f:
            json.dump(dict(key=key, message=str(err)), f)
        os.replace(tmp, error_path)
        raise
    save_entry(root, key, inputs, run)
    run.notes.extend(notes)
    run.notes.append(f"prepared the dataset in {time.perf_counter() - start:.1f} s and saved it to {path}; "
                     f"later starts with the same data, tokenizer and settings load it")
    return run


def _wait(path: str, error_path: str, key: str, tokenizer, timeout_s: float, root: str) -> DatasetRun:
    """A non-writing rank: the writer's entry once it is complete and checks out, or its error."""
    deadline, seen = time.monotonic() + timeout_s, None
    while True:
        if os.path.isfile(error_path):
            try:
                with open(error_path) as f:
                    message = json.load(f)["message"]
            except (OSError, ValueError, KeyError):
                message = None          # being replaced: read it on the next poll
            if message is not None:
                raise ValueError(message)
        stamp = _stamp(os.path.join(path, "meta.json"))
        if stamp is not None and stamp != seen:
            try:
                run = load_entry(path, key, tokenizer)
                if run is not None:
                    return run
            except DamagedEntry:
                seen = stamp            # the writer is replacing it: check again when it changes
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:g} s (ddp_timeout) for local rank 0 "
                               f"to prepare the dataset into {path} (dataset_prepared_path {root}); "
                               f"see local rank 0's error, or raise "
                               f"ddp_timeout if preparing takes longer")
        time.sleep(POLL_S)


def _stamp(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns
