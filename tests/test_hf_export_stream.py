"""The Hugging Face export streams: each full tensor goes to the host as it is gathered, into shards
written as they fill (models/hf_shards.py), the pipeline stages handing theirs over one at a time.

Proven here: one shard is byte-identical to what save_pretrained wrote before (one save_file of the
whole gathered dict); many shards hold the same tensors, with transformers' names and index, and
transformers loads them; and the bytes a rank holds at once during the export (counted by
HeldBytes, which follows every buffer and tensor the export makes until it is freed) stay within
max(shard limit, largest tensor) + the largest tensor + the largest ZeRO-3 unit, far below the model.
"""
import gc
import json
import os
import time

import pytest
import torch
from harness import run_world
from safetensors.torch import load_file, save_file

import minipar
from minipar import ParallelismConfig
from models.hf_checkpoint import save_pretrained
from models.hf_names import to_hub
from models.hf_shards import INDEX, SINGLE, HeldBytes, ShardWriter
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

CFG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2)
LIMIT = 12_000            # bytes per shard: a few tensors each (the largest, embed_tokens, is 16 KiB)


def _old_export(model, path):
    """What save_pretrained wrote before streaming: the whole gathered dict in one save_file."""
    full = model.full_state_dict()
    if model.config.tie_word_embeddings:
        full.pop("lm_head.weight", None)
    save_file({k: v.contiguous().float() for k, v in to_hub(full, model.config.model_type).items()}, path,
              metadata={"format": "pt"})


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _export_world(root):
    """pp 2 x dp_shard 2, ZeRO-3 on each stage: one export in one file, one in LIMIT-byte shards."""
    from minipar.pipeline_parallel import build_stage
    from minipar.zero3 import ShardedStateDicts, fully_shard
    pgm = minipar.init(ParallelismConfig(dp_shard_size=2, pp_size=2))
    stage = build_stage(LlamaForCausalLM(LlamaConfig(**CFG), pgm, seed=0), pgm)
    fully_shard(stage, pgm)
    meter = HeldBytes()
    one = save_pretrained(stage, os.path.join(root, "one"))
    many = save_pretrained(stage, os.path.join(root, "many"), max_shard_bytes=LIMIT, meter=meter)
    units = [u.layout.padded_numel * u.shard.element_size() for u in ShardedStateDicts(stage.zero3).units]
    # gloo's worker thread may drop its reference to the last broadcast tensor a moment after the
    # call returned (seen under load): give it up to 2 s before counting what outlives the export
    for _ in range(200):
        gc.collect()
        if meter.now == 0:
            break
        time.sleep(0.01)
    return dict(one=one, many=many, peak=meter.peak, left=meter.now, unit=max(units))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    got = run_world(_export_world, 4, str(root), timeout=120)
    ref = LlamaForCausalLM(LlamaConfig(**CFG), None, seed=0)       # one process, the same weights
    _old_export(ref, str(root / "old.safetensors"))
    return root, got, ref


def test_one_shard_is_byte_identical_to_the_old_export(exported):
    root, got, _ = exported
    assert got[0]["one"] == [SINGLE] and all(g["one"] == [] for g in got[1:])
    assert sorted(os.listdir(root / "one")) == ["config.json", SINGLE]
    assert _read(root / "one" / SINGLE) == _read(root / "old.safetensors")


def test_shards_hold_the_same_tensors_with_the_hub_index(exported):
    root, got, ref = exported
    files = got[0]["many"]
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(root / "many")) == sorted(files + ["config.json", INDEX])
    index = json.loads(_read(root / "many" / INDEX))
    old = load_file(str(root / "old.safetensors"))
    placed = {}
    for f in files:
        tensors = load_file(str(root / "many" / f))
        size = sum(t.numel() * 4 for t in tensors.values())
        assert size <= LIMIT or len(tensors) == 1, (f, size)        # only a lone tensor may exceed it
        placed.update(dict.fromkeys(tensors, f))
        for k, t in tensors.items():
            assert torch.equal(t, old[k]), k
    assert placed == index["weight_map"] and sorted(placed) == sorted(old)
    assert index["metadata"] == dict(total_parameters=sum(t.numel() for t in old.values()),
                                     total_size=sum(t.numel() * 4 for t in old.values()))
    # minipar's reader (which loads transformers' own shards, test_hf_load.py) reads them as the file
    back = LlamaForCausalLM.from_pretrained(str(root / "many")).full_state_dict()
    for k, t in ref.full_state_dict().items():
        assert torch.equal(back[k], t), k


@pytest.mark.slow
def test_transformers_loads_the_shards(exported):
    import transformers
    root, _, _ = exported
    old = load_file(str(root / "old.safetensors"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(root / "many"))
    for k, t in hf.state_dict().items():
        assert torch.equal(t, old[k]), k


def test_a_rank_holds_one_shard_one_tensor_and_one_unit(exported):
    _, got, ref = exported
    sizes = [p.numel() * 4 for p in ref.parameters()]
    for rank, g in enumerate(got):
        bound = max(LIMIT, max(sizes)) + max(sizes) + g["unit"]
        assert 0 < g["peak"] <= bound < sum(sizes) / 2, (rank, g["peak"], bound, sum(sizes))
        assert g["left"] == 0, rank                                  # nothing of the export outlives it


def test_writer_splits_like_the_hub_and_replaces_a_previous_export(tmp_path):
    """huggingface_hub's rule: a new shard when the next tensor would pass the limit; a tensor larger
    than the limit alone. A later export into the same directory removes the earlier files."""
    w = ShardWriter(str(tmp_path), max_shard_bytes=100)
    for name, numel in [("a", 10), ("b", 10), ("c", 40), ("d", 5), ("e", 20)]:
        w.add(name, torch.full((numel,), float(numel)))
    assert w.close() == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    where = json.loads(_read(tmp_path / INDEX))["weight_map"]
    first, second, third = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
    assert where == dict(c=first, a=second, b=second, d=second, e=third)     # c (160 B) alone, at once
    w = ShardWriter(str(tmp_path))
    w.add("a", torch.ones(3))
    assert w.close() == [SINGLE] and sorted(os.listdir(tmp_path)) == [SINGLE]
    with pytest.raises(ValueError, match="max_shard_bytes must be a positive"):
        ShardWriter(str(tmp_path), max_shard_bytes=0)
