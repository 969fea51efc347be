"""Gemma 2 and Gemma 3 (text) configs: read with transformers' defaults (a config.json that leaves a
key out, transformers 4's and 5's RoPE keys), refused by name where minipar cannot build them,
a fused attention kernel refused for capped logits, the families' decoder-layer classes accepted
in transformer_layer_cls_to_wrap, and the planner's parameter count equal to the model's. The
model itself against transformers: tests/test_gemma.py.
"""
import contextlib
import io
import json
import re

import pytest
from harness import run_world

from minipar import ParallelismConfig
from minipar.plan.__main__ import main as plan_main
from minipar.plan.inputs import ModelShape
from minipar.trainer.config.train_config import load_config
from models.hf_config import FAMILIES
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)


def test_configs_take_transformers_defaults_and_both_rope_forms():
    g2 = LlamaConfig.from_dict(dict(BASE, model_type="gemma2"))          # every Gemma key left out
    assert (g2.head_dim, g2.query_pre_attn_scalar, g2.sliding_window) == (256, 256, 4096)
    assert (g2.final_logit_softcapping, g2.attn_logit_softcapping) == (30.0, 50.0)
    assert g2.tie_word_embeddings and g2.rms_norm_eps == 1e-6
    assert g2.layer_types == ["sliding_attention", "full_attention"] * 2 and g2.attention_softcap == 50.0
    g3 = LlamaConfig.from_dict(dict(BASE, model_type="gemma3_text", num_hidden_layers=7))
    assert g3.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (g3.rope_theta, g3.rope_local_base_freq, g3.attention_softcap) == (1e6, 1e4, None)
    # transformers 4's keys (Gemma 3 4B's config.json) and transformers 5's rope_parameters read the same
    v4 = LlamaConfig.from_dict(dict(BASE, model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4,
                                    rope_scaling={"rope_type": "linear", "factor": 8.0},
                                    sliding_window_pattern=2))
    v5 = LlamaConfig.from_dict(dict(BASE, model_type="gemma3_text", layer_types=v4.layer_types,
                                    rope_parameters={"full_attention": dict(v4.rope_scaling, rope_theta=1e6),
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 1e4}}))
    assert v4 == v5 and v4.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert [v4.rope_table(i) for i in range(4)] == [1, 0, 1, 0] and v4.rope_theta_of(0) == 1e4
    assert LlamaConfig.from_dict(v5.to_hf_dict()) == v5                # the export reads back the same


@pytest.mark.parametrize("extra,message", [
    (dict(model_type="gemma2", use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    (dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(model_type="gemma3_text", rope_parameters={"full_attention": {"rope_type": "default"},
                                                     "sliding_attention": {"rope_type": "yarn"}}),
     "rope_type 'yarn' on the local"),
    (dict(model_type="gemma2", attention_dropout=0.1), "attention_dropout=0.1"),
    (dict(model_type="llama", final_logit_softcapping=30.0), "are Gemma's keys"),
    (dict(model_type="gemma2", layer_types=["full_attention"]), "one of"),
    (dict(model_type="gemma2", attn_logit_softcapping=-1.0), "must be a number > 0, or null"),
])
def test_configs_refused_with_the_fix(extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LlamaConfig.from_dict(dict(BASE, **extra))


def test_a_forced_fused_kernel_cannot_cap_attention():
    g2 = LlamaConfig.from_dict(dict(BASE, model_type="gemma2", head_dim=16))
    for backend in ("flash", "efficient", "cudnn"):
        with pytest.raises(ValueError, match=f"attention_backend {backend} cannot soft-cap attention logits"):
            ParallelismConfig(attention_backend=backend).resolve(1).validate_model(g2)
    ParallelismConfig(attention_backend="math").resolve(1).validate_model(g2)
    g3 = LlamaConfig.from_dict(dict(BASE, model_type="gemma3_text", head_dim=16))
    ParallelismConfig(attention_backend="flash").resolve(1).validate_model(g3)    # no cap: any kernel


@pytest.mark.parametrize("kind,layer,ok", [("gemma2", "Gemma2DecoderLayer", True),
                                           ("gemma3_text", "Gemma3DecoderLayer", True),
                                           ("gemma3_text", "LlamaDecoderLayer", True),
                                           ("gemma3_text", "Gemma2DecoderLayer", False)])
def test_transformer_layer_cls_to_wrap_names_the_family(tmp_path, kind, layer, ok):
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  model_type: {kind}\n  head_dim: 32\nfsdp_config:\n"
                    f"  transformer_layer_cls_to_wrap: {layer}\n")
    if ok:
        assert load_config(str(path)).fsdp.wrap == [layer]
    else:
        with pytest.raises(ValueError, match=r"only \[Gemma3DecoderLayer, LlamaDecoderLayer\] units"):
            load_config(str(path))


def _parameters(d):
    return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig.from_dict(d), device="meta").parameters())


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_the_planner_counts_the_parameters_and_plans(tmp_path, kind):
    d = dict(BASE, model_type=kind, head_dim=16)
    shape = ModelShape.from_dict(d)
    assert shape.sandwich_norms and shape.tie_word_embeddings and shape.qk_norm == (kind == "gemma3_text")
    assert shape.capped_attention == (kind == "gemma2")
    assert shape.num_params() == run_world(_parameters, 1, d, timeout=60)[0]
    (tmp_path / "config.json").write_text(json.dumps(dict(d, architectures=[FAMILIES[kind]])))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        plan_main(["--model", str(tmp_path), "--world", "2", "--seq-len", "64", "--tp", "2"])
    assert "estimated step" in out.getvalue()
