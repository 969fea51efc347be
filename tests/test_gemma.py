"""Gemma 2 and Gemma 3 (text) on minipar's one decoder equal their transformers classes.

Each variant is a tiny random model built by transformers itself (its norms perturbed from their
zero start, weights large enough that the soft-caps bend: tanh(s / c) is far from s / c), saved as
a Hugging Face directory and loaded by minipar: logits, loss and every gradient equal transformers'
in fp32 (1e-5), with Gemma 2's capped attention (explicit scores) and final logits, the query
scale of query_pre_attn_scalar, alternating local / global layers whose window binds (W 8 < 24
tokens), Gemma 3's q/k norms, local RoPE base and linear scaling on its global layers. The same
directories load on tp 2 and under ZeRO-3 (dp_shard 2: tied embeddings) with the same logits and
export back to transformers; the capped layers under cp 2 (ring and Ulysses with packing: both the
all-gather path) and packed at cp 1 equal one process; generation with the KV cache equals
transformers' generate; train.py on a Gemma 2 base model under tp 2 with sequence parallelism
follows one process, as do the tied Gemma 2 on pp 2 and the tied Gemma 3 with LoRA on pp 2 x
dp_shard 2. Everything torch runs inside forked ranks (tests/harness.py). The configs
(defaults, refusals, wrap classes, the planner): tests/test_gemma_configs.py.
"""
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from harness import run_world
from test_families import load_export_reload
from test_hf_load import ROOT, TINY, _corpus, _tiny_tokenizer

import minipar
from minipar import ParallelismConfig
from minipar.context_parallel import shard_sequence
from minipar.post.generation import Generation, generate
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.llama import LlamaForCausalLM

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=None,
             initializer_range=0.08, query_pre_attn_scalar=24)
CAPS = dict(attn_logit_softcapping=1.0, final_logit_softcapping=1.5)
# variant -> (transformers' class prefix, config overrides)
VARIANTS = {
    "gemma2": ("Gemma2", CAPS),                                                   # W 4096: does not bind
    "gemma2-window": ("Gemma2", dict(CAPS, sliding_window=8)),
    "gemma3": ("Gemma3Text", dict()),                                             # W 4096, no caps
    "gemma3-window": ("Gemma3Text", dict(sliding_window=8, sliding_window_pattern=2,
                                         rope_local_base_freq=100.0, final_logit_softcapping=1.5,
                                         rope_scaling={"rope_type": "linear", "factor": 4.0})),
}
# transformers' classes resolved before any fork (no torch op runs for it)
CLASSES = {prefix: (getattr(transformers, prefix + "Config"),
                    getattr(transformers, prefix.replace("Text", "") + "ForCausalLM"))
           for prefix, _ in VARIANTS.values()}


def _hf_model(variant, seed=0, **overrides):
    prefix, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    hf = CLASSES[prefix][1](CLASSES[prefix][0](**{**SHAPE, **extra, **overrides})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return hf


def _ids(n=24):
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(1))


def _equal_to_transformers(variant, tmp):
    torch.set_num_threads(1)
    hf = _hf_model(variant)
    hf.save_pretrained(f"{tmp}/hf")
    ours = LlamaForCausalLM.from_pretrained(f"{tmp}/hf").train()
    hf.train()
    ids = _ids()
    labels = ids.clone()
    labels[0, :5] = -100
    torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    targets = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)      # HF shifts inside
    loss, ref = ours(ids, labels=targets), hf(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss, ref, atol=0, rtol=1e-5)
    loss.backward()
    ref.backward()
    theirs = dict(hf.named_parameters())
    grads = {n: p.grad for n, p in ours.named_parameters()}
    assert sorted(grads) == sorted(theirs), (sorted(grads), sorted(theirs))
    for name, g in grads.items():
        want = theirs[name].grad
        assert want.norm() > 0 and (g - want).norm() <= 1e-5 * want.norm(), name
    # the caps bend: without them transformers' logits differ (so the test would see a cap missed)
    cfg = ours.config
    with torch.no_grad():
        hf.config.final_logit_softcapping = None
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = hf(input_ids=ids).logits
    bends = bool((uncapped - ours(ids)).abs().max() > 1e-2)
    return cfg.model_type, [cfg.attention_window(i) for i in range(2)], cfg.attention_softcap, bends, \
        sorted(n for n in grads if "layers.0." in n)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_loss_and_every_gradient_equal_transformers(tmp_path, variant):
    kind, windows, cap, bends, names = run_world(_equal_to_transformers, 1, variant, str(tmp_path),
                                                 timeout=60)[0]
    assert kind == {"Gemma2": "gemma2", "Gemma3Text": "gemma3_text"}[VARIANTS[variant][0]]
    # Gemma 2: every other layer local; Gemma 3: all but every 6th (sliding_window_pattern 2 here: 1 in 2)
    assert windows == {"gemma2": [4096, None], "gemma3": [4096, 4096]}.get(variant, [8, None])
    assert cap == (1.0 if kind == "gemma2" else None)
    assert bends == (variant != "gemma3")
    sandwich = {f"model.layers.0.{n}_layernorm.weight" for n in ("input", "post_attention", "pre_feedforward",
                                                                 "post_feedforward")}
    assert sandwich <= set(names)
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (kind == "gemma3_text")


