"""Issue 41, item 2: pretraining_dataset streamed (minipar/trainer/data/stream.py, stream_sampler.py).

A corpus that fits one buffer gives the rows of the same entries prepared once, in the same order,
so the streamed run's loss curve is the prepared run's, on one process and on dp 2; several buffers
give the hand-computed sequence; parquet, csv and save_to_disk folders stream the JSON-lines rows; a
killed run resumed from its checkpoint sees the batches of an uninterrupted one (1 and 2 ranks, and on
another layout); the first step comes before the files are read through; the config refuses what a
stream cannot do in the one message.
"""
import importlib.util
import json
import os
import random
from types import SimpleNamespace

import pytest
import torch
import yaml
from harness import RankError, run_world
from test_train import kill_at_step

from minipar.batch_split import IGNORE_INDEX
from minipar.trainer.data.batches import ByteTokenizer
from minipar.trainer.data.example_data import make_tokenizer
from minipar.trainer.data.packing import RowSampler, pack_plan, prepare
from minipar.trainer.data.stream import ORDER_STRIDE, PLAN_STRIDE, open_stream
from minipar.trainer.data.stream_sampler import StreamSampler
from minipar.trainer.data.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = open(os.path.join(ROOT, "data", "shakespeare.txt")).read().split()[:5000]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(d / "tokenizer"), vocab_size=384, max_chars=60_000)
    return load_tokenizer(str(d / "tokenizer"))


