"""Generation with the KV cache (models/kv_cache.py, minipar/post/) equals transformers' generate on
the same weights: greedy tokens for each family (Llama, Qwen3, Mixtral, Qwen3-MoE) and for a
left-padded batch, sampled tokens for the same seed (the same warpers in the same order, the same
draw), the cache's logits equal to the training forward's full recompute at every step, and tp 2
equal to one process. Every model is built inside a forked rank (tests/harness.py)."""
import contextlib
import io
import json
import os

import pytest
import torch
import transformers
from harness import run_world

import minipar
from minipar.generate import main
from minipar.post.generation import Generation, generate
from minipar.post.sampling import Sampling, warp
from minipar.trainer.checkpoint.save_load import save_checkpoint
from minipar.trainer.data.tokenizer import save_byte_tokenizer
from minipar.trainer.load_model import load_model
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

# transformers' model classes imported here, before any fork (no torch op runs), so that each forked
# rank inherits them instead of importing them again
HF_CLASSES = (transformers.LlamaForCausalLM, transformers.Qwen3ForCausalLM, transformers.MixtralForCausalLM,
              transformers.Qwen3MoeForCausalLM)
SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def hf_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "llama":
        cfg, cls = transformers.LlamaConfig(**SHAPE, intermediate_size=48), transformers.LlamaForCausalLM
    elif family == "qwen3":
        cfg, cls = transformers.Qwen3Config(**SHAPE, head_dim=16, intermediate_size=48), \
            transformers.Qwen3ForCausalLM
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**SHAPE, intermediate_size=48, num_local_experts=4,
                                         num_experts_per_tok=2)
        cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(**SHAPE, head_dim=16, intermediate_size=48,
                                          moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])
        cls = transformers.Qwen3MoeForCausalLM
    model = cls(cfg).float().eval()
    with torch.no_grad():   # larger weights: sharper distributions, fewer near-ties for greedy
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            elif p.dim() > 1:
                p.mul_(4.0)
    return model


def _hf_generate(hf, prompts, max_new, **kw):
    """transformers' new tokens per prompt, left-padded batch, pad id 0, no EOS."""
    s0 = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (s0 - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (s0 - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                      eos_token_id=None, pad_token_id=0, **kw)
    return out[:, s0:].tolist()


def _family(family, tmp, prompts, max_new):
    hf = hf_model(family)
    hf.save_pretrained(os.path.join(tmp, family))
    ours = LlamaForCausalLM.from_pretrained(os.path.join(tmp, family)).eval()
    ref = _hf_generate(hf, prompts, max_new, do_sample=False)
    got = generate(ours, prompts, Generation(max_new_tokens=max_new), record_logits=True)
    # the cache's logits at every step equal the training forward over the whole sequence (one row)
    seq = prompts[0] + got.tokens[0]
    with torch.no_grad():
        full = ours(torch.tensor([seq]))[0]
    for t, step_logits in enumerate(got.logits):
        torch.testing.assert_close(step_logits[0], full[len(prompts[0]) - 1 + t], atol=1e-5, rtol=1e-5)
    return ref, got.tokens


TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
PROMPTS = [[5, 17, 33, 2, 9, 40, 41], [7, 8], [60, 61, 62, 63]]


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "qwen3_moe"])
def test_greedy_equals_transformers_left_padded_batch(tmp_path, family):
    ref, got = run_world(_family, 1, family, str(tmp_path), PROMPTS, 8, timeout=120)[0]
    assert got == ref


def _sampled(tmp, settings):
    hf = hf_model("llama", seed=1)
    hf.save_pretrained(os.path.join(tmp, "m"))
    ours = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "m")).eval()
    s = Sampling(do_sample=True, seed=123, **settings)
    torch.manual_seed(123)                   # transformers draws from the global generator
    ref = _hf_generate(hf, PROMPTS, 10, do_sample=True, temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p)
    got = generate(ours, PROMPTS, Generation(max_new_tokens=10, sampling=s))
    # the warped distribution against transformers' own warpers, on the same scores
    scores = torch.randn(3, 96) * 3
    procs = hf._get_logits_processor(hf.generation_config.__class__(do_sample=True, temperature=s.temperature,
                                                                    top_k=s.top_k, top_p=s.top_p),
                                     input_ids_seq_length=1, encoder_input_ids=None,
                                     prefix_allowed_tokens_fn=None, logits_processor=None)
    gap = (torch.softmax(warp(scores, s), -1) - torch.softmax(procs(None, scores), -1)).abs().max()
    return ref, got.tokens, float(gap)


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=0, top_p=1.0),
                                      dict(temperature=1.3, top_k=20, top_p=0.9)], ids=["temp", "topk_topp"])