def _packed(variant, tmp):
    """Two packed documents (10 + 14 tokens) at cp 1: what each computes alone."""
    torch.set_num_threads(1)
    hf = _hf_model(variant)
    hf.save_pretrained(f"{tmp}/hf")
    ours = LlamaForCausalLM.from_pretrained(f"{tmp}/hf").eval()
    ids = _ids()[:1]
    docs = torch.tensor([[0] * 10 + [1] * 14])
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with torch.no_grad():
        got = ours(ids, position_ids=pos, document_ids=docs)
        want = torch.cat([hf(input_ids=ids[:, :10]).logits, hf(input_ids=ids[:, 10:]).logits], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["gemma2-window", "gemma3-window"])
def test_packed_documents_are_each_document_alone(tmp_path, variant):
    run_world(_packed, 1, variant, str(tmp_path), timeout=60)


def _under_cp(variant, tmp, cp_impl, packed):
    """cp 2: each rank's share of the loss and of every gradient; their sums are one process's."""
    torch.set_num_threads(1)
    ids = _ids()
    docs = torch.tensor([[0] * 10 + [1] * 14] * 2) if packed else None
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None].expand(2, -1) if packed else \
        torch.arange(24)[None].expand(2, -1)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    if packed:
        targets[:, 9] = -100                         # the last token of a document predicts nothing
    if dist.get_rank() == 0:
        _hf_model(variant).save_pretrained(f"{tmp}/hf")
        one = LlamaForCausalLM.from_pretrained(f"{tmp}/hf")
        loss = one(ids, position_ids=pos, labels=targets, document_ids=docs)
        loss.backward()
        torch.save((loss.detach(), {n: p.grad for n, p in one.named_parameters()}), f"{tmp}/ref.pt")
    dist.barrier()
    pgm = minipar.init(ParallelismConfig(cp_size=2, cp_impl=cp_impl).resolve(2))
    model = LlamaForCausalLM.from_pretrained(f"{tmp}/hf", pgm)
    share = [shard_sequence(t, 1, pgm.cp) if t is not None else None for t in (ids, pos, targets, docs)]
    loss = model(share[0], position_ids=share[1], labels=share[2], document_ids=share[3])
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)                            # the cp ranks' shares summed, as DDP would
    for p in model.parameters():
        dist.all_reduce(p.grad)
    if dist.get_rank() == 0:
        ref_loss, ref = torch.load(f"{tmp}/ref.pt")
        torch.testing.assert_close(loss, ref_loss, atol=0, rtol=1e-5)
        for name, p in model.named_parameters():
            want = ref[name]
            assert want.norm() > 0 and (p.grad - want).norm() <= 1e-5 * want.norm(), name


@pytest.mark.parametrize("variant,cp_impl,packed", [("gemma2", "ring", False),
                                                    ("gemma2-window", "ulysses", True),
                                                    ("gemma3-window", "ring", True)],
                         ids=["gemma2-ring", "gemma2-ulysses-packed", "gemma3-ring-packed"])
def test_under_context_parallelism(tmp_path, variant, cp_impl, packed):
    run_world(_under_cp, 2, variant, str(tmp_path), cp_impl, packed, timeout=90)


def _on_layout(variant, tmp, sizes):
    hf_class = CLASSES[VARIANTS[variant][0]][1]
    return load_export_reload(lambda: _hf_model(variant), hf_class, _ids(), tmp, sizes)


@pytest.mark.parametrize("variant,sizes", [("gemma2-window", dict(tp_size=2)),
                                           ("gemma3-window", dict(tp_size=2)),
                                           ("gemma3-window", dict(dp_shard_size=2))],
                         ids=["gemma2-tp2", "gemma3-tp2", "gemma3-dp_shard2"])
def test_loads_on_a_layout_and_exports_back(tmp_path, variant, sizes):
    back = run_world(_on_layout, 2, variant, str(tmp_path), sizes, timeout=90)[0]
    assert back["layer_types"] == ["sliding_attention", "full_attention"] and back["tie_word_embeddings"]
    assert back["query_pre_attn_scalar"] == 24 and back["hidden_activation"] == "gelu_pytorch_tanh"
    if variant.startswith("gemma3"):
        assert back["rope_parameters"]["sliding_attention"]["rope_theta"] == 100.0
        assert back["rope_parameters"]["full_attention"]["rope_type"] == "linear"


