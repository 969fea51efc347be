"""The prepared dataset: tokenize and pack once, then load it (Axolotl's `dataset_prepared_path`).

Reading and tokenizing `datasets` (datasets.py) and packing the rows (packing.py) is a pure
function of its inputs, and on a real data set (hundreds of thousands of chat rows, a 128k-vocab
tokenizer) it takes minutes. So the result is saved under a folder named by a hash of everything
that determines it, and a later start with the same inputs loads it in seconds:

    dataset_prepared_path: DIR          default <output_dir>/prepared; set a shared folder (Axolotl's
                                        default is last_run_prepared) to reuse it across runs
    DIR/<key>/data.pt                   torch.save of {train, val}: each split's rows (input_ids,
                                        labels, int32, (num_rows, sequence_len)), its packing plan
                                        (a flat int64 list of example lengths per row) and counts
    DIR/<key>/meta.json                 written last: the key, its inputs, the sha256 and size of
                                        data.pt, the run's data notes. No meta.json = not complete

The key is the sha256 of (cache_inputs): the format version; the source of datasets.py,
packing.py, tokenizer.py and data.py (a fix to tokenization must not load old rows); every
`datasets` entry (path, type, field, field_messages) with the sha256 of the file's bytes (every
byte, on every rank: about a second per GB, against minutes of tokenizing); the tokenizer (the
bytes of its tokenizer files and the transformers / tokenizers versions; "bytes" for the byte
tokenizer); train_on_inputs, sequence_len, sample_packing, val_set_size and seed (which draws both
the validation split and the packing order). The model, batch sizes and layout do not change the
rows and are not in it. position_ids and document_ids are not stored: they follow from the plan.

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
under torchrun the agent stops them as soon as the writer's process dies.

A damaged entry (a truncated or altered data.pt: its size or sha256 differ from meta.json, or it does
not load) is never used: the writer warns, moves it aside and prepares again; waiters wait for that.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import warnings
from typing import List, Optional, Tuple

import torch

from .packing import DatasetRun, PackedData

FORMAT_VERSION = 1
CODE_FILES = ("datasets.py", "packing.py", "tokenizer.py", "data.py")   # what decides the rows
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
POLL_S = 0.2


def prepared_root(cfg) -> str:
    return cfg.dataset_prepared_path or os.path.join(cfg.output_dir, "prepared")


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def tokenizer_inputs(tokenizer) -> dict:
    """What identifies a tokenizer's behaviour: its files' bytes and the library versions."""
    source = getattr(tokenizer, "source", None)
    if source is None:
        return dict(kind=type(tokenizer).__name__)
    import tokenizers
    import transformers
    files = {name: file_sha256(os.path.join(source, name)) for name in TOKENIZER_FILES
             if os.path.isfile(os.path.join(source, name))}
    return dict(kind=type(tokenizer.tok).__name__, files=files, transformers=transformers.__version__,
                tokenizers=tokenizers.__version__)


def cache_inputs(cfg, tokenizer) -> dict:
    """Everything the prepared rows depend on (see the module docstring), as a JSON-able mapping."""
    from .datasets import check_entries
    here = os.path.dirname(os.path.abspath(__file__))
    return dict(format=FORMAT_VERSION,
                code={name: file_sha256(os.path.join(here, name)) for name in CODE_FILES},
                datasets=[dict(e, sha256=file_sha256(e["path"])) for e in check_entries(cfg.datasets)],
                tokenizer=tokenizer_inputs(tokenizer), train_on_inputs=bool(cfg.train_on_inputs),
                sequence_len=int(cfg.sequence_len), sample_packing=bool(cfg.sample_packing),
                val_set_size=float(cfg.val_set_size), seed=int(cfg.seed))


def cache_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------ one entry
def _split_state(data: Optional[PackedData]) -> Optional[dict]:
    if data is None:
        return None
    return dict(input_ids=data.rows["input_ids"].to(torch.int32), labels=data.rows["labels"].to(torch.int32),
                plan_sizes=torch.tensor([len(p) for p in data.plan], dtype=torch.long),
                plan=torch.tensor([i for p in data.plan for i in p], dtype=torch.long),
                lengths=plan_lengths(data), num_examples=data.num_examples, sequence_len=data.sequence_len,
                seed=data.seed, packing=data.packing, fingerprint=data.fingerprint)


def plan_lengths(data: PackedData) -> torch.Tensor:
    """The length of every example of every row, in plan order (counted from document_ids)."""
    docs = data.rows["document_ids"]
    n, T = docs.shape
    counts = torch.bincount((torch.arange(n)[:, None] * (T + 1) + docs).view(-1), minlength=n * (T + 1))
    sizes = torch.tensor([len(p) for p in data.plan], dtype=torch.long)
    return counts.view(n, T + 1)[torch.arange(T + 1)[None, :] < sizes[:, None]]


def _split_from_state(s: Optional[dict]) -> Optional[PackedData]:
    """Rebuild a split: position_ids and document_ids from the plan's lengths, vectorized."""
    if s is None:
        return None
    n, T = s["input_ids"].shape
    sizes, lengths = s["plan_sizes"], s["lengths"]
    row_of = torch.repeat_interleave(torch.arange(n), sizes)           # the row of each example
    used = torch.zeros(n, dtype=torch.long).index_add_(0, row_of, lengths)
    # the segments of all rows in order: each row's examples, then its padding (a document of its own)
    seg_row = torch.cat([row_of, torch.arange(n)])
    seg_doc = torch.cat([torch.arange(len(lengths)) - torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes),
                         sizes])
    seg_len = torch.cat([lengths, T - used])
    order = torch.argsort(seg_row * (T + 2) + seg_doc, stable=True)
    seg_doc, seg_len = seg_doc[order], seg_len[order]
    docs = torch.repeat_interleave(seg_doc, seg_len).view(n, T)
    starts = torch.repeat_interleave(seg_len.cumsum(0) - seg_len, seg_len)
    pos = (torch.arange(n * T) - starts).view(n, T)
    rows = dict(input_ids=s["input_ids"].long(), labels=s["labels"].long(), position_ids=pos, document_ids=docs)
    flat = s["plan"].tolist()
    bounds = (sizes.cumsum(0) - sizes).tolist()
    plan = [flat[b:b + k] for b, k in zip(bounds, sizes.tolist())]
    data = PackedData.from_rows(rows, plan, s["sequence_len"], s["seed"], s["packing"], s["num_examples"])
    if data.fingerprint != s["fingerprint"]:
        raise ValueError("the rows rebuilt from the prepared entry differ from the ones prepared")
    return data


