"""LoRA as Axolotl users run it: a real Hugging Face checkpoint (base_model), packed chat data, on a
sharded layout like one process; the run leaves PEFT's adapter directory, which
peft.PeftModel.from_pretrained loads with minipar's logits, and (merge_lora) a merged directory
transformers loads alone, as does the export command on its checkpoint; lora_model_dir starts a run
from that adapter."""
import json
import os
import shutil

import pytest
import torch
import transformers
from harness import run_world
from safetensors.torch import load_file
from test_hf_load import VARIANTS, _argv, make_checkpoint

from minipar.lora import full_adapters, minipar_name
from minipar.trainer.checkpoint.export import main as export_main
from minipar.trainer.config.train_config import load_config
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = ["--adapter", "lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_linear", "false",
        "--lora_target_modules", "[q_proj, v_proj, o_proj, down_proj]", "--learning_rate", "1e-2",
        "--merge_lora", "false"]


@pytest.fixture(scope="module")
def chat_base(tmp_path_factory):
    """A transformers-made checkpoint (tied, llama3 RoPE) with example_data's chat tokenizer and rows."""
    from minipar.trainer.data.example_data import make_example
    d = tmp_path_factory.mktemp("lora-chat")
    paths = make_example(str(d), num_conversations=60, vocab_size=2048, tokenizer_chars=30_000)
    base = make_checkpoint(d / "model", **dict(VARIANTS["tied-llama3"], vocab_size=2048))
    for f in os.listdir(paths["tokenizer"]):
        shutil.copyfile(os.path.join(paths["tokenizer"], f), os.path.join(base, f))
    return dict(paths, base=base)


def _chat_argv(ex, out, steps, *extra, **layout):
    argv = _argv(ex["base"], out, steps, **layout)
    argv[0] = os.path.join(ROOT, "configs", "lora.yaml")      # its keys, on the tiny checkpoint
    for key, value in (("--datasets", f"[{{path: {ex['chat']}, type: chat_template}}]"),
                       ("--sample_packing", "true"), ("--sequence_len", "64"), ("--export_hf", "true")):
        argv[argv.index(key) + 1] = value
    return argv + LORA + list(extra)


IDS = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))


def _run(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    history = trainer.train()
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(IDS)
    return dict(curve=[(r["loss"], r["grad_norm"]) for r in history], logits=logits)


def test_lora_chat_finetune_on_hf_checkpoint_exports_peft_and_merged(tmp_path, chat_base):
    import peft
    ref = run_world(_run, 1, _chat_argv(chat_base, tmp_path / "one", 3), timeout=300)[0]
    out = tmp_path / "par"
    got = run_world(_run, 4, _chat_argv(chat_base, out, 3, "--merge_lora", "true", "--save_steps", "2",
                                        "--save_final_checkpoint", "true", dp=2, tp=2), timeout=300)
    for g in got:
        for (a, ga), (b, gb) in zip(ref["curve"], g["curve"]):
            assert abs(a - b) <= 1e-4 * abs(a) and abs(ga - gb) <= 1e-4 * abs(ga) + 1e-7
    assert ref["curve"][-1][1] > 0
    for g in got[1:]:                          # every rank ends with the model PEFT loads below
        torch.testing.assert_close(g["logits"], got[0]["logits"], atol=0, rtol=0)
    logits = got[0]["logits"]
    # PEFT's adapter directory in output_dir, loaded by PEFT around the transformers base
    config = json.load(open(out / "adapter_config.json"))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == sorted(["q_proj", "v_proj", "o_proj", "down_proj"])
    keys = load_file(str(out / "adapter_model.safetensors"))
    assert len(keys) == 2 * 4 * 2 and all(k.startswith("base_model.model.model.layers.") for k in keys)
    hf = transformers.LlamaForCausalLM.from_pretrained(chat_base["base"], dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = hf(input_ids=IDS).logits
        assert (base_logits - logits).abs().max() > 1e-3          # the adapters changed the model
        adapted = peft.PeftModel.from_pretrained(hf, str(out)).eval()
        torch.testing.assert_close(adapted(input_ids=IDS).logits, logits, atol=1e-5, rtol=1e-5)
        merged = transformers.LlamaForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32)
        merged.eval()
        torch.testing.assert_close(merged(input_ids=IDS).logits, logits, atol=1e-5, rtol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(str(out / "merged")) is not None
    assert transformers.AutoTokenizer.from_pretrained(str(out)) is not None   # the adapter's directory too
    # the checkpoint holds the adapters and their AdamW states only; the export command merges it
    manifest = json.load(open(out / "step-2" / "manifest.json"))
    assert manifest["params"] and all(".lora.lora_" in n for n in manifest["params"])
    export_main([str(out / "step-3"), str(tmp_path / "exported")])
    exported = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "exported"), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(exported.eval()(input_ids=IDS).logits, logits, atol=1e-5, rtol=1e-5)


def _loaded(argv):
    trainer = Trainer(setup_run(argv))
    return full_adapters(trainer.model, trainer.pgm)


def test_lora_model_dir_starts_from_a_peft_adapter_and_refuses_a_wrong_one(tmp_path, chat_base):
    import peft
    hf = transformers.LlamaForCausalLM.from_pretrained(chat_base["base"], dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = peft.get_peft_model(hf, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    model.save_pretrained(str(tmp_path / "peft"))       # PEFT's own directory
    argv = _chat_argv(chat_base, tmp_path / "run", 1, "--lora_model_dir", str(tmp_path / "peft"))
    saved = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    want = {minipar_name(k): v for k, v in saved.items()}
    for got in run_world(_loaded, 2, argv + ["--tensor_parallel_size", "2"], timeout=200):   # each tp rank
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n].float()) for n in want)
    with pytest.raises(ValueError, match=r"does not fit this model: its r is 4, this run's lora_r 8"):
        load_config(None, argv[1:] + ["--lora_r", "8"])
    with pytest.raises(ValueError, match=r"4 adapters of this run are missing"):
        load_config(None, argv[1:] + ["--lora_target_modules", "[q_proj, v_proj, o_proj, down_proj, up_proj]"
                                      ])

