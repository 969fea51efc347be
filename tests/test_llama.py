"""The reference decoder equals transformers.LlamaForCausalLM on the same weights."""
import json

import pytest
import torch
import transformers

from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig
from models.tied_weights import tie_weights


def _hf_model(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                                   attention_bias=False, mlp_bias=False)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():   # HF inits norms to ones; make them non-trivial so they are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_to_minipar_and_back(tmp_path, tied):
    hf = _hf_model(tied)
    hf.save_pretrained(tmp_path / "hf")
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert ours.config.tie_word_embeddings == tied and ours.config.num_key_value_heads == 2
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = ours(ids)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        # loss: HF shifts labels inside; ours takes shifted targets
        labels = ids.clone()
        labels[0, :5] = -100
        ref_loss = hf(input_ids=ids, labels=labels).loss
        targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
        torch.testing.assert_close(ours(ids, labels=targets), ref_loss, atol=1e-5, rtol=1e-5)
        # and back: minipar's save_pretrained loads into transformers with the same logits
        ours.save_pretrained(str(tmp_path / "ours"))
        back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "ours")).float().eval()
        torch.testing.assert_close(back(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-5)


def test_reads_rope_parameters_and_rope_theta():
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4)
    assert LlamaConfig.from_dict({**base, "rope_theta": 500.0}).rope_theta == 500.0
    cfg = LlamaConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 123.0}})
    assert cfg.rope_theta == 123.0 and cfg.num_key_value_heads == 4
    with pytest.raises(ValueError, match="rope_type"):
        LlamaConfig.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


def test_special_token_ids_load_and_export(tmp_path):
    hf = _hf_model(False)
    hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id = 1, [2, 7], 0
    hf.save_pretrained(tmp_path / "hf")
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert (ours.config.bos_token_id, ours.config.eos_token_id, ours.config.pad_token_id) == (1, [2, 7], 0)
    ours.save_pretrained(str(tmp_path / "ours"))
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, [2, 7], 0)
    back = transformers.AutoConfig.from_pretrained(str(tmp_path / "ours"))
    assert (back.bos_token_id, back.eos_token_id, back.pad_token_id) == (1, [2, 7], 0)
    assert LlamaConfig().to_hf_dict()["eos_token_id"] is None, "none known: null, as before"
    with pytest.raises(ValueError, match="eos_token_id"):
        LlamaConfig(eos_token_id=-1)


def test_init_is_seeded_and_hf_named():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    a, b, c = LlamaForCausalLM(cfg, seed=1), LlamaForCausalLM(cfg, seed=1), LlamaForCausalLM(cfg, seed=2)
    sa, sb, sc = a.full_state_dict(), b.full_state_dict(), c.full_state_dict()
    assert "model.layers.1.self_attn.k_proj.weight" in sa and "lm_head.weight" in sa
    assert sa["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    assert abs(sa["model.embed_tokens.weight"].std().item() - 0.02) < 0.002


def test_missing_file_and_wrong_shape(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LlamaForCausalLM.from_pretrained(str(tmp_path))
    hf = _hf_model(False)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    model = LlamaForCausalLM(LlamaConfig.from_dict({**cfg, "intermediate_size": 128}))
    from safetensors.torch import load_file
    with pytest.raises(ValueError, match="another model shape"):
        model.load_full_state_dict(load_file(str(tmp_path / "model.safetensors")))


LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8)


@pytest.mark.parametrize("extra", [dict(), dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
                                                attention_bias=True, mlp_bias=True,
                                                tie_word_embeddings=True)],
                         ids=["plain", "llama3-rope-biases-tied"])
def test_logits_loss_and_every_gradient_equal_transformers(tmp_path, extra):
    """fp64, the same weights (norms and biases random): logits, loss and each parameter's gradient.
    transformers computes its loss in fp32 (logits.float()) and the RoPE tables are fp32, so the two
    agree to ~1e-7 relative, not to fp64's 1e-15."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=96,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=128,
                                             tie_word_embeddings=False), **extra})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "hf")
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).double().train()
    assert (ours.config.rope_scaling is not None) == ("rope_scaling" in extra)
    hf = hf.double().train()
    ids = torch.randint(0, 256, (2, 24))
    labels = ids.clone()
    labels[0, :5] = -100
    torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-6, rtol=1e-6)
    targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)      # HF shifts inside
    loss, ref = ours(ids, labels=targets), hf(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, ref.double(), atol=0, rtol=1e-6)
    loss.backward()
    ref.backward()
    theirs = dict(hf.named_parameters())
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert sorted(grads) == sorted(theirs) and any(n.endswith("bias") for n in grads) == ("mlp_bias" in extra)
    for name, g in grads.items():
        want = theirs[name].grad
        assert want.norm() > 0 and (g - want).norm() <= 1e-6 * want.norm(), name     # measured: < 5e-7


def test_tied_gradients_are_summed_in_place_bit_for_bit():
    """lm_head tied to the embedding: autograd adds the embedding's gradient INTO lm_head's (one
    aten::add_ of (V, d), no third vocabulary-sized buffer, models/tied_weights.py's
    SummableGrad) where a plain F.linear weight gradient, a view, made it allocate the sum (aten::add);
    the gradients are the same bits."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    grads = {}
    for summable in (False, True):
        model = LlamaForCausalLM(cfg, seed=0)
        tie_weights(model.lm_head, model.model.embed_tokens, sum_in_place=summable)
        loss = model(ids, labels=ids)
        with torch.profiler.profile(record_shapes=True) as prof:
            loss.backward()
        sums = [e.name for e in prof.events()
                if e.name in ("aten::add", "aten::add_") and e.input_shapes[:1] == [[256, 64]]]
        assert sums == (["aten::add_"] if summable else ["aten::add"]), sums
        grads[summable] = {n: p.grad for n, p in model.named_parameters()}
    assert all(torch.equal(grads[False][n], g) for n, g in grads[True].items())
