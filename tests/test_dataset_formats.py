"""Axolotl's dataset formats and file types (minipar/trainer/data/formats.py, chat_format.py, sources.py):
the labels of each format equal Axolotl's masking rules on hand-written rows, every file type reads
the same rows, bad input keeps its one-line error, and pretraining_dataset trains 2 steps."""
import importlib.util
import json
import os

import pytest
import yaml
from harness import run_world

from minipar.trainer.data.datasets import check_entries, load_examples
from minipar.trainer.data.example_data import make_tokenizer
from minipar.trainer.data.formats import ALPACA_SYSTEM, ALPACA_SYSTEM_NO_INPUT
from minipar.trainer.data.tokenizer import load_tokenizer

IGNORE = -100
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who art thou?"},
                     {"role": "assistant", "content": "A king."}, {"role": "user", "content": "Of what?"},
                     {"role": "assistant", "content": "Of Denmark."}]}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(d / "tokenizer"), vocab_size=512)
    return load_tokenizer(str(d / "tokenizer"))


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _one(tok, path, train_on_inputs=False, **entry):
    ex = load_examples(check_entries([dict(path=str(path), **entry)]), tok, 256, train_on_inputs)
    return [(t.tolist(), lab.tolist()) for t, lab in (ex.example(i) for i in range(len(ex)))]


def _shift(axolotl_labels):
    """Axolotl's unshifted labels (the HF model shifts them) as minipar's shifted ones."""
    return axolotl_labels[1:] + [IGNORE]


def _chat_axolotl(tok, turns, trained_roles, eos_rule, train_on_inputs=False):
    """Axolotl's ChatTemplateStrategy labels, written from its rules: a trained turn's content tokens,
    and the eos right after a turn by train_on_eos (turn / all / last / none)."""
    text = tok.render_chat(turns)
    ids, offsets = tok.encode_with_offsets(text)
    labels, pos, last = [IGNORE] * len(ids), 0, -1
    for m in turns:
        a = text.index(m["content"], pos)
        b = pos = a + len(m["content"])
        inside = [t for t, (s, _) in enumerate(offsets) if a <= s < b]
        train = train_on_inputs or m["role"] in trained_roles
        if train:
            for t in inside:
                labels[t] = ids[t]
        eos = inside[-1] + 1
        assert ids[eos] == tok.eos_token_id
        if train or eos_rule == "all":
            last = eos
            if eos_rule == "all" or (eos_rule == "turn" and train):
                labels[eos] = ids[eos]
    if eos_rule == "last":
        labels[last] = ids[last]
    return ids, labels


# ------------------------------------------------------------------------------ labels per format
def test_alpaca_trains_the_response_only(tmp_path, tok):
    rows = [dict(instruction="Name a play.", input="By Shakespeare", output="Hamlet"),
            dict(instruction="Say hi.", output="Hi")]
    path = _jsonl(tmp_path / "a.jsonl", rows)
    prompts = [f"{ALPACA_SYSTEM}\n\n### Instruction:\nName a play.\n\n### Input:\nBy Shakespeare\n\n"
               "### Response:\n",
               f"{ALPACA_SYSTEM_NO_INPUT}\n\n### Instruction:\nSay hi.\n\n### Response:\n"]
    for inputs in (False, True):
        got = _one(tok, path, inputs, type="alpaca")
        for (ids, labels), prompt, row in zip(got, prompts, rows):
            head = [tok.bos_token_id] + tok.encode(prompt)         # tokenized apart, as Axolotl does
            tail = tok.encode(row["output"]) + [tok.eos_token_id]
            assert ids == head + tail
            axolotl = (head if inputs else [IGNORE] * len(head)) + tail
            assert labels == _shift(axolotl)
    (ids, _), = _one(tok, _jsonl(tmp_path / "c.jsonl", rows[1:]), type="alpaca:chatml")
    assert tok.decode(ids[1:]).startswith("<|im_start|>system\n" + ALPACA_SYSTEM_NO_INPUT)


def test_input_output_trains_the_labelled_segments(tmp_path, tok):
    segs = [dict(text="Q: who? ", label=False), dict(text="A: Hamlet.", label=True),
            dict(text=" end", label=False)]
    path = _jsonl(tmp_path / "io.jsonl", [dict(segments=segs)])
    for inputs in (False, True):
        (ids, labels), = _one(tok, path, inputs, type="input_output")
        pieces = [tok.encode(s["text"]) for s in segs]
        assert ids == sum(pieces, [])                              # no bos, no eos added
        axolotl = sum([p if (s["label"] or inputs) else [IGNORE] * len(p) for p, s in zip(pieces, segs)], [])
        assert labels == _shift(axolotl)