def save_entry(root: str, key: str, inputs: dict, run: DatasetRun) -> str:
    """Write the entry into a private temporary folder, then rename it into place (atomic)."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, key)
    tmp = os.path.join(root, f"{key}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    data_path = os.path.join(tmp, "data.pt")
    torch.save(dict(train=_split_state(run.train), val=_split_state(run.val)), data_path)
    meta = dict(key=key, inputs=inputs, notes=run.notes, sha256=file_sha256(data_path),
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
        if meta.get("key") != key or size != meta["size"] or file_sha256(data_path) != meta["sha256"]:
            raise DamagedEntry(f"data.pt has {size} bytes, meta.json records {meta.get('size')} bytes and its "
                               f"sha256; a truncated or altered file")
        state = torch.load(data_path, weights_only=True)
        train, val = _split_from_state(state["train"]), _split_from_state(state["val"])
    except DamagedEntry:
        raise
    except (OSError, ValueError, KeyError, RuntimeError, EOFError) as err:
        raise DamagedEntry(f"{type(err).__name__}: {err}") from None
    return DatasetRun(tokenizer, train, val, list(meta["notes"]))


# ------------------------------------------------------------------------------ the run's data
def _check_writable(root: str) -> None:
    """Every rank, at once: a folder nobody can write would leave the waiters waiting."""
    probe = os.path.abspath(root)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK):
        raise ValueError(f"dataset_prepared_path={root!r}: {probe!r} is not writable; set "
                         f"dataset_prepared_path to a folder this job can write")


def load_or_prepare(cfg, tokenizer, prepare_fn, progress: bool = False, local_rank: Optional[int] = None,
                    world_size: Optional[int] = None) -> DatasetRun:
    """The DatasetRun of cfg: loaded from dataset_prepared_path, or prepared (prepare_fn(cfg,
    tokenizer, progress)) and saved there. Communicates only through the folder."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    root = prepared_root(cfg)
    _check_writable(root)
    start = time.perf_counter()
    inputs = cache_inputs(cfg, tokenizer)
    key = cache_key(inputs)
    path, error_path = os.path.join(root, key), os.path.join(root, f"{key}.error.json")
    if local_rank != 0 and world_size > 1:
        run = _wait(path, error_path, key, tokenizer, cfg.ddp_timeout, root)
        run.notes.append(f"loaded the prepared dataset from {path} (key {key}) in "
                         f"{time.perf_counter() - start:.1f} s")
        return run
    notes: List[str] = []
    try:
        run = load_entry(path, key, tokenizer)
    except DamagedEntry as err:
        msg = f"the prepared dataset {path} is damaged ({err}); preparing it again"
        warnings.warn(msg)
        notes.append("warning: " + msg)
        aside = f"{path}.damaged-{socket.gethostname()}-{os.getpid()}"
        try:
            os.replace(path, aside)
            shutil.rmtree(aside, ignore_errors=True)
        except OSError:
            pass                        # another writer moved it already
        run = None
    if run is not None:
        run.notes.append(f"loaded the prepared dataset from {path} (key {key}) in "
                         f"{time.perf_counter() - start:.1f} s")
        return run
    if os.path.exists(error_path):
        os.remove(error_path)
    try:
        run = prepare_fn(cfg, tokenizer, progress)
    except ValueError as err:           # bad data: every waiting rank raises it too
        os.makedirs(root, exist_ok=True)
        tmp = f"{error_path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(dict(key=key, message=str(err)), f)
        os.replace(tmp, error_path)
        raise
    save_entry(root, key, inputs, run)
    run.notes.extend(notes)
    run.notes.append(f"prepared the dataset in {time.perf_counter() - start:.1f} s and saved it to {path} "
                     f"(key {key}); later runs with the same data, tokenizer and settings load it")
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
                message = None          # being written: read it on the next poll
            if message is not None:
                raise ValueError(message)
        meta = os.path.join(path, "meta.json")
        stamp = _stamp(meta)
        if stamp is not None and stamp != seen:
            try:
                run = load_entry(path, key, tokenizer)
                if run is not None:
                    return run
            except DamagedEntry:
                seen = stamp            # the writer is replacing it: check again when it changes
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s (ddp_timeout) for local rank 0 to prepare the dataset "
                               f"{path}; see local rank 0's error, or raise ddp_timeout (dataset_prepared_path "
                               f"{root})")
        time.sleep(POLL_S)


def _stamp(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns
