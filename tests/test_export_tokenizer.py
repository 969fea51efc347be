"""The Hugging Face export of a byte-level run carries a tokenizer that transformers loads.

The default model reads UTF-8 bytes (ByteTokenizer, 256 ids, byte b -> id b). Before, its export
(out/default/hf) held config.json + model.safetensors only, and AutoTokenizer.from_pretrained failed
on it. Now a hand-written tokenizer.json (tokenizer.py: save_byte_tokenizer) sits beside them, from
the run's end and from `python -m minipar.trainer.checkpoint.export`; it must give ByteTokenizer's ids.
"""
import json
import os

import pytest
import torch
import yaml
from harness import run_world

from minipar.trainer.data.batches import ByteTokenizer
from minipar.trainer.data.tokenizer import bytes_to_unicode, save_byte_tokenizer

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["First Citizen:\nBefore we proceed any further, hear me speak.", "  two  spaces\tand a tab\r\n",
         "héllo — ünïcode 日本語 🎉", "\x00\x01\x7f control bytes", ""]


def _load(directory):
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def test_byte_tokenizer_loads_and_encodes_as_minipar(tmp_path):
    save_byte_tokenizer(str(tmp_path))
    tok, mine = _load(tmp_path), ByteTokenizer()
    assert tok.is_fast and len(tok) == 256
    with open(os.path.join(ROOT, "configs", "default.yaml")) as f:
        assert len(tok) <= yaml.safe_load(f)["model"]["vocab_size"]     # every id has an embedding row
    assert tok.bos_token_id is None and tok.eos_token_id is None        # as ByteTokenizer: no specials
    with open(os.path.join(ROOT, "data", "shakespeare.txt"), encoding="utf-8") as f:
        texts = TEXTS + [f.read(20000)]
    for text in texts:
        ids = tok(text)["input_ids"]                # add_special_tokens (the default) adds nothing
        assert ids == mine.encode(text), text[:40]
        assert tok.decode(ids) == text
    assert sorted(bytes_to_unicode()) == list(range(256)) and len(set(bytes_to_unicode().values())) == 256


def _train(argv):
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    Trainer(setup_run(argv)).train()


def test_a_run_and_the_exporter_leave_the_byte_tokenizer(tmp_path):
    out = tmp_path / "run"
    run_world(_train, 1, [os.path.join(ROOT, "configs", "ddp.yaml"), "--dp_replicate_size", "1",
                          "--model.hidden_size", "32", "--model.intermediate_size", "64",
                          "--model.num_hidden_layers", "1", "--model.num_attention_heads", "2",
                          "--model.num_key_value_heads", "1", "--sequence_len", "16",
                          "--global_batch_size", "4",
                          "--max_steps", "2", "--warmup_steps", "1", "--eval_steps", "0", "--save_steps", "0",
                          # no peak measured, no PNG: unread here
                          "--peak_tflops", "1", "--loss_curve", "false",
                          "--progress_bar", "false", "--output_dir", str(out),
                          "--dataset", os.path.join(ROOT, "data", "shakespeare.txt")], timeout=240)
    from minipar.trainer.checkpoint.export import export_checkpoint
    again = export_checkpoint(str(out / "step-2"), str(tmp_path / "hf-step-2"))
    for hf in (out / "hf", again):
        assert os.path.isfile(os.path.join(hf, "tokenizer.json")), sorted(os.listdir(hf))
        assert _load(hf)("to be, or not")["input_ids"] == ByteTokenizer().encode("to be, or not")
    # the exporter's --max-shard-bytes: shards and their index, holding the same tensors
    from safetensors.torch import load_file

    from minipar.trainer.checkpoint.export import main
    main([str(out / "step-2"), str(tmp_path / "sharded"), "--max-shard-bytes", "20000"])
    index = json.load(open(tmp_path / "sharded" / "model.safetensors.index.json"))
    whole = load_file(str(out / "hf" / "model.safetensors"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(index["weight_map"]) == sorted(whole)
    for f in files:
        for k, t in load_file(str(tmp_path / "sharded" / f)).items():
            assert torch.equal(t, whole[k]) and index["weight_map"][k] == f, k
