"""The tokenizer, the corpus split, the step -> batch sampler, and the split over dp / micro-steps / cp."""
import itertools
import os
import types

import pytest
import torch
from harness import run_world

import minipar
from minipar import ParallelismConfig, comm
from minipar.batch_split import count_label_tokens, local_batch
from minipar.context_parallel import zigzag_unshard
from minipar.mesh import MeshDim
from minipar.trainer.data.batches import BatchSampler, ByteTokenizer, eval_batches, load_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "shakespeare.txt")


# ------------------------------------------------------------------------------- tokenizer, corpus
def test_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "To be, or not to be -- ça, ß, 世界 ✓\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8")) > len(text)      # multi-byte characters
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.encode_tensor(text).tolist() == ids
    # a cut inside a multi-byte character decodes with a replacement mark, not an exception
    assert tok.decode(tok.encode("世")[:2]) == "\ufffd"
    with pytest.raises(ValueError, match="0..255"):
        tok.decode([300])


def test_load_corpus_split():
    train, val = load_corpus(CORPUS, val_fraction=0.1, sequence_len=64)
    raw = open(CORPUS, "rb").read()
    assert train.dtype == torch.uint8 and train.dim() == 1
    assert len(val) == int(len(raw) * 0.1) and len(train) + len(val) == len(raw)
    assert bytes(torch.cat([train, val]).tolist()) == raw              # the last 10% is validation
    assert "MACBETH" in ByteTokenizer().decode(train[:200])
    train0, val0 = load_corpus(CORPUS, val_fraction=0.0)
    assert len(train0) == len(raw) and len(val0) == 0


def test_load_corpus_errors(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="nope.txt.*`dataset`"):
        load_corpus(missing)
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    with pytest.raises(ValueError, match=r"holds 100 bytes.*sequence_len \+ 1 = 129"):
        load_corpus(str(short), sequence_len=128)
    with pytest.raises(ValueError, match="validation split"):
        load_corpus(str(short), val_fraction=0.1, sequence_len=32)   # 90 train, 10 validation
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(str(short), val_fraction=1.5)


# ------------------------------------------------------------------------------------- sampler
def _tokens(n=2000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=gen).to(torch.uint8)


def test_labels_are_shifted_windows():
    tokens = _tokens()
    s = BatchSampler(len(tokens), sequence_len=16, global_batch_size=4, seed=1)
    starts = s.batch(3)
    ids, labels = s.global_batch(tokens, 3)
    assert ids.shape == labels.shape == (4, 16) and ids.dtype == labels.dtype == torch.long
    for b, st in enumerate(starts.tolist()):
        assert st % 16 == 0 and st + 17 <= len(tokens)
        assert ids[b].tolist() == tokens[st:st + 16].tolist()
        assert labels[b].tolist() == tokens[st + 1:st + 17].tolist()     # label[t] = token t+1


def test_sampler_is_a_pure_function_of_seed_and_step():
    tokens = _tokens()
    a = BatchSampler(len(tokens), 16, 8, seed=5)
    in_order = [a.batch(step) for step in range(60)]         # 60*8 samples: several epochs of 124
    b = BatchSampler(len(tokens), 16, 8, seed=5)
    for step in [37, 0, 59, 15, 15, 16]:                      # any starting step, any order
        assert torch.equal(b.batch(step), in_order[step])
    other = BatchSampler(len(tokens), 16, 8, seed=6)
    assert not all(torch.equal(other.batch(k), in_order[k]) for k in range(3))
    # each epoch visits every window once, and epochs are reshuffled
    W = a.num_windows
    assert W == (len(tokens) - 1) // 16
    samples = torch.cat(in_order)
    for e in range(len(samples) // W):
        ep = samples[e * W:(e + 1) * W] // 16
        assert sorted(ep.tolist()) == list(range(W))
    assert not torch.equal(samples[:W], samples[W:2 * W])
    assert a.epoch_of(W) == 8.0


def test_sampler_state_dict_and_errors():
    s = BatchSampler(1000, 16, 8, seed=3)
    BatchSampler(1000, 16, 8, seed=3).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed: checkpoint 3 vs now 4"):
        BatchSampler(1000, 16, 8, seed=4).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="cannot fill one sequence"):
        BatchSampler(10, 16, 8)
    with pytest.raises(ValueError, match="built for 1000 tokens"):
        s.global_batch(_tokens(999), 0)


def test_eval_batches_in_file_order():
    tokens = _tokens(500)
    batches = list(eval_batches(tokens, 16, 4))
    assert len(batches) == ((500 - 1) // 16) // 4
    ids, labels = batches[1]
    assert ids[0].tolist() == tokens[64:80].tolist() and labels[0].tolist() == tokens[65:81].tolist()
    assert len(list(eval_batches(tokens, 16, 4, max_batches=2))) == 2


# ---------------------------------------------------------------------- split over dp, micro, cp
def _fake_pgm(dp_rank, dp, cp_rank, cp):
    """The dims and the cp layout local_batch reads; it never communicates, so no groups are needed."""
    return types.SimpleNamespace(dp=MeshDim("dp", list(range(dp)), dp_rank, None),
                                 cp=MeshDim("cp", list(range(cp)), cp_rank, None),
                                 tp=MeshDim("tp", [0], 0, None), config=ParallelismConfig())


@pytest.mark.parametrize("dp,cp,micro", [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 2), (4, 2, 1),
                                          (1, 4, 2)])
