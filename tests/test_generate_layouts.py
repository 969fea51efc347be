"""Generation on the training layouts: ZeRO-3 shards (dp_shard, HSDP, with tp), expert parallelism,
sequence parallelism and cp give one process's greedy tokens on the same weights
(minipar/post/generation.py, models/kv_cache.py); the ranks stop together when a row ends early,
even where their logits differ; generating leaves ZeRO-3's training state as it was. (pp is
refused: tests/test_generate.py.) And `python -m minipar.generate` on ZeRO-3 shards.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo  # noqa: F401 - here once, not in every forked run (the optimizer imports it: 1 s)
import transformers
from harness import run_world
from test_generate import _cli

import minipar
from minipar.api import prepare
from minipar.post.generation import Generation, generate
from minipar.recipe import LoRA
from minipar.zero3 import fully_shard
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
MOE = dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
PROMPTS = [[5, 17, 33, 2, 9, 40, 41], [7, 8], [60, 61, 62, 63]]
# the tokenizer classes imported before any fork (no torch op runs), not in each forked rank
TOKENIZERS = (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast)


def _model(cfg, pgm, shard):
    """The seeded weights (layout-independent), scaled x4 for sharp distributions (few near-ties for
    greedy to break differently), then ZeRO-3 sharded over dp_shard_cp when `shard`."""
    model = LlamaForCausalLM(cfg, pgm, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    if shard:
        fully_shard(model, pgm)
    return model.eval()


def _compare(sizes, cfg, shard=True, eos=None):
    """(one process's tokens, this layout's, the largest logit gap of any step)."""
    pgm = minipar.init(minipar.ParallelismConfig(**sizes))
    cfg = LlamaConfig(**cfg)
    one, many = _model(cfg, None, False), _model(cfg, pgm, shard)
    g = Generation(max_new_tokens=6, eos_token_ids=[] if eos is None else [eos])
    a, b = generate(one, PROMPTS, g, record_logits=True), generate(many, PROMPTS, g, record_logits=True)
    gap = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
    return a.tokens, b.tokens, gap


LAYOUTS = {
    "dp_shard2": (2, dict(dp_shard_size=2), TINY),
    "hsdp": (4, dict(dp_replicate_size=2, dp_shard_size=2), TINY),
    "dp_shard2_tp2": (4, dict(dp_shard_size=2, tp_size=2), TINY),
    "ep2_zero3": (2, dict(dp_shard_size=2, ep_size=2), MOE),
    "tp2_sp": (2, dict(tp_size=2, sequence_parallel=True), MOE),
    "cp2": (2, dict(cp_size=2), TINY),
    "dp_shard2_tp2_sp_ep2": (4, dict(dp_shard_size=2, tp_size=2, sequence_parallel=True, ep_size=2), MOE),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_greedy_tokens_equal_one_process(name):
    world, sizes, cfg = LAYOUTS[name]
    for one, many, gap in run_world(_compare, world, sizes, cfg, timeout=120):
        assert many == one and gap < 1e-4


def _ep_alone():
    """ep 2 without ZeRO-3 (each rank holds its experts whole): the dispatch of the step's tokens."""
    return _compare(dict(dp_shard_size=2, ep_size=2), MOE, shard=False)


def test_expert_parallel_without_zero3_equals_one_process():
    for one, many, gap in run_world(_ep_alone, 2, timeout=120):
        assert many == one and gap < 1e-4


def _composed_lora():
    """The training composition (api.prepare): LoRA's frozen base on ZeRO-3 over dp_shard 2 (units
    with no gradient, adapters whole) generates what the seeded model does on one process (the
    adapters start at zero)."""
    pgm = minipar.init(minipar.ParallelismConfig(dp_shard_size=2))
    cfg = LlamaConfig(**TINY)
    pm = prepare(cfg, pgm, seed=7, lora=LoRA(r=4))[0]
    g = Generation(max_new_tokens=6)
    a = generate(LlamaForCausalLM(cfg, None, seed=7).eval(), PROMPTS, g, record_logits=True)
    b = generate(pm.model, PROMPTS, g, record_logits=True)
    built = pm.model.zero3 is not None and any("lora_A" in n for n, _ in pm.model.named_parameters())
    return a.tokens, b.tokens, max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)), built


