"""The MoE decoder (models/moe.py, models/moe_aux.py) equals transformers' MixtralForCausalLM and
Qwen3MoeForCausalLM on the same weights: logits, the aux loss, the loss and every gradient."""
import pytest
import torch
import transformers
from safetensors import safe_open

from minipar.mesh import ProcessGroupManager
from models.hf_checkpoint import HFCheckpoint
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

SHAPE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)


def hf_model(family: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**SHAPE, intermediate_size=48, num_local_experts=4,
                                         num_experts_per_tok=2, router_aux_loss_coef=0.02, **overrides)
        cls = transformers.MixtralForCausalLM
    elif family == "qwen3_moe":
        kw = dict(SHAPE, head_dim=16, intermediate_size=64, moe_intermediate_size=24, num_experts=6,
                  num_experts_per_tok=3, norm_topk_prob=False, router_aux_loss_coef=0.02,
                  decoder_sparse_step=1, mlp_only_layers=[1])
        cfg = transformers.Qwen3MoeConfig(**{**kw, **overrides})
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen3Config(**SHAPE, head_dim=16, intermediate_size=64, **overrides)
        cls = transformers.Qwen3ForCausalLM
    model = cls(cfg).float().eval()
    with torch.no_grad():   # non-trivial norms and a router that is not zero (Qwen3-MoE inits it so)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def to_minipar(hf_state: dict) -> dict:
    """transformers 5's in-memory names (experts fused as gate_up_proj (E, 2F, d)) -> minipar's
    stacked gate_proj / up_proj (E, F, d)."""
    out = {}
    for name, t in hf_state.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


def ours_from(hf) -> LlamaForCausalLM:
    d = hf.config.to_dict()
    ours = LlamaForCausalLM(LlamaConfig.from_dict(d))
    ours.load_full_state_dict(to_minipar(hf.state_dict()), "transformers' model")
    return ours


def shifted(labels):
    return torch.cat([labels[:, 1:], torch.full((labels.shape[0], 1), -100)], dim=1)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3"])
def test_equals_transformers(family):
    hf = hf_model(family)
    ours = ours_from(hf)
    if family != "qwen3":
        assert [layer.is_moe for layer in ours.model.layers] == \
            ([True, True] if family == "mixtral" else [True, False])
    ids = torch.randint(0, 128, (2, 16))
    labels = ids.clone()
    labels[0, :3] = -100
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    out = hf(input_ids=ids, labels=labels, output_router_logits=family != "qwen3")
    out.loss.backward()
    loss = ours(ids, labels=shifted(labels))
    loss.backward()
    torch.testing.assert_close(loss, out.loss, atol=1e-6, rtol=1e-5)
    if family != "qwen3":
        torch.testing.assert_close(ours.moe_metrics["aux_loss"], out.aux_loss, atol=1e-6, rtol=1e-5)
        assert ours.moe_metrics["counts"].sum() == 2 * 16 * hf.config.num_experts_per_tok * \
            sum(layer.is_moe for layer in ours.model.layers)
    grads = to_minipar({n: p.grad for n, p in hf.named_parameters()})
    checked = 0
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], atol=1e-5, rtol=1e-4, msg=name)
        checked += 1
    assert checked == len(grads)


def test_the_aux_loss_is_in_the_gradient():
    """router_aux_loss_coef 0 changes the router's gradient (and nothing would if aux were left out)."""
    hf = hf_model("mixtral")
    a = ours_from(hf)
    b = ours_from(hf)
    b.config.router_aux_loss_coef = 0.0
    ids = torch.randint(0, 128, (2, 16))
    for m in (a, b):
        m(ids, labels=shifted(ids)).backward()
    ga, gb = (m.model.layers[0].mlp.gate.weight.grad for m in (a, b))
    assert not torch.allclose(ga, gb)
    # the last layer's experts feed only the cross-entropy: aux leaves their gradient alone
    torch.testing.assert_close(a.model.layers[-1].mlp.experts.down_proj.grad,
                               b.model.layers[-1].mlp.experts.down_proj.grad)


