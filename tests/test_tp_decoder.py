"""The decoder under tensor (and sequence) parallelism equals the single-process decoder."""
import pytest
import torch
from harness import run_world

import minipar
from minipar import ParallelismConfig
from minipar import tensor_parallel as tpl
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)


def _batch(seed=0, b=2, s=16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, s), generator=g)
    labels = torch.randint(0, 256, (b, s), generator=g)
    labels[0, :3] = -100
    return ids, labels


def _run(cfg_kwargs, tp, sp, steps=5):
    cfg = LlamaConfig(**cfg_kwargs)
    pgm = minipar.init(ParallelismConfig(tp_size=tp, sequence_parallel=sp)) if tp > 1 else None
    model = LlamaForCausalLM(cfg, pgm, seed=3)
    ids, labels = _batch()
    with torch.no_grad():
        logits = model(ids)
    loss = model(ids, labels=labels)
    loss.backward()
    grads = {n: tpl.gather_tensor(p.grad, p.tp_split_dim, model.pgm.tp) for n, p in model.named_parameters()}
    # 5 AdamW steps in float64: Adam divides by sqrt(v), so a gradient element that is ~0 turns fp32
    # rounding (different summation orders under TP) into a full lr-sized step; fp64 keeps the
    # comparison about the parallel algorithm, not about rounding.
    model = LlamaForCausalLM(cfg, pgm, seed=3).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        opt.zero_grad()
        ids, labels = _batch(step)
        model(ids, labels=labels).backward()
        opt.step()
    return dict(logits=logits, loss=loss.detach(), grads=grads, params=model.full_state_dict())


def _compare(ref, got, atol=1e-5):
    torch.testing.assert_close(got["logits"], ref["logits"], atol=atol, rtol=1e-5)
    torch.testing.assert_close(got["loss"], ref["loss"], atol=atol, rtol=1e-5)
    for name in ref["grads"]:
        torch.testing.assert_close(got["grads"][name], ref["grads"][name], atol=atol, rtol=1e-4, msg=name)
    for name in ref["params"]:
        torch.testing.assert_close(got["params"][name], ref["params"][name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("tp,sp,tied,kv", [(2, False, False, 4), (2, True, True, 2), (4, False, True, 4),
                                           (4, True, False, 4)])
def test_decoder_tp_equals_single_process(tp, sp, tied, kv):
    cfg = dict(CFG, tie_word_embeddings=tied, num_key_value_heads=kv)
    ref = _run(cfg, 1, False)
    results = run_world(_run, tp, cfg, tp, sp, timeout=180)
    for got in results:
        _compare(ref, got)
    # norms replicated over tp stay identical on every tp rank
    for name in ref["params"]:
        if "norm" in name:
            assert all(torch.equal(results[0]["params"][name], r["params"][name]) for r in results)


def _parallelize_real(tp, sp):
    """A plain decoder with real weights (the seed's full tensors) made tensor-parallel by
    parallelize, which slices them: the same model as the constructor's at this layout."""
    cfg = LlamaConfig(**dict(CFG, tie_word_embeddings=True))
    full = LlamaForCausalLM(cfg, None, seed=3).full_state_dict()
    pgm = minipar.init(ParallelismConfig(tp_size=tp, sequence_parallel=sp))
    plain = LlamaForCausalLM(cfg, pgm, device="meta", tensor_parallel=False).to_empty(device="cpu")
    plain.lm_head.weight = plain.model.embed_tokens.weight      # to_empty made two of the tied one
    plain.load_state_dict(dict(full, **{"lm_head.weight": full["model.embed_tokens.weight"]}))   # tied
    tpl.parallelize(plain, pgm.tp, sp)
    plain.tie_weights()
    built = LlamaForCausalLM(cfg, pgm, seed=3)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in built.named_parameters()]
    ids, labels = _batch()
    out = []
    for model in (plain, built):
        loss = model(ids, labels=labels)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(out[0][0], out[1][0], atol=0, rtol=0)
    for n, g in out[1][1].items():
        torch.testing.assert_close(out[0][1][n], g, atol=0, rtol=0, msg=n)
    return {n: torch.equal(t, full[n]) for n, t in plain.full_state_dict().items()}


@pytest.mark.parametrize("sp", [False, True])
def test_parallelize_slices_a_plain_models_real_weights(sp):
    for same in run_world(_parallelize_real, 2, 2, sp, timeout=120):
        assert all(same.values()), same
