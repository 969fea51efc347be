"""dataset_prepared_path (minipar/trainer/data/prepared.py): tokenized once, loaded bit for bit after,
keyed by everything that decides the rows, safe against damage, dead writers and waiting ranks."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest
import torch
import yaml
from harness import run_world

from minipar.trainer.checkpoint import atomic
from minipar.trainer.config.train_config import TrainConfig, load_config
from minipar.trainer.data import prepared
from minipar.trainer.data.batches import ByteTokenizer
from minipar.trainer.data.example_data import make_tokenizer
from minipar.trainer.data.packing import prepare
from minipar.trainer.data.tokenizer import load_tokenizer

TEXTS = ["the quick brown fox", "jumps over", "the lazy dog and runs far away", "a", "bb cc dd ee ff",
         "gg hh", "ii jj kk ll mm nn oo", "pp", "qq rr ss", "tt uu vv ww xx"]


def _data(tmp_path, texts=TEXTS, name="notes.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(dict(text=t)) + "\n" for t in texts))
    return str(path)


def _cfg(tmp_path, **kw):
    base = dict(datasets=[dict(path=_data(tmp_path), type="completion")], sequence_len=48,
                sample_packing=True, val_set_size=0.2, output_dir=str(tmp_path / "out"), ddp_timeout=30,
                dataset_prepared_path=str(tmp_path / "out" / "prepared"))
    return TrainConfig(**{**base, **kw})


def _never(cfg, tokenizer, progress):
    raise AssertionError("tokenized again instead of loading the prepared dataset")


def _counting():
    calls = []

    def fn(cfg, tokenizer, progress):
        calls.append(1)
        return prepare(cfg, tokenizer, progress)
    return fn, calls


def _same(a, b):
    for split in ("train", "val"):
        x, y = getattr(a, split), getattr(b, split)
        assert (x is None) == (y is None)
        if x is None:
            continue
        assert x.fingerprint == y.fingerprint and x.plan == y.plan and x.num_examples == y.num_examples
        assert (x.sequence_len, x.seed, x.packing) == (y.sequence_len, y.seed, y.packing)
        for k in prepared.ROW_KEYS:
            assert x.rows[k].dtype == y.rows[k].dtype == torch.long and torch.equal(x.rows[k], y.rows[k]), k


def test_dataset_prepared_path_is_a_config_key(tmp_path):
    data = _data(tmp_path)
    cache = os.path.join(os.environ["MINIPAR_CACHE"], "prepared")   # not per output_dir: keyed by content
    for value, root in [("last_run_prepared", "last_run_prepared"), (None, cache)]:
        path = tmp_path / "c.yaml"                        # Axolotl writes `dataset_prepared_path:` (null) too
        path.write_text(yaml.safe_dump(dict(datasets=[dict(path=data, type="completion")],
                                            output_dir=str(tmp_path / "o"), dataset_prepared_path=value)))
        notes = []
        cfg = load_config(str(path), [], notes)
        assert cfg.dataset_prepared_path == value and prepared.prepared_root(cfg) == root
        assert not any("dataset_prepared_path" in n for n in notes)
    notes = []
    load_config(None, ["--dataset_prepared_path", "x"], notes)   # the byte corpus: said, not silently ignored
    assert any(n.startswith("dataset_prepared_path 'x' has no effect without `datasets`") for n in notes)


@pytest.mark.parametrize("packing", [True, False])
def test_second_start_loads_the_same_rows_without_tokenizing(tmp_path, packing):
    cfg, tok = _cfg(tmp_path, sample_packing=packing), ByteTokenizer()
    fresh = prepare(cfg, tok)
    first = prepared.load_or_prepare(cfg, tok, prepare)
    key = prepared.cache_key(prepared.cache_inputs(cfg, tok))
    where = os.path.join(str(tmp_path / "out" / "prepared"), key)
    assert f"saved it to {where}" in first.notes[-1]
    again = prepared.load_or_prepare(cfg, tok, _never)
    assert again.notes[-1].startswith(f"loaded prepared dataset from {where}")
    assert again.notes[:-1] == fresh.notes, "the data notes travel with the entry"
    _same(fresh, first)
    _same(fresh, again)
    assert again.val is not None


def test_every_key_input_prepares_anew(tmp_path):
    tok = ByteTokenizer()
    cfg = _cfg(tmp_path)
    prepared.load_or_prepare(cfg, tok, prepare)
    fn, calls = _counting()
    prepared.load_or_prepare(cfg, tok, fn)
    assert calls == [], "the same inputs load"
    # the model, batch and layout do not change the rows: the same key
    same = _cfg(tmp_path, global_batch_size=4, tp_size=2, learning_rate=1.0)
    assert prepared.cache_inputs(same, tok) == prepared.cache_inputs(cfg, tok)
    changes = dict(sequence_len=dict(sequence_len=40), seed=dict(seed=1), packing=dict(sample_packing=False),
                   val=dict(val_set_size=0.3), inputs=dict(train_on_inputs=True))
    for what, change in changes.items():
        before = len(calls)
        run = prepared.load_or_prepare(_cfg(tmp_path, **change), tok, fn)
        assert len(calls) == before + 1, f"{what} changed: prepared anew"
        _same(run, prepare(_cfg(tmp_path, **change), tok))
    keys = {prepared.cache_key(prepared.cache_inputs(_cfg(tmp_path, **c), tok)) for c in changes.values()}
    assert len(keys) == len(changes)
    # one byte of a data file
    data = _data(tmp_path, [TEXTS[0].replace("q", "Q")] + TEXTS[1:], name="edited.jsonl")
    edited = _cfg(tmp_path, datasets=[dict(path=data, type="completion")])
    (tmp_path / "edited.jsonl").write_text((tmp_path / "notes.jsonl").read_text())
    before = len(calls)
    prepared.load_or_prepare(edited, tok, fn)           # same bytes as notes.jsonl, another path
    assert len(calls) == before, "the key is the content, not the path: the same bytes load"
    data_bytes = bytearray((tmp_path / "edited.jsonl").read_bytes())
    data_bytes[12] ^= 1
    (tmp_path / "edited.jsonl").write_bytes(bytes(data_bytes))
    prepared.load_or_prepare(edited, tok, fn)
    assert len(calls) == before + 1, "one flipped bit of it: prepared anew"


def test_the_tokenizer_is_in_the_key(tmp_path):
    tok_dir = make_tokenizer(str(tmp_path / "tok"), 300, max_chars=5_000)
    hf, byte = load_tokenizer(tok_dir), ByteTokenizer()
    cfg = _cfg(tmp_path)
    keys = [prepared.cache_key(prepared.cache_inputs(cfg, t)) for t in (byte, hf)]
    fn, calls = _counting()
    prepared.load_or_prepare(cfg, hf, fn)
    prepared.load_or_prepare(cfg, hf, fn)
    assert calls == [1], "prepared once for the HF tokenizer"
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        conf = json.load(f)
    conf["model_max_length"] = 12345                    # any byte of a tokenizer file
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump(conf, f)
    keys.append(prepared.cache_key(prepared.cache_inputs(cfg, load_tokenizer(tok_dir))))
    assert len(set(keys)) == 3


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_damaged_entry_is_named_and_prepared_again(tmp_path, damage):
    cfg, tok = _cfg(tmp_path), ByteTokenizer()
    first = prepared.load_or_prepare(cfg, tok, prepare)
    key = prepared.cache_key(prepared.cache_inputs(cfg, tok))
    data_pt = os.path.join(prepared.prepared_root(cfg), key, "data.pt")
    raw = bytearray(open(data_pt, "rb").read())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    else:
        raw[len(raw) // 2] ^= 0xFF                      # same size, one byte flipped
    open(data_pt, "wb").write(bytes(raw))
    fn, calls = _counting()
    with pytest.warns(UserWarning, match=f"{key} is damaged .*preparing it again"):
        again = prepared.load_or_prepare(cfg, tok, fn)
    assert calls == [1] and any(n.startswith("warning: the prepared dataset") for n in again.notes)
    _same(first, again)
    assert os.listdir(prepared.prepared_root(cfg)) == [key], "the damaged one is gone"
    _same(first, prepared.load_or_prepare(cfg, tok, _never))


def test_a_bad_row_reaches_the_waiting_ranks(tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    cfg = _cfg(tmp_path, datasets=[dict(path=str(bad), type="completion")], val_set_size=0.0)
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="bad.jsonl:2: the row has no field 'text'") as writer:
        prepared.load_or_prepare(cfg, tok, prepare)
    key = prepared.cache_key(prepared.cache_inputs(cfg, tok))
    marker = os.path.join(prepared.prepared_root(cfg), f"{key}.error.json")
    assert json.load(open(marker))["message"] == str(writer.value)
    monkeypatch.setenv("LOCAL_RANK", "1")                # a rank of the same node that waits
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as waiter:
        prepared.load_or_prepare(cfg, tok, _never)
    assert str(waiter.value) == str(writer.value)


def test_a_dead_writers_tmp_folder_does_not_block(tmp_path):
    cfg, tok = _cfg(tmp_path), ByteTokenizer()
    root, key = prepared.prepared_root(cfg), prepared.cache_key(prepared.cache_inputs(cfg, tok))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(root, f"{key}.tmp-{atomic.owner_tag(pid=dead.pid)}")
    os.makedirs(stale)
    open(os.path.join(stale, "data.pt"), "wb").write(b"half a file")
    live = os.path.join(root, f"{key}.tmp-{atomic.owner_tag(pid=os.getppid())}")    # alive: kept
    os.makedirs(live)
    run = prepared.load_or_prepare(cfg, tok, prepare)
    _same(run, prepare(cfg, tok))
    assert sorted(os.listdir(root)) == sorted([key, os.path.basename(live)])


def test_a_waiter_times_out_naming_the_folder(tmp_path):
    cfg, tok = _cfg(tmp_path, ddp_timeout=0.3), ByteTokenizer()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"waited 0.3 s .*{prepared.prepared_root(cfg)}"):
        prepared.load_or_prepare(cfg, tok, _never, local_rank=1, world_size=2)
    assert time.monotonic() - t0 < 5


def test_an_unwritable_folder_is_refused_on_every_rank(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = _cfg(tmp_path, dataset_prepared_path=str(blocker / "prepared"))
    for rank in (0, 1):
        with pytest.raises(ValueError, match="dataset_prepared_path=.*not a writable folder"):
            prepared.load_or_prepare(cfg, ByteTokenizer(), _never, local_rank=rank, world_size=2)


def _both_ranks(cfg):
    run = prepared.load_or_prepare(cfg, ByteTokenizer(), prepare)    # LOCAL_RANK from the harness
    return dict(rows={k: run.train.rows[k] for k in prepared.ROW_KEYS}, plan=run.train.plan,
                fingerprint=run.train.fingerprint, note=run.notes[-1])


def test_two_ranks_on_one_folder_get_the_same_rows(tmp_path):
    cfg = _cfg(tmp_path, dataset_prepared_path=str(tmp_path / "shared"))
    r0, r1 = run_world(_both_ranks, 2, cfg, init=False, timeout=60)
    assert r0["note"].startswith("prepared the dataset") and r1["note"].startswith("loaded prepared dataset")
    assert r0["fingerprint"] == r1["fingerprint"] == prepare(cfg, ByteTokenizer()).train.fingerprint
    assert r0["plan"] == r1["plan"]
    assert all(torch.equal(r0["rows"][k], r1["rows"][k]) for k in prepared.ROW_KEYS)


# ------------------------------------------------------------------------------ the training program
def _train_twice(path, out):
    from minipar.trainer import lifecycle
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    results = []
    for name in ("first", "second"):                # two starts on one prepared folder
        run = setup_run([path, "--output_dir", str(out / name)])
        results.append((run.notes, [(r["step"], r["loss"], r.get("val_loss")) for r in Trainer(run).train()]))
        lifecycle.teardown(run.pgm)
    return results


def test_a_run_from_the_prepared_dataset_trains_the_same(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (the run plots its loss curve: imported once, before the fork)
    cfg = dict(datasets=[dict(path=_data(tmp_path, TEXTS * 3), type="completion")], sample_packing=True,
               val_set_size=0.1, sequence_len=32, global_batch_size=4, max_steps=2, warmup_steps=1,
               eval_steps=2, eval_batches=1, logging_steps=100, progress_bar=False,
               save_final_checkpoint=False, export_hf=False,
               dataset_prepared_path=str(tmp_path / "prepared"),
               model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    (notes1, curve1), (notes2, curve2) = run_world(_train_twice, 1, str(path), tmp_path, timeout=120)[0]
    assert any(n.startswith("prepared the dataset") for n in notes1)
    assert any(n.startswith(f"loaded prepared dataset from {tmp_path / 'prepared'}") for n in notes2)
    assert len(curve1) == 2 and curve1[-1][2] is not None
    assert curve1 == curve2, "the same losses, bit for bit"