def test_local_batch_covers_global_batch_once(dp, cp, micro):
    B, T = 8, 16
    ids = torch.arange(B * T).view(B, T)                     # every token unique
    labels = ids + 10_000
    seen = torch.zeros(B, T, dtype=torch.long)
    for d, c, m in itertools.product(range(dp), range(cp), range(micro)):
        out = local_batch(ids, labels, _fake_pgm(d, dp, c, cp), micro_step=m, num_micro_steps=micro)
        b = B // (dp * micro)
        assert out["input_ids"].shape == out["labels"].shape == out["position_ids"].shape == (b, T // cp)
        first = d * (B // dp) + m * b                        # contiguous blocks, in order
        rows = torch.arange(first, first + b)
        pos = out["position_ids"]
        assert torch.equal(out["input_ids"], ids[rows.unsqueeze(1), pos])          # true positions
        assert torch.equal(out["labels"], labels[rows.unsqueeze(1), pos])
        if cp > 1:                                            # zigzag: chunks c and 2cp-1-c
            chunk = T // (2 * cp)
            last = 2 * cp - 1 - c
            want = list(range(c * chunk, (c + 1) * chunk)) + list(range(last * chunk, (last + 1) * chunk))
            assert pos[0].tolist() == want
        seen[rows.unsqueeze(1), pos] += 1
    assert torch.equal(seen, torch.ones(B, T, dtype=torch.long))


def test_local_batch_single_process_is_identity():
    ids, labels = torch.randint(0, 256, (2, 2, 8)).unbind(0)
    out = local_batch(ids, labels, minipar.ProcessGroupManager.local())
    assert torch.equal(out["input_ids"], ids) and torch.equal(out["labels"], labels)
    assert out["position_ids"].tolist() == [list(range(8))] * 2


def test_local_batch_errors():
    ids = torch.zeros(6, 16, dtype=torch.long)
    with pytest.raises(ValueError, match=r"global_batch_size 6 is not divisible by dp size 2 .* "
                                         r"num_micro_steps 2 = 4"):
        local_batch(ids, ids, _fake_pgm(0, 2, 0, 1), num_micro_steps=2)
    with pytest.raises(ValueError, match="sequence length 16 is not divisible by 2 \\* cp_size = 6"):
        local_batch(ids, ids, _fake_pgm(0, 1, 0, 3))
    with pytest.raises(ValueError, match="micro_step 3"):
        local_batch(ids, ids, _fake_pgm(0, 1, 0, 1), micro_step=3, num_micro_steps=3)


def test_count_label_tokens():
    labels = torch.tensor([[1, -100, 3], [-100, -100, 7]])
    assert count_label_tokens(labels) == 3


# ------------------------------------------------------------- the same on a real 2x2x2 gloo world
def _reassemble(shape, micro):
    pgm = minipar.init(ParallelismConfig(*shape))
    tokens = _tokens(3000, seed=2)
    sampler = BatchSampler(len(tokens), 16, 8, seed=0)
    ids, labels = sampler.global_batch(tokens, 7)
    parts = []
    for m in range(micro):
        out = local_batch(ids, labels, pgm, micro_step=m, num_micro_steps=micro)
        keys = ("input_ids", "labels", "position_ids")
        full = torch.stack([zigzag_unshard(out[k], 1, pgm.cp) for k in keys])
        parts.append(full)
    mine = torch.cat(parts, dim=1)                            # (3, B/dp, T): this dp rank's samples
    gathered = comm.all_gather(mine.contiguous(), pgm.dp, gather_dim=1)
    tp_copies = comm.all_gather(out["input_ids"].contiguous(), pgm.tp, gather_dim=0)
    return dict(ids=gathered[0], labels=gathered[1], pos=gathered[2], want_ids=ids, want_labels=labels,
                num_items=count_label_tokens(labels), tp_copies=tp_copies.chunk(pgm.tp.size))


@pytest.mark.parametrize("shape,micro", [((1, 2, 2, 2), 2), ((2, 2, 1, 1), 1)])
def test_local_batch_reassembles_on_gloo(shape, micro):
    results = run_world(_reassemble, shape[0] * shape[1] * shape[2] * shape[3], shape, micro, timeout=150)
    for r in results:
        assert torch.equal(r["ids"], r["want_ids"]) and torch.equal(r["labels"], r["want_labels"])
        assert r["pos"].tolist() == [list(range(16))] * 8
        assert all(torch.equal(c, r["tp_copies"][0]) for c in r["tp_copies"])   # tp ranks: same input
        assert r["num_items"] == 8 * 16
    assert all(torch.equal(r["want_ids"], results[0]["want_ids"]) for r in results)