def test_completion_field_and_pretrain(tmp_path, tok):
    path = _jsonl(tmp_path / "c.jsonl", [dict(body="To be, or not to be")])
    (ids, labels), = _one(tok, path, type="completion", field="body")
    assert ids == [tok.bos_token_id] + tok.encode("To be, or not to be") + [tok.eos_token_id]
    assert labels == _shift(ids)
    long = _jsonl(tmp_path / "p.jsonl", [dict(doc="word " * 200)])
    ex = load_examples(check_entries([dict(path=long, type="pretrain", text_column="doc")]), tok, 32)
    assert len(ex) > 1 and ex.lengths().max() == 32, "a pretrain document is windowed, even unpacked"


@pytest.mark.parametrize("eos_rule", ["turn", "all", "last", "none"])
def test_chat_template_roles_to_train_and_train_on_eos(tmp_path, tok, eos_rule):
    path = _jsonl(tmp_path / "chat.jsonl", [CHAT])
    for roles, inputs in [(["assistant"], False), (["user", "assistant"], False), (["assistant"], True)]:
        (ids, labels), = _one(tok, path, inputs, type="chat_template", roles_to_train=roles,
                              train_on_eos=eos_rule)
        want_ids, axolotl = _chat_axolotl(tok, CHAT["messages"], roles, eos_rule, inputs)
        assert ids == want_ids and labels == _shift(axolotl), (roles, inputs)


def test_sharegpt_form_mappings_and_roles(tmp_path, tok):
    conv = [{"from": "human", "value": "Who art thou?"}, {"from": "gpt", "value": "A king."}]
    want = _one(tok, _jsonl(tmp_path / "m.jsonl", [{"messages": [
        {"role": "user", "content": "Who art thou?"}, {"role": "assistant", "content": "A king."}]}]),
        type="chat_template")
    legacy = _jsonl(tmp_path / "s.jsonl", [{"conversations": conv}])
    assert _one(tok, legacy, type="sharegpt") == want
    assert _one(tok, legacy, type="chat_template", field_messages="conversations",
                message_property_mappings=dict(role="from", content="value")) == want
    odd = _jsonl(tmp_path / "o.jsonl", [{"turns": [{"who": "asker", "text": "Who art thou?"},
                                                   {"who": "bot", "text": "A king."}]}])
    assert _one(tok, odd, type="chat_template", field_messages="turns", message_field_role="who",
                message_property_mappings=dict(content="text"),
                roles=dict(user=["asker"], assistant=["bot"])) == want
    sys_row = _jsonl(tmp_path / "y.jsonl", [{"system": "Be brief.", "messages": CHAT["messages"][1:]}])
    assert _one(tok, sys_row, type="chat_template") == _one(tok, _jsonl(tmp_path / "z.jsonl", [CHAT]),
                                                            type="chat_template")


