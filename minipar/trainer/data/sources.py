"""Where a `datasets` entry's rows come from: local files, read as Axolotl reads them.

    path: data/chat.jsonl                one JSON object per line (read here, line by line)
    path: data/book.txt                  plain text: one example per paragraph (blank-line separated)
    path: data/rows.jsonl                JSON lines; a json file may also hold one JSON array of objects
    path: data/rows.parquet | .arrow | .csv
    path: data/saved                     a folder written by Dataset.save_to_disk (or DatasetDict's)
    path: data/dir + data_files: [...]   the named files, of ds_type (default json)
    ds_type: json | csv | parquet | arrow | text   the reader when the extension does not say it
    split: train                         the split to read (Axolotl's default "train"; "train[:100]" too)
    name: CONFIG                         a dataset's configuration name, passed to load_dataset

JSON lines and .txt files are read here, with no library: a bad row names its line, and the common
case needs nothing beyond the standard library. Everything else goes through Hugging Face
`datasets` (what Axolotl reads with, imported only then): load_dataset(ds_type, data_files=...,
split=..., streaming=True) reads a file row by row without writing an Arrow cache, and
load_from_disk opens a save_to_disk folder (memory-mapped). The rows are plain dicts either way.

Each row comes with where it is, "file:line" for the files read here and "file:row N" (1-based)
for the others, so a bad row's error names it. Pure Python on each rank; no communication.
"""
from __future__ import annotations

import itertools
import json
import os
import re
from typing import Iterator, List, Tuple

from minipar.trainer.data.batches import check_data_file

EXTENSIONS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".txt": "text", ".json": "json",
              ".jsonl": "json"}
DS_TYPES = ("json", "csv", "parquet", "arrow", "text")
SOURCE_KEYS = ("path", "split", "data_files", "name", "ds_type")
EXPECTED = ("a local .jsonl, .json, .txt, .parquet, .arrow or .csv file, or a folder written by "
            "save_to_disk (or one with data_files); no hub names")


def ds_type(entry: dict) -> str:
    """The reader of an entry: ds_type, else the path's extension (Axolotl's rule), else json."""
    if entry.get("ds_type"):
        return entry["ds_type"]
    return EXTENSIONS.get(os.path.splitext(str(entry["path"]))[1].lower(), "json")


def data_files(entry: dict) -> List[str]:
    files = entry.get("data_files")
    return [] if files is None else [files] if isinstance(files, str) else [str(f) for f in files]


def check_source(entry: dict, what: str = "datasets: file") -> None:
    """The entry's path (and data_files) exist as something this module can read (no file read)."""
    path = str(entry["path"])
    if entry.get("ds_type") is not None and entry["ds_type"] not in DS_TYPES:
        raise ValueError(f"{path}: ds_type {entry['ds_type']!r} is not known; use one of {DS_TYPES}")
    if os.path.isdir(path):
        for f in data_files(entry):
            check_data_file(f, f"{path}: data_files entry", EXPECTED)
        if not data_files(entry) and not os.path.isfile(os.path.join(path, "dataset_dict.json")) \
                and not os.path.isfile(os.path.join(path, "dataset_info.json")):
            raise ValueError(f"{what} {path!r} is a directory but not one written by save_to_disk (no "
                             f"dataset_info.json or dataset_dict.json); name its files with data_files, "
                             f"or give {EXPECTED}")
        return
    check_data_file(path, what, EXPECTED)


def source_files(entry: dict) -> List[str]:
    """Every file whose bytes decide the entry's rows, in a fixed order (prepared.py hashes them)."""
    path = str(entry["path"])
    if not os.path.isdir(path):
        return [path]
    if data_files(entry):
        return data_files(entry)
    return sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)


def _line_reader(entry: dict) -> bool:
    """Read here (line numbers, no library): .txt paragraphs and JSON lines, with no split, name or
    data_files; a .json file whose first character opens an array goes to `datasets` instead."""
    path = str(entry["path"])
    if os.path.isdir(path) or entry.get("name") or entry.get("data_files") \
            or entry.get("split") not in (None, "train"):
        return False
    kind = ds_type(entry)
    if kind == "text" and entry.get("ds_type") is None:      # minipar's paragraphs; ds_type: text = lines
        return True
    if kind != "json":
        return False
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    return not head.startswith("[")


def read_rows(path: str) -> Iterator[Tuple[int, object]]:
    """(line number, row): JSON rows of a JSON-lines file, or text paragraphs of a .txt file."""
    check_data_file(path)
    with open(path, encoding="utf-8") as f:
        if path.endswith(".txt"):
            para, start = [], 0
            for n, line in enumerate(f, 1):
                if line.strip():
                    start = start or n
                    para.append(line.rstrip("\n"))
                elif para:
                    yield start, "\n".join(para)
                    para, start = [], 0
            if para:
                yield start, "\n".join(para)
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not valid JSON ({err.msg}); a JSONL file holds one object "
                                 f"per line, a .json file one array of objects") from None


def _hf_rows(entry: dict) -> Iterator[dict]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{entry['path']}: reading this file needs the `datasets` package (pip install "
                          f"datasets); JSON lines and .txt files need nothing") from None
    path, split = str(entry["path"]), entry.get("split") or "train"
    cut = re.fullmatch(r"(\w+)\[(\d*):(\d*)\]", split)       # train[:100]: rows sliced as they stream
    if "[" in split and not cut:
        raise ValueError(f"{path}: split {split!r}: only row slices such as train[:100] or train[10:20] "
                         f"are read (no percentages)")
    if cut:
        split, lo, hi = cut.group(1), int(cut.group(2) or 0), int(cut.group(3)) if cut.group(3) else None
        yield from itertools.islice(_hf_rows(dict(entry, split=split)), lo, hi)
        return
    datasets.disable_progress_bars()
    try:
        if os.path.isdir(path) and not data_files(entry):
            ds = datasets.load_from_disk(path)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ValueError(f"{path}: split {split!r} is not in this save_to_disk folder; it has "
                                     f"{sorted(ds)}: set `split`")
                ds = ds[split]
        else:
            files = data_files(entry) or [path]
            ds = datasets.load_dataset(ds_type(entry), data_files=files, split=split, name=entry.get("name"),
                                       streaming=True)
        yield from ds
    except ValueError as err:
        raise ValueError(f"{path}: datasets cannot read it as {ds_type(entry)} (split {split!r}): "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    except (OSError, TypeError, KeyError) as err:
        raise ValueError(f"{path}: datasets cannot read it as {ds_type(entry)}: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}; set ds_type to the file's "
                         f"format") from None


def entry_rows(entry: dict) -> Iterator[Tuple[str, object]]:
    """(where, row) of every row of one entry, in file order."""
    path = str(entry["path"])
    if _line_reader(entry):
        for line, row in read_rows(path):
            yield f"{path}:{line}", row
        return
    check_source(entry)
    for n, row in enumerate(_hf_rows(entry), 1):
        yield f"{path}:row {n}", row