def test_capacity_drops_past_the_cap_and_counts_them():
    hf = hf_model("mixtral")
    ours = ours_from(hf)
    ids = torch.randint(0, 128, (2, 16))
    ours(ids, labels=shifted(ids))
    assert ours.moe_metrics["dropped"] == 0                  # dropless by default
    counts = ours.moe_metrics["counts"]                      # (L, E) copies per expert
    for layer in ours.model.layers:
        layer.mlp.capacity_factor = 1.0
    ours(ids, labels=shifted(ids))
    cap = -(-32 * 2 // 4)                                    # ceil(1.0 * T * k / E), T = 32 tokens
    assert ours.moe_metrics["dropped"] == int((counts - cap).clamp(min=0).sum()) > 0
    # a huge factor drops nothing and gives the dropless logits
    for layer in ours.model.layers:
        layer.mlp.capacity_factor = 100.0
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "op")])
def test_checkpointed_layers_give_the_same_gradients(mode, option):
    """The router statistics are a side output of a layer: under activation checkpointing (full, or
    selective per op) the aux loss's gradient still reaches the router through the recomputed layer."""
    hf = hf_model("qwen3_moe")
    a, b = ours_from(hf).train(), ours_from(hf).train()
    b.gradient_checkpointing_enable(mode, option)
    ids = torch.randint(0, 128, (2, 16))
    for m in (a, b):
        m(ids, labels=shifted(ids)).backward()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_config_refusals():
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4)
    with pytest.raises(ValueError, match="num_experts_per_tok=5.*between 1 and the number of experts 4"):
        LlamaConfig.from_dict({**base, "model_type": "mixtral", "num_local_experts": 4,
                               "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="sliding_window=4096.*router_jitter_noise=0.1"):
        LlamaConfig.from_dict({**base, "model_type": "mixtral", "num_local_experts": 4,
                               "sliding_window": 4096, "router_jitter_noise": 0.1})
    cfg = LlamaConfig.from_dict({**base, "model_type": "qwen3_moe", "num_experts": 8,
                                 "moe_intermediate_size": 16})
    assert (cfg.num_local_experts, cfg.norm_topk_prob, cfg.moe_intermediate_size) == (8, False, 16)
    assert cfg.to_hf_dict()["num_experts"] == 8 and "moe_capacity_factor" not in cfg.to_hf_dict()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_hub_checkpoint_read_and_written_back(tmp_path, family):
    """A Hub directory (per-expert tensors, sharded with an index) loads with equal logits, and
    save_pretrained writes the Hub's names back: transformers loads it with equal logits."""
    hf = hf_model(family)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        torch.testing.assert_close(ours(ids), ref, atol=1e-5, rtol=1e-5)
    ours.save_pretrained(str(tmp_path / "ours"))
    hf.save_pretrained(tmp_path / "one")                    # the same tensors in one file
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "one" / "model.safetensors"), "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
    cls = type(hf)
    back = cls.from_pretrained(str(tmp_path / "ours")).float().eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-5)


def test_an_expert_slice_reads_only_its_experts(tmp_path):
    hf = hf_model("mixtral")
    hf.save_pretrained(tmp_path / "hf")
    ckpt = HFCheckpoint(str(tmp_path / "hf"))
    name = "model.layers.1.mlp.experts.down_proj"
    full = to_minipar(hf.state_dict())[name]                 # (E=4, d, F)
    whole = ckpt.source(ProcessGroupManager.local().tp)
    torch.testing.assert_close(whole.tp_local(name, tuple(full.shape), None), full)
    reader = ckpt.source(ProcessGroupManager.local().tp)
    got = reader.tp_local(name, tuple(full.shape), None, experts=(2, 2))
    torch.testing.assert_close(got, full[2:4])
    assert reader.bytes_read == full[2:4].numel() * 4       # two experts' tensors, nothing else
    with pytest.raises(ValueError, match="tensors this model does not have"):
        hf.config.num_local_experts = 3                      # config and weights disagree
        HFCheckpoint.check(ckpt, LlamaForCausalLM(LlamaConfig.from_dict(hf.config.to_dict()),
                                                  device="meta"))


def test_bf16_autocast_runs_close_to_fp32():
    """Under bf16 autocast the experts return bf16 into the fp32 residual stream (the trainer's
    bf16 without ZeRO-3): the un-permute casts, and the loss stays near fp32's."""
    hf = hf_model("mixtral")
    ours = ours_from(hf)
    ids = torch.randint(0, 128, (2, 16))
    ref = ours(ids, labels=shifted(ids))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ours(ids, labels=shifted(ids))
    got.backward()
    assert abs(got.item() - ref.item()) < 2e-2 * abs(ref.item())
    assert ours.model.layers[0].mlp.gate.weight.grad is not None
