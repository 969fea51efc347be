"""Qwen2/Qwen2.5, Mistral and Phi-3/Phi-4 on minipar's one decoder equal their transformers classes.

Each family is a tiny random model built by transformers itself (norms and biases perturbed so they
are tested), saved as a Hugging Face directory and loaded by minipar: logits, loss and every
gradient equal transformers' in fp32 (1e-5), with and without a sliding window that binds (W 8 <
24 tokens); the same directory loads on tp 2 (and under ZeRO-3, dp_shard 2, for Phi-3's fused
tensors) with the same logits, and the export reloads in transformers with them too. Everything
torch runs inside forked ranks (tests/harness.py): the test process itself runs no torch op.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist
import transformers
from harness import run_world
from test_hf_load import ROOT, TINY, _corpus, _tiny_tokenizer

import minipar
from minipar import ParallelismConfig
from minipar.context_parallel import shard_sequence
from minipar.trainer.config.train_config import load_config
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.hf_checkpoint import HFCheckpoint
from models.hf_names import to_hub
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None)
# variant -> (transformers' family prefix, config overrides)
VARIANTS = {
    "qwen2.5": ("Qwen2", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                              tie_word_embeddings=True, use_sliding_window=False, sliding_window=131072,
                              max_window_layers=28)),
    "qwen2-window": ("Qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "mistral": ("Mistral", dict(sliding_window=None)),
    "mistral-window": ("Mistral", dict(sliding_window=8)),
    "phi3-partial-rope": ("Phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5})),
}
# transformers' classes resolved here, before any fork: its lazy modules imported once, inherited
# by every rank instead of imported again in each (no torch op runs for it)
CLASSES = {prefix: (getattr(transformers, prefix + "Config"), getattr(transformers, prefix + "ForCausalLM"))
           for prefix, _ in VARIANTS.values()}


def _hf_class(variant):
    return CLASSES[VARIANTS[variant][0]][1]


def _hf_model(variant, seed=0, **overrides):
    prefix, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    cfg = CLASSES[prefix][0](**{**SHAPE, **extra, **overrides})
    hf = _hf_class(variant)(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


def _ids():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _equal_to_transformers(variant, tmp):
    torch.set_num_threads(1)
    hf = _hf_model(variant)
    hf.save_pretrained(f"{tmp}/hf")
    ours = LlamaForCausalLM.from_pretrained(f"{tmp}/hf").train()
    hf.train()                                       # no dropout in either
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
    # minipar's names -> the Hub's (Phi-3's q/k/v and gate/up gradients fused as its weights are)
    grads = to_hub({n: p.grad for n, p in ours.named_parameters()}, ours.config.model_type)
    assert sorted(grads) == sorted(theirs), (sorted(grads), sorted(theirs))
    for name, g in grads.items():
        want = theirs[name].grad
        assert want.norm() > 0 and (g - want).norm() <= 1e-5 * want.norm(), name
    return ours.config.model_type, [ours.config.attention_window(i) for i in range(2)], \
        [n for n, _ in ours.named_parameters() if n.endswith("bias")]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_loss_and_every_gradient_equal_transformers(tmp_path, variant):
    kind, windows, biases = run_world(_equal_to_transformers, 1, variant, str(tmp_path), timeout=60)[0]
    assert kind == VARIANTS[variant][0].lower()
    assert windows == {"qwen2-window": [None, 8], "mistral-window": [8, 8]}.get(variant, [None, None])
    qkv = sorted(f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2) for p in "qkv")
    assert sorted(biases) == (qkv if kind == "qwen2" else [])


def _packed_window(tmp):
    """Two packed documents (10 + 14 tokens) under a window of 8: what each computes alone."""
    torch.set_num_threads(1)
    hf = _hf_model("mistral-window")
    hf.save_pretrained(f"{tmp}/hf")
    ours = LlamaForCausalLM.from_pretrained(f"{tmp}/hf").eval()
    ids = _ids()[:1]
    docs = torch.tensor([[0] * 10 + [1] * 14])
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    with torch.no_grad():
        got = ours(ids, position_ids=pos, document_ids=docs)
        want = torch.cat([hf(input_ids=ids[:, :10]).logits, hf(input_ids=ids[:, 10:]).logits], dim=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_sliding_window_under_packing_is_each_document_alone(tmp_path):
    run_world(_packed_window, 1, str(tmp_path), timeout=60)


def _window_under_cp(tmp, cp_impl, packed):
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
        _hf_model("mistral-window").save_pretrained(f"{tmp}/hf")
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


@pytest.mark.parametrize("cp_impl,packed", [("ring", False), ("ulysses", True)],
                         ids=["ring", "ulysses-packed"])
def test_sliding_window_under_context_parallelism(tmp_path, cp_impl, packed):
    run_world(_window_under_cp, 2, str(tmp_path), cp_impl, packed, timeout=90)


def load_export_reload(make_hf, hf_class, ids, tmp, sizes):
    """Rank 0 writes make_hf()'s checkpoint and transformers' logits; every rank loads it on the
    layout `sizes` (logits equal) and exports; rank 0 reloads the export with hf_class (logits equal)
    and returns its config as a dict (None on the other ranks). tests/test_gemma.py uses it too."""
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        hf = make_hf()
        hf.save_pretrained(f"{tmp}/hf")
        with torch.no_grad():
            torch.save(hf(input_ids=ids).logits, f"{tmp}/ref.pt")
    dist.barrier()
    pgm = minipar.init(ParallelismConfig(**sizes).resolve(dist.get_world_size()))
    ckpt = HFCheckpoint(f"{tmp}/hf")
    model = LlamaForCausalLM(ckpt.config, pgm, device="meta")
    ckpt.check(model)
    source = ckpt.source(pgm.tp)
    if sizes.get("dp_shard_size", 1) > 1:
        from minipar.zero3 import fully_shard
        fully_shard(model, pgm, init=source)
    else:
        from models.llama_init import materialize
        materialize(model, source)
    ref = torch.load(f"{tmp}/ref.pt")
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), ref, atol=1e-5, rtol=1e-5)
    model.save_pretrained(f"{tmp}/ours")
    dist.barrier()
    if dist.get_rank() == 0:
        back = hf_class.from_pretrained(f"{tmp}/ours", dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-5)
        return back.config.to_dict()
    return None


def _on_layout(variant, tmp, sizes):
    load_export_reload(lambda: _hf_model(variant), _hf_class(variant), _ids(), tmp, sizes)
    return sorted(json.load(open(f"{tmp}/ours/config.json")))


@pytest.mark.parametrize("variant,sizes", [("qwen2-window", dict(tp_size=2)),
                                           ("mistral-window", dict(tp_size=2)),
                                           ("phi3-partial-rope", dict(tp_size=2)),
                                           ("phi3-partial-rope", dict(dp_shard_size=2))],
                         ids=["qwen2-tp2", "mistral-tp2", "phi3-tp2", "phi3-dp_shard2"])
def test_loads_on_a_layout_and_exports_back(tmp_path, variant, sizes):
    keys = run_world(_on_layout, 2, variant, str(tmp_path), sizes, timeout=90)[0]
    assert "attention_bias" not in keys and ("partial_rotary_factor" in keys) == variant.startswith("phi3")


# ------------------------------------------------------------------ configs: read, refused, wrapped
def test_family_configs_read_and_refused():
    base = dict(SHAPE, pad_token_id=None)
    # Qwen2.5's config: a window that is off; Mistral's window defaults to transformers' 4096
    qwen = LlamaConfig.from_dict(dict(base, model_type="qwen2", sliding_window=32768,
                                      use_sliding_window=False, max_window_layers=21))
    assert qwen.sliding_window is None and qwen.qkv_bias and not qwen.attention_bias
    assert LlamaConfig.from_dict(dict(base, model_type="mistral")).attention_window(1) == 4096
    phi = LlamaConfig.from_dict(dict(base, model_type="phi3", partial_rotary_factor=0.75, head_dim=16))
    assert phi.rotary_dim == 12
    refused = [(dict(model_type="phi3", rope_scaling={"type": "longrope", "short_factor": [1.0],
                                                       "long_factor": [1.0]}), "rope_type 'longrope'"),
               (dict(model_type="mistral", attention_dropout=0.1), "attention_dropout=0.1 (set it to 0)"),
               (dict(model_type="llama", sliding_window=8), "sliding_window=8"),
               (dict(model_type="qwen3", sliding_window=8, use_sliding_window=True), "sliding_window=8"),
               (dict(model_type="llama", partial_rotary_factor=0.5), "only phi3 rotates part")]
    for extra, message in refused:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            LlamaConfig.from_dict(dict(base, **extra))


@pytest.mark.parametrize("kind,layer,ok", [("qwen2", "Qwen2DecoderLayer", True),
                                           ("mistral", "MistralDecoderLayer", True),
                                           ("phi3", "Phi3DecoderLayer", True),
                                           ("qwen2", "LlamaDecoderLayer", True),
                                           ("qwen2", "MistralDecoderLayer", False)])
def test_transformer_layer_cls_to_wrap_names_the_family(tmp_path, kind, layer, ok):
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  model_type: {kind}\nfsdp_config:\n  transformer_layer_cls_to_wrap: {layer}\n")
    if ok:
        assert load_config(str(path)).fsdp.wrap == [layer]
    else:
        with pytest.raises(ValueError, match=r"only \[Qwen2DecoderLayer, LlamaDecoderLayer\] units"):
            load_config(str(path))


def test_lora_on_phi3s_fused_projections_is_refused(tmp_path):
    """transformers' Phi-3 has no q/k/v or gate/up module for PEFT to put the adapters on."""
    path = tmp_path / "c.yaml"
    lora = "adapter: lora\nlora_r: 8\nlora_alpha: 16\n"
    path.write_text(f"model:\n  model_type: phi3\n{lora}lora_target_linear: true\n")
    with pytest.raises(ValueError, match=r"adapter: lora on \['q_proj', 'k_proj', 'v_proj', 'gate_proj', "
                                         r"'up_proj'\] of a phi3 model"):
        load_config(str(path))
    path.write_text(f"model:\n  model_type: phi3\n{lora}lora_target_modules: [o_proj, down_proj]\n")
    assert load_config(str(path)).lora_target_modules == ["o_proj", "down_proj"]