# ------------------------------------------------------------------ generation with the KV cache
def _generates(variant, tmp):
    torch.set_num_threads(1)
    hf = _hf_model(variant)
    hf.save_pretrained(f"{tmp}/hf")
    ours = LlamaForCausalLM.from_pretrained(f"{tmp}/hf").eval()
    prompts = [[5, 17, 33, 2, 9, 40, 41], [7, 8], [60, 61, 62, 63]]
    s0 = max(map(len, prompts))
    ids = torch.tensor([[0] * (s0 - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (s0 - len(p)) + [1] * len(p) for p in prompts])
    ref = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                      eos_token_id=None, pad_token_id=0)[:, s0:].tolist()
    got = generate(ours, prompts, Generation(max_new_tokens=8), record_logits=True)
    seq = prompts[0] + got.tokens[0]                 # the cache's logits = the training forward's
    with torch.no_grad():
        full = ours(torch.tensor([seq]))[0]
    for t, step_logits in enumerate(got.logits):
        torch.testing.assert_close(step_logits[0], full[len(prompts[0]) - 1 + t], atol=1e-5, rtol=1e-5)
    return ref, got.tokens


@pytest.mark.parametrize("variant", ["gemma2-window", "gemma3-window"])
def test_greedy_generation_equals_transformers(tmp_path, variant):
    ref, got = run_world(_generates, 1, variant, str(tmp_path), timeout=60)[0]
    assert got == ref


# ------------------------------------------------------------------ train.py on a Gemma 2 checkpoint
def _write_base(directory, variant, overrides):
    torch.set_num_threads(1)
    _hf_model(variant, vocab_size=384, **overrides).save_pretrained(directory)
    _tiny_tokenizer(directory)                       # base_model is also the tokenizer


def _train(argv):
    torch.set_num_threads(1)
    return [(r["loss"], r["grad_norm"]) for r in Trainer(setup_run(argv)).train()]


# (the base, its config overrides, the layout's flags and ranks):
#   tp2-sp      Gemma 2, window 8 on sequences of 32, capped logits: the sandwich norms' weights on
#               sequence shards, their gradients summed over tp
#   pp2         an untied Gemma 3 under 1F1B: the scaled embedding on the first stage, the capped
#               logits on the last
#   pp2-tied    Gemma 2 tied as transformers builds it, under 1F1B: the embedding on the first stage,
#               a copy for the lm_head on the last, their gradients summed (pipeline_parallel/tied_ends.py)
#   pp2-tied-zero3-lora  the tied Gemma 3 on pp 2 x dp_shard 2 with LoRA (the copies frozen: no sum)
#   lora-shard2 LoRA on a Gemma 2 base sharded by ZeRO-3 over 2 ranks
LORA = ["--adapter", "lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_linear", "true"]
TRAIN_LAYOUTS = {    # name: (the base, its overrides, settings of both runs, the layout's sizes, ranks)
    "tp2-sp": ("gemma2-window", {}, ["--sequence_parallel", "true"], ["--tensor_parallel_size", "2"], 2),
    "pp2": ("gemma3-window", dict(tie_word_embeddings=False), ["--micro_batch_size", "1"],
            ["--pipeline_parallel_size", "2"], 2),
    "pp2-tied": ("gemma2-window", {}, ["--micro_batch_size", "1"], ["--pipeline_parallel_size", "2"], 2),
    "pp2-tied-zero3-lora": ("gemma3-window", {}, LORA + ["--micro_batch_size", "1"],
                            ["--pipeline_parallel_size", "2", "--dp_shard_size", "2"], 4),
    "lora-shard2": ("gemma2-window", {}, LORA, ["--dp_shard_size", "2"], 2),
}


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS)
def test_gemma_trains_on_a_layout_like_one_process(tmp_path, layout):
    """train.py with a Gemma base_model follows one process's losses and gradient norms."""
    variant, overrides, settings, layout_sizes, ranks = TRAIN_LAYOUTS[layout]
    base = str(tmp_path / "base")
    run_world(_write_base, 1, base, variant, overrides, timeout=60)

    def argv(out, extra):
        sizes = {"--dp_shard_size": "1", "--context_parallel_size": "1", "--tensor_parallel_size": "1",
                 "--pipeline_parallel_size": "1"}
        sizes.update(zip(extra[::2], extra[1::2]))
        return [os.path.join(ROOT, "configs", "finetune.yaml"), "--base_model", base, "--output_dir",
                str(tmp_path / out), "--max_steps", "3", "--export_hf", "false", *TINY, "--dataset",
                _corpus(), *settings, *[x for kv in sizes.items() for x in kv]]
    ref = run_world(_train, 1, argv("one", []), timeout=120)[0]
    got = run_world(_train, ranks, argv("many", layout_sizes), timeout=120)
    for curve in got:
        assert len(curve) == len(ref) == 3
        for (a, ga), (b, gb) in zip(ref, curve):
            assert abs(a - b) <= 1e-4 * abs(a) and abs(ga - gb) <= 1e-4 * abs(ga), (ref, curve)
