"""The Python API (minipar/api.py): a user's own loop on any layout equals one process, and its
gradients follow the one stated convention, held against torch's FSDP2."""
from __future__ import annotations

import os
import runpy

import pytest
import torch
from harness import run_world

from minipar.api import prepare
from minipar.config import ParallelismConfig
from minipar.tensor_parallel.layers import gather_tensor
from minipar.zero3 import ShardedStateDicts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "own_loop.py")


def _example(**kw):
    os.chdir(ROOT)                                   # it reads data/shakespeare.txt
    return runpy.run_path(EXAMPLE)["main"](**kw)


def test_the_readme_shows_the_example_script():
    """The README's script is examples/own_loop.py's main, line for line."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    body = open(EXAMPLE).read().split("\n\n\ndef main", 1)[1].split("\n\n\nif __name__", 1)[0]
    assert "def main" + body in readme


@pytest.mark.parametrize("sizes,micro,settings", [
    (dict(dp_shard_size=2, tp_size=2), 1, {}),
    (dict(pp_size=2, cp_size=2), 2, dict(pipeline_schedule="1f1b")),
], ids=["dp_shard2-tp2", "pp2-cp2"])
def test_own_loop_on_4_ranks_equals_one_process(sizes, micro, settings):
    one = run_world(_example, 1, steps=6, timeout=120)[0]
    four = run_world(_example, 4, steps=6, sizes=sizes, micro_batches=micro, timeout=180, **settings)
    assert all(r == four[0] for r in four)           # every rank reads the same losses
    assert four[0] == pytest.approx(one, rel=2e-5)
    assert one[-1] < one[0] - 0.5                    # and it learns


def test_prepare_refuses_bad_settings_by_name():
    """Before any process group exists (the test process creates none)."""
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['pipeline_shedule'\]"):
        prepare(dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2), ParallelismConfig(),
                pipeline_shedule="1f1b")
    with pytest.raises(ValueError, match=r"2 composition setting\(s\) wrong: dtype='fp16'.*ddp='fast'"):
        prepare(dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2), ParallelismConfig(),
                dtype="fp16", ddp="fast")


# ------------------------------------------------ the gradient convention against torch's FSDP2
def _save_hf(tmp):
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).float()
    model.save_pretrained(tmp, safe_serialization=True)
    return tmp


def _hf_dir(tmp):
    """A small transformers Llama saved to `tmp`, written by a forked rank: the test process itself
    runs no torch op, whose thread pool a later fork would inherit in a state that can hang."""
    return run_world(_save_hf, 1, tmp, timeout=60)[0]


def _grads(which, path):
    """The full gradients of one step on the global batch (8 x 32 tokens) over 2 ranks."""
    import torch.distributed as dist
    ids = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(7))
    if which == "minipar":
        model, _, step = prepare(path, ParallelismConfig(dp_shard_size=2))
        step.backward(ids[:, :-1], ids[:, 1:])      # the global batch; no loss scaling by the user
        sd = ShardedStateDicts(model.model.zero3)
        return sd.full_from_shards([s.grad for s in sd.shards])
    import transformers
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:                                  # torch 2.4, 2.5
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = ids[4 * dist.get_rank():4 * dist.get_rank() + 4] # this rank's half, as FSDP2 users load it
    logits = model(mine[:, :-1]).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()).backward()   # a local mean
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}                     # FSDP2 averages


def test_gradients_equal_torch_fsdp2s(tmp_path):
    """minipar sums over ranks a loss divided by the global token count; FSDP2 averages over ranks
    a per-rank mean: with as many tokens on every rank, the same gradient, to fp32 rounding."""
    path = _hf_dir(str(tmp_path))
    mine = run_world(_grads, 2, "minipar", path, timeout=120)[0]
    theirs = run_world(_grads, 2, "fsdp2", path, timeout=120)[0]
    assert mine.keys() == theirs.keys()
    for name, g in theirs.items():
        torch.testing.assert_close(mine[name], g, atol=1e-7, rtol=1e-4, msg=name)
    # what a user who also divided by the rank count would have got is far outside that
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.allclose(mine[name] / 2, theirs[name], atol=1e-7, rtol=1e-4)


def test_tp_gradients_are_the_full_models(tmp_path):
    """Under tp 2 the same convention: the gathered gradient equals one process's."""
    path = _hf_dir(str(tmp_path))

    def grads(sizes):
        model, _, step = prepare(path, ParallelismConfig(**sizes))
        ids = torch.randint(0, 512, (8, 33), generator=torch.Generator().manual_seed(7))
        step.backward(ids[:, :-1], ids[:, 1:])
        return {n: gather_tensor(p.grad, p.tp_split_dim, model.pgm.tp)
                for n, p in model.model.named_parameters()}
    one = run_world(grads, 1, {}, timeout=120)[0]
    two = run_world(grads, 2, dict(tp_size=2), timeout=120)[0]
    for name, g in one.items():
        torch.testing.assert_close(two[name], g, atol=1e-7, rtol=1e-4, msg=name)
