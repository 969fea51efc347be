"""LoRA (minipar/lora/): the adapter equals PEFT's on the same weights, PEFT's directory goes out and
comes back, the merge equals the adapted model, and under tp the adapters equal one process."""
import pytest
import torch
import transformers
from harness import run_world

import minipar
from minipar import ParallelismConfig
from minipar import tensor_parallel as tpl
from minipar.lora import (
    adapter_config,
    add_lora,
    check_adapter,
    check_targets,
    full_adapters,
    load_adapters,
    merge,
    save_adapter,
)
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

ALL = list(LlamaForCausalLM.lora_target_modules)
CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _hf_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**CFG, max_position_embeddings=128, rope_theta=10000.0,
                                   rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False)
    return transformers.LlamaForCausalLM(cfg).float().eval()


@torch.no_grad()
def _train_b(model, seed=1):
    """B is zero at the start (step 0 = the base); give it values, as training would."""
    g = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        if n.endswith("lora_B"):
            full = torch.randn(p.tp_full_shape, generator=g) * 0.1
            p.copy_(tpl.shard_tensor(full, p.tp_split_dim, model.pgm.tp))


def test_adapter_equals_peft_out_in_and_merged(tmp_path):
    import peft
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "base")
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        base_logits = ours(ids)
    add_lora(ours, ALL, r=4, alpha=8, seed=0)
    assert all(not p.requires_grad for n, p in ours.named_parameters() if ".lora." not in n)
    assert sum(p.requires_grad for p in ours.parameters()) == 2 * 7 * 2
    with torch.no_grad():                       # B = 0: step 0 is the base exactly
        torch.testing.assert_close(ours(ids), base_logits, atol=0, rtol=0)
    _train_b(ours)
    with torch.no_grad():
        got = ours(ids)
    assert (got - base_logits).abs().max() > 1e-3
    full = full_adapters(ours, ours.pgm)
    save_adapter(str(tmp_path / "adapter"), full, adapter_config(4, 8, 0.0, ALL, str(tmp_path / "base")))
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        ref = peft_model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # PEFT's own save comes back into a fresh minipar model with the same logits
    peft_model.save_pretrained(str(tmp_path / "peft_saved"))
    again = LlamaForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    add_lora(again, ALL, r=4, alpha=8, seed=5)
    shapes = {n: tuple(p.tp_full_shape) for n, p in again.named_parameters() if ".lora." in n}
    assert check_adapter(str(tmp_path / "peft_saved"), shapes, 4, 8) == []
    load_adapters(again, str(tmp_path / "peft_saved"), again.pgm.tp)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), ref, atol=1e-5, rtol=1e-5)
    # merged: W0 + (alpha/r) B A, a plain model transformers loads alone
    base = {n: p.detach() for n, p in ours.named_parameters() if ".lora." not in n}
    merged = merge(base, full, 8 / 4)
    plain = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
    plain.load_full_state_dict(merged)
    plain.save_pretrained(str(tmp_path / "merged"))
    alone = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(alone(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-5)
    # an adapter of another shape or rank is refused, naming what differs
    add_lora(wrong := LlamaForCausalLM(LlamaConfig(**dict(CFG, intermediate_size=128))), ALL, 4, 8)
    wrong_shapes = {n: tuple(p.tp_full_shape) for n, p in wrong.named_parameters() if ".lora." in n}
    problems = check_adapter(str(tmp_path / "adapter"), wrong_shapes, 2, 8)
    assert "its r is 4, this run's lora_r 2" in problems[0]
    assert "shapes differ" in problems[-1] and "gate_proj" in problems[-1]


def test_bad_targets_and_rank_are_refused():
    with pytest.raises(ValueError, match=r"lora_target_modules \['qkv_proj'\].*choose from"):
        check_targets(["q_proj", "qkv_proj"], False, ALL)
    with pytest.raises(ValueError, match="needs lora_target_modules"):
        check_targets([], False, ALL)
    assert check_targets(["v_proj", "q_proj"], False, ALL) == ["q_proj", "v_proj"]
    assert check_targets(None, True, ALL) == ALL
    with pytest.raises(ValueError, match="lora_r must be an integer >= 1, got 0"):
        add_lora(LlamaForCausalLM(LlamaConfig(**CFG)), ALL, r=0, alpha=8)


def _tp_run(tp, sp, dtype):
    pgm = minipar.init(ParallelismConfig(tp_size=tp, sequence_parallel=sp)) if tp > 1 else None
    model = LlamaForCausalLM(LlamaConfig(**CFG), pgm, seed=3).to(dtype)
    add_lora(model, ALL, r=4, alpha=8, seed=0)
    model.to(dtype)
    _train_b(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (2, 16), generator=g)
    labels = torch.randint(0, 256, (2, 16), generator=g)
    with torch.no_grad():
        logits = model(ids)
    model(ids, labels=labels).backward()
    grads = {n: tpl.gather_tensor(p.grad, p.tp_split_dim, model.pgm.tp)
             for n, p in model.named_parameters() if p.requires_grad}
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    return dict(logits=logits, grads=grads, frozen_grads=frozen_grads)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_tp_adapters_equal_one_process_in_fp64(sp):
    ref = _tp_run(1, False, torch.float64)
    assert len(ref["grads"]) == 28 and ref["frozen_grads"] == []
    for got in run_world(_tp_run, 2, 2, sp, torch.float64, timeout=120):
        torch.testing.assert_close(got["logits"], ref["logits"], atol=1e-10, rtol=1e-10)
        assert got["frozen_grads"] == []
        for n in ref["grads"]:             # column A and row B: summed over tp, not a partial sum
            torch.testing.assert_close(got["grads"][n], ref["grads"][n], atol=1e-10, rtol=1e-10, msg=n)


@pytest.mark.parametrize("argv,messages", [
    (["--adapter", "qlora", "--load_in_4bit", "true"],
     ["adapter: qlora, load_in_4bit: true: quantised bases"]),
    (["--load_in_8bit", "true"], ["load_in_8bit: true: quantised bases"]),
    (["--adapter", "lora", "--lora_r", "0", "--lora_alpha", "-1", "--lora_target_modules", "[q_proj, qkv]"],
     ["3 config values are wrong", "lora_r must be an integer >= 1 (the adapters' rank), got 0",
      "lora_alpha must be > 0", "lora_target_modules ['qkv'] are not Linear layers of this model"]),
    (["--adapter", "lora", "--lora_target_linear", "true", "--lora_modules_to_save", "[lm_head]",
      "--tp_async_overlap", "true"], ["lora_modules_to_save ['lm_head'] is not supported",
                                      "tp_async_overlap with adapter: lora"]),
    (["--merge_lora", "true"], ["merge_lora set without adapter: lora"]),
    (["--adapter", "lora", "--lora_target_linear", "true", "--lora_model_dir", "/nonexistent"],
     ["lora_model_dir '/nonexistent' does not fit this model", "is not a PEFT adapter directory"]),
])
def test_config_refuses_bad_lora_keys_naming_every_value(argv, messages):
    from minipar.trainer.config.train_config import load_config
    with pytest.raises(ValueError) as err:
        load_config(None, argv)
    for m in messages:
        assert m in str(err.value), str(err.value)
