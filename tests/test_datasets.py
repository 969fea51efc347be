"""The fine-tuning data path: the model's tokenizer, Axolotl datasets, label masking, packing.

A BPE tokenizer with a chat template is trained here on the bundled plays (minipar.trainer.
example_data), saved and loaded back through AutoTokenizer; the chat rows are the plays' speeches.
Packing is shown to compute what each example computes alone, on one process and under cp / tp,
and a packed fine-tuning run on several layouts to have the loss curve of one process.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch
import yaml
from harness import run_world

import minipar
from minipar import ParallelismConfig, batch_split, comm
from minipar import tensor_parallel as tpl
from minipar.context_parallel import zigzag_shard
from minipar.mesh import MeshDim
from minipar.trainer.data import batches as mdata
from minipar.trainer.data.chat_format import chat_example
from minipar.trainer.data.datasets import (
    Examples,
    check_entries,
    load_examples,
    split_validation,
)
from minipar.trainer.data.example_data import make_example
from minipar.trainer.data.packing import PackedData, RowSampler, build_rows, eval_batches
from minipar.trainer.data.tokenizer import HFTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    d = tmp_path_factory.mktemp("example")
    paths = make_example(str(d), num_conversations=120, vocab_size=2048, tokenizer_chars=200_000)
    return dict(paths, dir=str(d), tok=load_tokenizer(paths["tokenizer"]))


def _rows(path):
    return [json.loads(line) for line in open(path)]


def _write(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


# ------------------------------------------------------------------------------ tokenizer
def test_tokenizer_loads_through_autotokenizer(example):
    from transformers import AutoTokenizer
    tok, hf = example["tok"], AutoTokenizer.from_pretrained(example["tokenizer"])
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == len(hf) == 2048
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == tuple(
        hf.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>"))
    text = "Fair is foul, and foul is fair."
    assert tok.decode(tok.encode(text)) == text and len(tok.encode(text)) < len(text) / 2   # BPE merges
    msgs = [dict(role="user", content="Who goes there?"), dict(role="assistant", content="Nay, answer me.")]
    assert tok.render_chat(msgs) == "<s><|user|>\nWho goes there?</s>\n<|assistant|>\nNay, answer me.</s>\n"
    assert load_tokenizer(None).vocab_size == 256, "no tokenizer_config: the bundled bytes"


def test_special_token_ids_fill_the_model_config(example):
    from minipar.trainer.data.tokenizer import fill_special_token_ids
    from models.llama_config import LlamaConfig
    tok = example["tok"]
    cfg = LlamaConfig(vocab_size=2048)
    assert fill_special_token_ids(cfg, tok) == ["bos_token_id", "eos_token_id", "pad_token_id"]
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                      tok.tok.pad_token_id)
    given = LlamaConfig(vocab_size=2048, eos_token_id=[5, 6])      # a base model's config.json wins
    fill_special_token_ids(given, tok)
    assert given.eos_token_id == [5, 6] and given.bos_token_id == tok.bos_token_id
    plain = LlamaConfig()
    assert fill_special_token_ids(plain, load_tokenizer(None)) == [], "bytes: no special tokens"
    assert (plain.bos_token_id, plain.eos_token_id, plain.pad_token_id) == (None, None, None)


# ------------------------------------------------------------------------------ labels
def test_chat_labels_train_only_assistant_turns(example):
    tok = example["tok"]
    for row in _rows(example["chat"])[:20]:
        msgs = row["messages"]
        ids, labels = chat_example(msgs, tok, train_on_inputs=False, where="x")
        assert len(ids) == len(labels) and labels[-1] == -100
        trained = [lab for lab in labels if lab != -100]
        want = "".join(m["content"] + "</s>" for m in msgs if m["role"] == "assistant")
        assert tok.decode(trained) == want, "exactly the assistant contents and their eos"
        for t, lab in enumerate(labels):             # shifted: label t is the token at t + 1
            assert lab in (-100, ids[t + 1] if t + 1 < len(ids) else None)
        ids2, all_labels = chat_example(msgs, tok, train_on_inputs=True, where="x")   # Axolotl's rule:
        want = "".join(m["content"] + "</s>" for m in msgs)          # every turn's content and eos,
        assert ids2 == ids and tok.decode([x for x in all_labels if x != -100]) == want   # no headers


def test_completion_rows_jsonl_txt_and_bytes(tmp_path, example):
    tok = example["tok"]
    j = _write(tmp_path / "c.jsonl", [json.dumps({"body": "To be, or not to be"}), "",
                                      json.dumps({"body": "ay"})])
    t = _write(tmp_path / "c.txt", ["First para", "line two", "", "", "second"])
    ex = load_examples(check_entries([dict(path=j, type="completion", field="body"), dict(path=t)]), tok, 64)
    assert len(ex) == 4 and ex.sources == [f"{j}:1", f"{j}:3", f"{t}:1", f"{t}:5"]
    ids, labels = ex.example(0)
    assert ids.tolist() == [tok.bos_token_id] + tok.encode("To be, or not to be") + [tok.eos_token_id]
    assert labels.tolist() == ids.tolist()[1:] + [-100]
    assert tok.decode(ex.example(2)[0][1:-1].tolist()) == "First para\nline two"
    raw = load_examples(check_entries([dict(path=t)]), mdata.ByteTokenizer(), 64)
    assert bytes(raw.example(0)[0].tolist()) == b"First para\nline two", "bytes: no bos / eos"


def test_bad_rows_name_file_and_line(tmp_path, example):
    tok = example["tok"]

    def fails(lines, match, kind="chat_template", tokenizer=tok, **kw):
        path = _write(tmp_path / "bad.jsonl", lines)
        with pytest.raises(ValueError, match=match):
            load_examples(check_entries([dict(path=path, type=kind, **kw)]), tokenizer, 32)
    good = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "ho"}]})
    fails([good, json.dumps({"text": "x"})], r"bad.jsonl:2: the row has no field 'messages'")
    fails([good, "", json.dumps({"messages": []})], r"bad.jsonl:3: `messages` must be a non-empty list")
    fails([json.dumps({"messages": [{"role": "king", "content": "x"}]})],
          r"bad.jsonl:1: .*unknown role 'king'")
    fails([json.dumps({"messages": [{"role": "user"}]})], r"bad.jsonl:1: message 0 must be a mapping")
    fails([good, "{not json"], r"bad.jsonl:2: not valid JSON")
    fails([json.dumps({"txt": "x"})], r"bad.jsonl:1: the row has no field 'text'", kind="completion")
    fails([json.dumps({"text": "word " * 40})], r"bad.jsonl:1: the example is \d+ tokens, longer than "
          r"sequence_len 32", kind="completion")
    fails([good], "needs a tokenizer with a chat template", tokenizer=mdata.ByteTokenizer())
    from minipar.trainer.config.train_config import load_config
    with pytest.raises(ValueError, match="sample_packing=True and val_set_size=0.0 apply to the examples"):
        load_config(None, ["--sample_packing", "true"])
    with pytest.raises(FileNotFoundError, match="datasets: file 'nope.jsonl' not found"):
        load_config(None, ["--datasets", "[{path: nope.jsonl, type: completion}]"])
    with pytest.raises(ValueError, match="type 'oasst' is not supported; use one of"):
        check_entries([dict(path="x.jsonl", type="oasst")])
    long = _write(tmp_path / "long.jsonl", [json.dumps({"text": "word " * 40})])
    ex = load_examples(check_entries([dict(path=long)]), tok, 32, sample_packing=True)
    assert ex.lengths().max() <= 32 and len(ex) > 1 and "cut into pieces" in ex.notes[-1]


def test_val_set_size_holds_out_a_seeded_split(example):
    ex = load_examples(check_entries([dict(path=example["chat"], type="chat_template")]), example["tok"], 512)
    train, val = split_validation(ex, 0.1, seed=3)
    assert len(val) == round(0.1 * len(ex)) and len(train) + len(val) == len(ex)
    assert set(train.sources).isdisjoint(val.sources) and len(set(ex.sources)) == len(ex)
    again = split_validation(ex, 0.1, seed=3)[1]
    assert again.sources == val.sources and torch.equal(again.tokens, val.tokens)
    assert len(split_validation(ex, 7, seed=3)[1]) == 7 and split_validation(ex, 0.0, 3)[1] is None
    with pytest.raises(ValueError, match="val_set_size"):
        split_validation(ex, len(ex), seed=0)


# ------------------------------------------------------------------------------ packing
def test_packing_keeps_whole_examples_with_their_positions(example):
    ex = load_examples(check_entries([dict(path=example["chat"], type="chat_template")]), example["tok"], 128,
                       sample_packing=True)
    data = PackedData(ex, 128, example["tok"].pad_token_id, seed=5, packing=True)
    seen = sorted(i for row in data.plan for i in row)
    assert seen == list(range(len(ex))), "every example in exactly one row"
    assert data.fill() > 0.8 and data.num_rows <= 1.25 * int(ex.lengths().sum()) / 128, "few pad tokens"
    r = data.rows
    for row, members in enumerate(data.plan[:10]):
        t = 0
        for d, i in enumerate(members):
            tok, lab = ex.example(i)
            span = slice(t, t + len(tok))
            assert torch.equal(r["input_ids"][row, span], tok) and torch.equal(r["labels"][row, span], lab)
            assert r["position_ids"][row, span].tolist() == list(range(len(tok)))
            assert (r["document_ids"][row, span] == d).all()
            t += len(tok)
        assert (r["labels"][row, t:] == -100).all() and (r["document_ids"][row, t:] == len(members)).all()
    s1, s2 = RowSampler(data, 8, seed=5), RowSampler(data, 8, seed=5)
    far = s1.global_batch(57)                       # a step of a later epoch, read cold
    for step in (0, 1, 57):
        a, b = s1.global_batch(step), s2.global_batch(step)
        assert all(torch.equal(a[k], b[k]) for k in a), "a pure function of (seed, step)"
    assert torch.equal(far["input_ids"], s2.global_batch(57)["input_ids"])
    epoch = torch.cat([s1.batch(s) for s in range(data.num_rows // 8)])
    assert len(set(epoch.tolist())) == len(epoch), "an epoch visits each row once"
    s2.load_state_dict(s1.state_dict())
    with pytest.raises(ValueError, match="data order differs"):
        RowSampler(data, 16, seed=5).load_state_dict(s1.state_dict())
    batches = list(eval_batches(data, 8, max_batches=100))
    assert len(batches) == -(-data.num_rows // 8) and batch_split.count_label_tokens(
        torch.cat([b["labels"] for b in batches])) == int((r["labels"] != -100).sum()), \
        "eval counts each row once"


def test_local_batch_cuts_positions_and_documents_like_tokens():
    rows = {k: torch.arange(4 * 8).reshape(4, 8) * m for k, m in
            (("input_ids", 1), ("labels", 2), ("position_ids", 3), ("document_ids", 4))}
    pgm = SimpleNamespace(dp=MeshDim("dp", [0, 1], 1, None), cp=MeshDim("cp", [0, 1], 1, None),
                          config=ParallelismConfig())
    got = batch_split.local_batch(rows["input_ids"], rows["labels"], pgm, position_ids=rows["position_ids"],
                            document_ids=rows["document_ids"])
    for k, m in (("input_ids", 1), ("labels", 2), ("position_ids", 3), ("document_ids", 4)):
        assert torch.equal(got[k], got["input_ids"] * m), k
    assert got["input_ids"][0].tolist() == [18, 19, 20, 21], "dp rank 1's rows, cp rank 1's zigzag chunks"


# ------------------------------------------------------------------------------ packed == alone
CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
LENGTHS, PLAN, T = [5, 9, 2, 3, 7, 4, 1], [[0, 1, 2], [3, 4, 5, 6]], 16


def _examples():
    g = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, 64, (n,), generator=g) for n in LENGTHS]
    labs = [torch.cat([t[1:], torch.tensor([-100])]) for t in toks]
    labs[1][:4] = -100                                   # a masked prompt
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.tensor(LENGTHS).cumsum(0)])
    return Examples(torch.cat(toks), torch.cat(labs), offsets, [str(i) for i in range(len(LENGTHS))])


def _packed_vs_alone(cp_size, tp_size, sp):
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    pgm = minipar.init(ParallelismConfig(cp_size=cp_size, tp_size=tp_size, sequence_parallel=sp)) \
        if cp_size * tp_size > 1 else None
    model = LlamaForCausalLM(LlamaConfig(**CFG), pgm, seed=1)
    cp, ex = model.pgm.cp, _examples()
    rows = build_rows(ex, PLAN, T, pad_token_id=0)
    n = batch_split.count_label_tokens(rows["labels"])
    shard = {k: zigzag_shard(v, 1, cp) for k, v in rows.items()}
    loss = model(shard["input_ids"], position_ids=shard["position_ids"], labels=shard["labels"],
                 num_items_in_batch=n, document_ids=shard["document_ids"])
    loss.backward()
    total = comm.all_reduce(loss.detach().clone(), cp)
    for p in model.parameters():
        comm.all_reduce(p.grad, cp)
    out = dict(loss=total, grads={k: tpl.gather_tensor(p.grad, p.tp_split_dim, model.pgm.tp)
                                  for k, p in model.named_parameters()})
    if cp_size * tp_size == 1:
        with torch.no_grad():
            out["logits"] = model(rows["input_ids"], position_ids=rows["position_ids"],
                                  document_ids=rows["document_ids"])
    return out


def _alone():
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    model, ex = LlamaForCausalLM(LlamaConfig(**CFG), seed=1), _examples()
    n = int((ex.labels != -100).sum())
    logits, total = [], 0.0
    for i in range(len(ex)):
        ids, labels = ex.example(i)
        loss = model(ids[None], labels=labels[None], num_items_in_batch=n)
        loss.backward()
        total += loss.item()
        with torch.no_grad():
            logits.append(model(ids[None])[0])
    return dict(loss=total, logits=logits, grads={k: p.grad for k, p in model.named_parameters()})


@pytest.mark.parametrize("cp_size,tp_size,sp", [(1, 1, False), (2, 1, False), (2, 2, True)],
                         ids=["one-process", "cp2", "cp2xtp2-sp"])
def test_packed_rows_compute_what_each_example_computes_alone(cp_size, tp_size, sp):
    ref = _alone()
    results = [_packed_vs_alone(1, 1, False)] if cp_size * tp_size == 1 else \
        run_world(_packed_vs_alone, cp_size * tp_size, cp_size, tp_size, sp, timeout=180)
    for got in results:
        assert abs(float(got["loss"]) - ref["loss"]) < 1e-5 * ref["loss"]
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, atol=1e-6, rtol=1e-4, msg=name)
    if "logits" in results[0]:
        for i, logits in enumerate(ref["logits"]):
            row = next(r for r, members in enumerate(PLAN) if i in members)
            start = sum(LENGTHS[j] for j in PLAN[row][:PLAN[row].index(i)])
            torch.testing.assert_close(results[0]["logits"][row, start:start + LENGTHS[i]], logits,
                                       atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ the training program
def _finetune_argv(example, out, steps, **layout):
    cfg = dict(tokenizer_config=example["tokenizer"],
               datasets=[dict(path=example["chat"], type="chat_template")],
               sample_packing=True, val_set_size=0.1, sequence_len=64, global_batch_size=8, max_steps=steps,
               warmup_steps=2, learning_rate=3e-3, eval_steps=steps, eval_batches=1, logging_steps=100,
               progress_bar=False, save_final_checkpoint=False, export_hf=False, output_dir=str(out),
               peak_tflops=1, loss_curve=False,        # no peak measured, no PNG: unread here
               model=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2), **layout)
    path = os.path.join(str(out) + ".yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return [path]


def _train(argv):
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    return [(r["step"], r["loss"], r.get("val_loss"), r["grad_norm"])
            for r in Trainer(setup_run(argv)).train()]


def _same_curve(ref, got, steps):
    assert len(ref) == len(got) == steps
    for (s, a, va, ga), (_, b, vb, gb) in zip(ref, got):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {s}: loss {b} vs one process {a}"
        assert abs(ga - gb) <= 1e-4 * abs(ga), f"step {s}: grad_norm {gb} vs {ga}"
        assert (va is None) == (vb is None) and (va is None or abs(va - vb) <= 1e-4 * abs(va))


def _packed_run(example, tmp_path, steps, world, **layout):
    ref = run_world(_train, 1, _finetune_argv(example, tmp_path / "one", steps), timeout=300)[0]
    got = run_world(_train, world, _finetune_argv(example, tmp_path / "par", steps, **layout), timeout=600)
    for curve in got:
        _same_curve(ref, curve, steps)
    assert ref[-1][2] is not None, "val_set_size held out a split that was evaluated"
    return ref


def test_packed_finetune_matches_one_process_fast(example, tmp_path):
    _packed_run(example, tmp_path, 3, 4, dp_shard_size=2, context_parallel_size=2)


@pytest.mark.slow
def test_packed_finetune_8_ranks_matches_one_process(example, tmp_path):
    ref = _packed_run(example, tmp_path, 20, 8, dp_shard_size=2, context_parallel_size=2,
                      tensor_parallel_size=2)
    assert ref[-1][1] < ref[0][1], "and it learns"


def test_packed_resume_is_exact_and_export_carries_the_tokenizer(example, tmp_path):
    out = tmp_path / "run"
    argv = _finetune_argv(example, out, 4)
    extra = ["--save_steps", "2", "--save_final_checkpoint", "true", "--export_hf", "true"]
    full = run_world(_train, 1, argv + extra, timeout=300)[0]
    resumed = run_world(_train, 1, argv + ["--resume_from_checkpoint", str(out / "step-2"),
                                           "--output_dir", str(tmp_path / "resumed")], timeout=300)[0]
    assert [r[1] for r in resumed] == [r[1] for r in full[2:]], "the resumed steps read the same rows"
    assert [r[3] for r in resumed] == [r[3] for r in full[2:]], "and have the same gradients"
    from transformers import AutoTokenizer, LlamaForCausalLM
    hf = out / "hf"
    tok = AutoTokenizer.from_pretrained(str(hf))
    assert len(tok) == 2048 and tok.chat_template == example["tok"].tok.chat_template
    model = LlamaForCausalLM.from_pretrained(str(hf))
    assert model.config.vocab_size == 2048, "the model took the tokenizer's vocabulary"
    ids = tuple(tok.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<pad>"))
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == ids, \
        "config.json carries the tokenizer's special ids"