# ------------------------------------------------------------------------------ files
def test_every_file_type_reads_the_same_rows(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = [dict(instruction=f"Say {w}.", input="", output=w) for w in ("hi", "ho", "ha")]
    want = _one(tok, _jsonl(tmp_path / "a.jsonl", rows), type="alpaca")
    (tmp_path / "arr.json").write_text(json.dumps(rows, indent=1))     # a JSON array, not JSON lines
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, str(tmp_path / "a.parquet"))
    with pa.ipc.new_stream(str(tmp_path / "a.arrow"), table.schema) as w:   # what save_to_disk writes
        w.write_table(table)
    with open(tmp_path / "a.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    one = _jsonl(tmp_path / "one.jsonl", rows[:1])
    cache = str(tmp_path / "hf_cache")
    datasets.load_dataset("json", data_files=str(tmp_path / "a.jsonl"), split="train",
                          cache_dir=cache).save_to_disk(str(tmp_path / "saved"))
    datasets.load_dataset("json", data_files=dict(train=one, test=str(tmp_path / "a.jsonl")),
                          cache_dir=cache).save_to_disk(str(tmp_path / "dict"))
    arrow = [str(tmp_path / "a.arrow")]
    (tmp_path / "lines.data").write_text((tmp_path / "a.jsonl").read_text())
    for entry in [dict(path=str(tmp_path / "arr.json")), dict(path=str(tmp_path / "a.parquet")),
                  dict(path=str(tmp_path / "a.csv")), dict(path=arrow[0]),
                  dict(path=str(tmp_path / "saved")), dict(path=str(tmp_path / "dict"), split="test"),
                  dict(path=str(tmp_path / "lines.data"), ds_type="json"),
                  dict(path=str(tmp_path), data_files=[str(tmp_path / "a.parquet")], ds_type="parquet")]:
        assert _one(tok, entry.pop("path"), type="alpaca", **entry) == want, entry
    assert len(_one(tok, tmp_path / "a.csv", type="alpaca", split="train[:2]")) == 2
    mixed = load_examples(check_entries([dict(path=str(tmp_path / "a.csv"), type="alpaca"),
                                         dict(path=str(tmp_path / "a.jsonl"), type="completion",
                                              field="output")]),
                          tok, 256)
    assert len(mixed) == 6 and mixed.sources[3] == f"{tmp_path / 'a.jsonl'}:1"


def test_bad_input_keeps_its_one_line_error(tmp_path, tok):
    def fails(path, match, **entry):
        with pytest.raises(ValueError, match=match):
            load_examples(check_entries([dict(path=str(path), **entry)]), tok, 256)
    rows = [dict(instruction="a", output="b"), dict(instruction="c")]
    fails(_jsonl(tmp_path / "a.jsonl", rows), r"a.jsonl:2: the row has no field 'output' .*alpaca",
          type="alpaca")
    (tmp_path / "arr.json").write_text(json.dumps([CHAT, {"text": "x"}]))
    if importlib.util.find_spec("datasets") is not None:      # a JSON array is read by `datasets`
        fails(tmp_path / "arr.json", r"arr.json:row 2: the row has no field 'messages'", type="chat_template")
    fails(_jsonl(tmp_path / "s.jsonl", [{"messages": [{"from": "human", "value": "x"}]}]),
          r"s.jsonl:1: message 0 must be a mapping with `role` and `content`.*message_property_mappings",
          type="chat_template")
    fails(_jsonl(tmp_path / "io.jsonl", [dict(segments=[dict(text="x")])]), r"io.jsonl:1: segment 0 must be",
          type="input_output")
    with pytest.raises(ValueError, match=r"type 'oasst' is not supported; use one of \('completion', "
                                         r"'chat_template', 'sharegpt', 'alpaca', 'input_output', "
                                         r"'pretrain'\)"):
        check_entries([dict(path="x.jsonl", type="oasst")])
    with pytest.raises(ValueError, match="train_on_eos 'sometimes'"):
        check_entries([dict(path="x.jsonl", type="chat_template", train_on_eos="sometimes")])
    with pytest.raises(ValueError, match=r"unknown keys \['shuffle'\]"):
        check_entries([dict(path="x.jsonl", type="alpaca", shuffle=True)])


# ------------------------------------------------------------------------------ a run
def _train(path):
    import torch

    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    return None, [r["loss"] for r in Trainer(setup_run([path])).train()]


def test_pretraining_dataset_and_alpaca_train_two_steps(tmp_path, tok):
    from minipar.trainer.config.train_config import load_config
    text = _jsonl(tmp_path / "web.jsonl", [dict(content="Fair is foul, and foul is fair. " * 6)] * 8)
    alpaca = _jsonl(tmp_path / "a.jsonl", [dict(instruction="Say hi.", output="Hi there, friend.")] * 8)
    base = dict(tokenizer_config=tok.source, sample_packing=True, sequence_len=64, global_batch_size=2,
                max_steps=2, warmup_steps=1, logging_steps=100, progress_bar=False,
                peak_tflops=1, loss_curve=False,       # no peak measured, no PNG: unread here
                save_final_checkpoint=False,
                export_hf=False, dataset_prepared_path=str(tmp_path / "prepared"),
                model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1))
    for i, data in enumerate([dict(pretraining_dataset=[dict(path=text, text_column="content")]),
                              dict(datasets=[dict(path=alpaca, type="alpaca")])]):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(yaml.safe_dump(dict(base, output_dir=str(tmp_path / f"o{i}"), **data)))
        if i == 0:
            cfg = load_config(str(path), [])
            assert cfg.datasets == [dict(path=text, text_column="content", type="pretrain")]
        _, losses = run_world(_train, 1, str(path), timeout=120)[0]
        assert len(losses) == 2 and all(x == x for x in losses)
    with pytest.raises(ValueError, match="pretraining_dataset: streamed pretraining data from 'org/web'"):
        load_config(None, ["--pretraining_dataset", "org/web"])


def test_the_docs_yaml_examples_are_valid_entries():
    """Every YAML block of docs/finetuning.md's Datasets section parses, and its `datasets` (or
    pretraining_dataset) entries pass check_entries (no file is read)."""
    import re
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    page = open(os.path.join(root, "docs", "finetuning.md")).read()
    section = page.split("## Datasets\n", 1)[1].split("\n## ", 1)[0]
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.S)]
    kinds = set()
    for block in blocks:
        entries = block.get("datasets") or [dict(e, type="pretrain") for e in block["pretraining_dataset"]]
        kinds |= {e["type"] for e in entries}
        check_entries(entries)
    assert kinds == {"completion", "chat_template", "alpaca", "input_output", "sharegpt", "pretrain"}, kinds