def test_the_composed_lora_model_on_zero3_equals_one_process():
    for one, many, gap, built in run_world(_composed_lora, 2, timeout=120):
        assert built and many == one and gap < 1e-4


def _early_eos():
    """EOS = a token the short prompt's row generates second: that row ends at step 2 while the
    others go on; the sharded ranks run as many steps as one process, and no gather waits."""
    pgm = minipar.init(minipar.ParallelismConfig(dp_shard_size=2))
    cfg = LlamaConfig(**TINY)
    ref = generate(_model(cfg, None, False), PROMPTS, Generation(max_new_tokens=6)).tokens
    eos = ref[1][1]
    one = generate(_model(cfg, None, False), PROMPTS, Generation(max_new_tokens=6, eos_token_ids=[eos]))
    many = generate(_model(cfg, pgm, True), PROMPTS, Generation(max_new_tokens=6, eos_token_ids=[eos]))
    return one.tokens, many.tokens, eos


def test_a_row_ending_early_ends_on_every_rank():
    for one, many, eos in run_world(_early_eos, 2, timeout=60):
        assert many == one
        assert len(one[1]) <= 2 and one[1][-1] == eos and max(map(len, one)) > len(one[1])


def _differing_ranks():
    """Rank 1 holds other weights (a stand-in for kernels that are not bitwise deterministic): its
    own logits pick other tokens and other stops, yet it follows rank 0's choice and stops with it."""
    pgm = minipar.init(minipar.ParallelismConfig(dp_replicate_size=2))
    cfg = LlamaConfig(**TINY)
    mine = LlamaForCausalLM(cfg, pgm, seed=3 + pgm.global_rank).eval()
    ref = generate(LlamaForCausalLM(cfg, None, seed=3).eval(), PROMPTS, Generation(max_new_tokens=6)).tokens
    eos = ref[1][1]
    g = Generation(max_new_tokens=6, eos_token_ids=[eos])
    return generate(mine, PROMPTS, g).tokens


def test_the_ranks_agree_even_when_their_logits_differ():
    zero, one = run_world(_differing_ranks, 2, timeout=60)
    assert zero == one


def _training_state():
    """A forward and backward teach ZeRO-3 its orders and leave gradients; generating between that
    and the optimizer changes neither, leaves no unit gathered, and the next loss is the same."""
    pgm = minipar.init(minipar.ParallelismConfig(dp_shard_size=2))
    model = _model(LlamaConfig(**TINY), pgm, True).train()
    ids = torch.tensor([[3, 9, 27, 81, 50, 60, 70, 80]]) + pgm.global_rank
    model(ids, labels=ids).backward()
    z = model.zero3
    orders = (list(z.policy.forward_order), list(z.policy.backward_order))
    grads = [s.grad.clone() for s in z.shards]
    generate(model, PROMPTS, Generation(max_new_tokens=4))
    same = orders == (z.policy.forward_order, z.policy.backward_order) and \
        all(torch.equal(g, s.grad) for g, s in zip(grads, z.shards))
    return same, z.gathered_units(), model.training


def test_generating_leaves_zero3_training_state_as_it_was():
    for same, gathered, training in run_world(_training_state, 2, timeout=60):
        assert same and gathered == [] and training


def test_the_command_generates_on_zero3_shards(tmp_path):
    """--tp 1 on 2 ranks: dp_shard 2, the weights ZeRO-3 sharded: the lines one process prints."""
    argv = ["--prompt", "Hello", "--prompt", "Hi there", "--max-new-tokens", "6"]
    code, one = run_world(_cli, 1, str(tmp_path), argv, timeout=120)[0]
    (code2, two), (_, quiet) = run_world(_cli, 2, str(tmp_path), argv + ["--tp", "1"], timeout=120)
    rows = [json.loads(line) for line in two.splitlines() if line.startswith("{")]
    assert code == code2 == 0 and [r["prompt"] for r in rows] == ["Hello", "Hi there"]
    assert rows == [json.loads(line) for line in one.splitlines() if line.startswith("{")]
    assert not any(line.startswith("{") for line in quiet.splitlines())     # rank 0 prints