def _corpus(path, n, seed=0, longest=40):
    rng = random.Random(seed)
    rows = [dict(content=" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, longest))))
            for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(corpus, **over):
    base = dict(datasets=[dict(path=corpus, type="pretrain", field="content")], sequence_len=32,
                train_on_inputs=False, sample_packing=True, val_set_size=0, seed=3,
                pretrain_multipack_attn=True, streaming_multipack_buffer_size=10_000, max_steps=10,
                dataset_prepared_path=None)
    return SimpleNamespace(**dict(base, **over))


# ------------------------------------------------------------------ the rows, without training
@pytest.mark.parametrize("packing", [True, False])
def test_one_buffer_is_the_prepared_rows_in_their_order(tmp_path, tok, packing):
    """The equality behind the loss curves: every global batch, over three epochs, is the prepared
    run's (packing.prepare + RowSampler) tensor for tensor."""
    cfg = _cfg(_corpus(tmp_path / "web.jsonl", 30), sample_packing=packing)
    prepared = RowSampler(prepare(cfg, tok).train, 8, cfg.seed)
    streamed = StreamSampler(open_stream(cfg, tok).train, 8)
    epochs = 3 * prepared.data.num_rows // 8
    for step in range(epochs):
        a, b = prepared.global_batch(step), streamed.global_batch(step)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"step {step}"
    assert streamed.progress(epochs)["stream_epoch"] == 2


def test_several_buffers_are_the_hand_computed_sequence(tmp_path):
    """Bytes as tokens, sequence_len 4, buffers of 2 documents, no packing: each document's pieces
    are written out by hand; the order within a buffer is the documented seeded permutation."""
    docs = ["abcdefg", "hi", "jklmn", "o", "pqrs"]
    corpus = tmp_path / "t.jsonl"
    corpus.write_text("".join(json.dumps(dict(text=d)) + "\n" for d in docs))
    # a 1-token piece ("n", "o") has one label, -100: it trains nothing and is left out, as prepared
    pieces = [["abcd", "efg"], ["hi"], ["jklm"], [], ["pqrs"]]
    cfg = _cfg(str(corpus), sequence_len=4, sample_packing=False, streaming_multipack_buffer_size=2,
               datasets=[dict(path=str(corpus), type="pretrain", field="text")], seed=5)
    sampler = StreamSampler(open_stream(cfg, ByteTokenizer()).train, 3)

    def buffer_rows(epoch, k):
        rows = [p for d in docs[2 * k:2 * k + 2] for p in pieces[docs.index(d)]]
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch + k * ORDER_STRIDE)
        return [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    expected = [r for e in range(3) for k in range(3) for r in buffer_rows(e, k)]
    got = []
    for step in range(len(expected) // 3):
        b = sampler.global_batch(step)
        for ids, labels in zip(b["input_ids"].tolist(), b["labels"].tolist()):
            text = bytes(i for i in ids if i).decode()
            got.append(text)
            want = [ord(c) for c in text[1:]] + [IGNORE_INDEX] * (5 - len(text))
            # the label of a cut piece's last token is the next piece's first (the document goes on)
            whole = next(d for d in docs if text in d)
            after = whole[whole.index(text) + len(text):]
            want[len(text) - 1] = ord(after[0]) if after else IGNORE_INDEX
            assert labels == want[:4], (text, labels)
    assert got == expected


def test_packed_buffers_keep_their_documents_and_plan(tmp_path, tok):
    """With packing, buffer k's rows are pack_plan over its own documents (seed + k * PLAN_STRIDE):
    the rows of epoch 0 are buffer 0's, then buffer 1's, ...; pretrain_multipack_attn: false drops
    the document ids (attention across the row)."""
    cfg = _cfg(_corpus(tmp_path / "web.jsonl", 20), streaming_multipack_buffer_size=7)
    stream = open_stream(cfg, tok).train
    buffers, start = [], stream.start
    for k in range(3):
        buf = stream.buffer(0, k, start)
        examples, _, _ = stream.pieces(*start, 7)
        plan = pack_plan(examples.lengths().tolist(), 32, cfg.seed + k * PLAN_STRIDE, True)
        assert len(buf.tokens) == len(plan)
        assert int(buf.tokens.sum()) == int(examples.lengths().sum())     # every piece, once
        buffers.append(buf)
        start = buf.end
    assert stream.buffer(0, 3, start) is None                   # 20 documents: 7 + 7 + 6
    sampler = StreamSampler(stream, 5)
    want = torch.cat([b.rows["input_ids"] for b in buffers]).long()
    rows = torch.cat([sampler.global_batch(s)["input_ids"] for s in range(len(want) // 5 + 1)])
    assert torch.equal(rows[:len(want)], want)
    apart = open_stream(_cfg(cfg.datasets[0]["path"], pretrain_multipack_attn=False), tok).train
    apart = StreamSampler(apart, 4)
    assert set(apart.global_batch(0)) == {"input_ids", "labels"}


@pytest.mark.skipif(importlib.util.find_spec("datasets") is None, reason="needs Hugging Face datasets")
def test_every_file_type_streams_the_same_rows_and_resumes_mid_buffer(tmp_path, tok):
    """parquet, csv and a save_to_disk folder (read lazily by `datasets`, streaming=True or memory-mapped)
    give the JSON-lines file's batches; a sampler loaded from the state of step 3 (inside a buffer,
    its file position a row count) continues with the uninterrupted batches."""
    import datasets
    jsonl = _corpus(tmp_path / "web.jsonl", 18)
    rows = [json.loads(x) for x in open(jsonl)]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "web.parquet"))
    ds.to_csv(str(tmp_path / "web.csv"), index=False)
    ds.save_to_disk(str(tmp_path / "saved"))

    def batches(path, resume_at=None, steps=6):
        cfg = _cfg(path, streaming_multipack_buffer_size=5, val_set_size=2)
        sampler = StreamSampler(open_stream(cfg, tok).train, 3)
        if resume_at is not None:
            state = batches(path, steps=resume_at)[1]
            sampler.load_state_dict(state)
        first = resume_at or 0
        got = [sampler.global_batch(s) for s in range(first, steps)]
        return got, sampler.state_dict(steps)
    want, state = batches(jsonl)
    assert state["position"]["buffer"] >= 1 and batches(jsonl, steps=3)[1]["position"]["used"] > 0
    for path in (str(tmp_path / "web.parquet"), str(tmp_path / "web.csv"), str(tmp_path / "saved"), jsonl):
        for resume_at in (None, 3):
            got = batches(path, resume_at)[0]
            for a, b in zip(want[resume_at or 0:], got):
                assert all(torch.equal(a[k], b[k]) for k in a), (path, resume_at)
        assert len(got) == 3


# ------------------------------------------------------------------ runs
MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1)


def _yaml(tmp_path, name, tok, corpus, **over):
    run = dict(pretraining_dataset=[dict(path=corpus, text_column="content")], tokenizer_config=tok.source,
               sample_packing=True, sequence_len=32, global_batch_size=4, max_steps=8, warmup_steps=1,
               learning_rate=3e-3, logging_steps=100, progress_bar=False, save_final_checkpoint=False,
               peak_tflops=1, loss_curve=False,        # no peak measured, no PNG: unread here
               export_hf=False, eval_steps=0, output_dir=str(tmp_path / name), model=MODEL,
               dataset_prepared_path=str(tmp_path / "prepared"))
    run.update(over)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(run))
    return str(path)


def _train(path, *argv):
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    history = Trainer(setup_run([path, *argv])).train()
    return [(r["step"], r["loss"], r.get("val_loss"), r.get("stream_tokens")) for r in history]


def _train_until_killed(path, kill_at, *argv):
    """SIGKILL every rank at step kill_at, as a dead node: no cleanup, no final save."""
    kill_at_step(kill_at)
    _train(path, *argv)


def _same(a, b, rel):
    assert [x[0] for x in a] == [x[0] for x in b]
    for x, y in zip(a, b):
        assert abs(x[1] - y[1]) <= rel * abs(x[1]), (x, y)
        assert (x[2] is None) == (y[2] is None), (x, y)
        assert x[2] is None or abs(x[2] - y[2]) <= rel * abs(x[2]), (x, y)


def test_streamed_loss_curve_is_the_prepared_one_on_one_and_two_ranks(tmp_path, tok):
    """One buffer holds the corpus: streamed and prepared runs read the same rows (above), so their
    curves are equal on each layout, and dp 2 has the one-process curve."""
    corpus = _corpus(tmp_path / "web.jsonl", 24)
    curves = {}
    for world in (1, 2):
        for streaming in (True, False):
            path = _yaml(tmp_path, f"w{world}{streaming}", tok, corpus, streaming=streaming, max_steps=6)
            curves[world, streaming] = run_world(_train, world, path, timeout=200)[0]
    for world in (1, 2):
        _same(curves[world, False], [h[:3] + (None,) for h in curves[world, True]], 1e-6)
        assert curves[world, True][-1][3] > 0 and curves[world, False][-1][3] is None
    _same(curves[1, True], curves[2, True], 1e-4)


# the 2-rank case (4 worlds, ~15 s) is slow; the 1-rank case is its fast twin
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kill_and_resume_sees_the_uninterrupted_batches(tmp_path, tok, world):
    """Buffers of 4 documents over 14 (4 buffers an epoch, the second epoch reached by step 6), the
    eval from the held-out head: killed at step 7 and resumed from step-6 (saved mid-buffer, a step
    prefetched past it), the curve and the streamed tokens are the uninterrupted run's; the 2-rank
    checkpoint resumed on one process too."""
    corpus = _corpus(tmp_path / "web.jsonl", 16, longest=15)
    common = dict(streaming_multipack_buffer_size=4, val_set_size=2, eval_steps=4)
    full = run_world(_train, world, _yaml(tmp_path, "full", tok, corpus, **common), timeout=200)[0]
    killed = _yaml(tmp_path, "run", tok, corpus, save_steps=3, save_total_limit=5, **common)
    with pytest.raises(RankError, match="killed"):
        run_world(_train_until_killed, world, killed, 7, timeout=200)
    saved = torch.load(tmp_path / "run" / "step-6" / "trainer_state.pt", weights_only=False)
    where = saved["extra"]["sampler"]["position"]
    assert where["epoch"] >= 1 and where["used"] > 0, where       # mid-buffer, past an epoch's end
    resumed = run_world(_train, world, killed, "--resume_from_checkpoint", "latest", timeout=200)
    for got in resumed:                            # the history after step 6 (metrics.jsonl keeps 1-6)
        got = [h for h in got if h[0] > 6]
        assert [h[0] for h in got] == [7, 8]
        _same(full[6:], got, 1e-6)
        assert [h[3] for h in got] == [h[3] for h in full[6:]]
    assert full[-1][2] is not None and full[-1][3] > 0
    if world == 2:
        single = run_world(_train, 1, killed, "--resume_from_checkpoint", str(tmp_path / "run" / "step-6"),
                           "--output_dir", str(tmp_path / "single"), timeout=200)[0]
        _same(full[6:], [h for h in single if h[0] > 6], 1e-4)


def _first_step(path):
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    trainer = Trainer(setup_run([path]))
    read_at_setup = trainer.batches.sampler.stream.docs_read
    trainer.train_step(0)
    return read_at_setup, trainer.batches.sampler.stream.docs_read


def test_the_first_step_comes_before_the_file_is_read_through(tmp_path, tok):
    corpus = _corpus(tmp_path / "big.jsonl", 400, longest=10)
    path = _yaml(tmp_path, "big", tok, corpus, streaming_multipack_buffer_size=8, val_set_size=3)
    at_setup, after_step = run_world(_first_step, 1, path, timeout=120)[0]
    assert at_setup == 3                           # the held-out head only
    assert 3 < after_step <= 3 + 4 * 8 < 400, after_step   # step 0 and the prefetched step 1


# ------------------------------------------------------------------ the config
def test_config_keys_and_refusals_in_one_message(tmp_path, tok):
    from minipar.trainer.config.train_config import load_config
    corpus = _corpus(tmp_path / "web.jsonl", 4)
    notes = []
    cfg = load_config(_yaml(tmp_path, "c", tok, corpus, pretrain_multipack_buffer_size=64,
                            pretraining_sample_concatenation=True, sample_packing=False), [], notes)
    assert (cfg.streaming, cfg.streaming_multipack_buffer_size) == (True, 64)
    assert (cfg.sample_packing, cfg.pretrain_multipack_attn) == (True, False)
    assert any("pretraining_sample_concatenation" in n for n in notes)
    assert load_config(_yaml(tmp_path, "p", tok, corpus, streaming=False), []).streaming is False
    path = _yaml(tmp_path, "bad", tok, corpus, val_set_size=0.1, max_steps=None, num_epochs=1)
    with pytest.raises(ValueError) as info:
        load_config(path, [])
    msg = str(info.value)
    assert "max_steps is required with a streamed dataset" in msg and "val_set_size 0.1 is a fraction" in msg
    chat = dict(path=corpus, type="chat_template")
    with pytest.raises(ValueError, match="streams plain text \\(type pretrain\\) only"):
        load_config(_yaml(tmp_path, "chat", tok, corpus, pretraining_dataset=None, datasets=[chat],
                          streaming=True), [])