# ------------------------------------------------------------------ train.py on a family's checkpoint
def _write_base(directory):
    torch.set_num_threads(1)
    _hf_model("mistral-window", vocab_size=384).save_pretrained(directory)
    _tiny_tokenizer(directory)                       # base_model is also the tokenizer


def _train(argv):
    torch.set_num_threads(1)
    return [(r["loss"], r["grad_norm"]) for r in Trainer(setup_run(argv)).train()]


def test_mistral_window_trains_under_cp2_like_one_process(tmp_path):
    """train.py, base_model a Mistral with a window of 8 on sequences of 32: cp 2 (the windowed
    layers' K/V all-gathered) follows one process's losses and gradient norms."""
    base = str(tmp_path / "base")
    run_world(_write_base, 1, base, timeout=60)

    def argv(out, cp):
        return [os.path.join(ROOT, "configs", "finetune.yaml"), "--base_model", base, "--output_dir",
                str(tmp_path / out), "--max_steps", "3", "--export_hf", "false", *TINY, "--dataset",
                _corpus(), "--dp_shard_size", "1", "--context_parallel_size", str(cp),
                "--tensor_parallel_size", "1"]
    ref = run_world(_train, 1, argv("one", 1), timeout=120)[0]
    got = run_world(_train, 2, argv("two", 2), timeout=120)
    for curve in got:
        assert len(curve) == len(ref) == 3
        for (a, ga), (b, gb) in zip(ref, curve):
            assert abs(a - b) <= 1e-4 * abs(a) and abs(ga - gb) <= 1e-4 * abs(ga), (ref, curve)