def test_sampled_tokens_equal_transformers_for_the_same_seed(tmp_path, settings):
    ref, got, gap = run_world(_sampled, 1, str(tmp_path), settings, timeout=120)[0]
    assert gap < 1e-6
    assert got == ref


def _tp2():
    """The same seeded weights on one process (pgm None) and split over tp 2 (the initialisation is
    layout-independent): greedy and sampled tokens, and every step's logits."""
    pgm = minipar.init(minipar.ParallelismConfig(tp_size=2))
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, model_type="qwen3", head_dim=16)
    one, two = LlamaForCausalLM(cfg, None, seed=3).eval(), LlamaForCausalLM(cfg, pgm, seed=3).eval()
    assert two.model.layers[0].self_attn.local_kv_heads == 1        # the cache split by heads
    out = []
    sampled = Sampling(do_sample=True, temperature=0.8, top_k=30, seed=5)
    for g in (Generation(max_new_tokens=6), Generation(max_new_tokens=6, sampling=sampled)):
        a, b = generate(one, PROMPTS, g, record_logits=True), generate(two, PROMPTS, g, record_logits=True)
        gap = max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))
        out.append((a.tokens, b.tokens, gap))
    return out


def test_tp2_equals_one_process():
    for one, two, gap in run_world(_tp2, 2, timeout=120)[1]:
        assert two == one and gap < 1e-5


def _refused(sizes):
    pgm = minipar.init(minipar.ParallelismConfig(**sizes))
    model = LlamaForCausalLM(LlamaConfig(**TINY), pgm)
    try:
        generate(model, PROMPTS)
    except ValueError as e:
        return str(e)


def test_pp_is_refused_with_the_fix():
    # cp, ep, ZeRO-3 and sequence parallelism generate (tests/test_generate_layouts.py); a pipeline does not
    msg = run_world(_refused, 2, dict(pp_size=2), timeout=60)[0]
    assert "pp_size 2" in msg and "python -m minipar.generate" in msg


def _checkpoint_any_layout(tmp):
    """A checkpoint saved sharded on tp 2 loads on one process and generates the same tokens."""
    pgm = minipar.init(minipar.ParallelismConfig(tp_size=2))
    cfg = LlamaConfig(**TINY)
    model = LlamaForCausalLM(cfg, pgm, seed=4).eval()
    ref = generate(model, PROMPTS, Generation(max_new_tokens=5)).tokens
    save_checkpoint(os.path.join(tmp, "step-1"), model, None, pgm, step=1)
    return ref


def _load_alone(tmp):
    model, tok = load_model(os.path.join(tmp, "step-1"))
    return generate(model, PROMPTS, Generation(max_new_tokens=5)).tokens


def test_a_tp2_checkpoint_generates_the_same_on_one_process(tmp_path):
    ref = run_world(_checkpoint_any_layout, 2, str(tmp_path), timeout=120)[0]
    assert run_world(_load_alone, 1, str(tmp_path), timeout=120)[0] == ref


def _cli(tmp, argv):
    """python -m minipar.generate on an HF directory (each rank writes the same seeded weights to
    its own, so that a world of several ranks does not write one file at once)."""
    d = os.path.join(tmp, f"hf{os.environ.get('RANK', '0')}")
    LlamaForCausalLM(LlamaConfig(**dict(TINY, vocab_size=256)), seed=2).save_pretrained(d)
    save_byte_tokenizer(d)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main([d] + argv)
    return code, buf.getvalue()


def test_the_command_streams_one_prompt_and_batches_several(tmp_path):
    one_prompt = ["--prompt", "Hello", "--max-new-tokens", "6"]
    code, one = run_world(_cli, 1, str(tmp_path), one_prompt, timeout=120)[0]
    assert code == 0 and len(one.rstrip("\n").encode()) > 0
    code, two = run_world(_cli, 1, str(tmp_path), ["--prompt", "Hello", "--prompt", "Hi there", "--do-sample",
                                                   "--top-k", "5", "--max-new-tokens", "6"], timeout=120)[0]
    rows = [json.loads(line) for line in two.splitlines()]
    assert code == 0 and [r["prompt"] for r in rows] == ["Hello", "Hi there"]
