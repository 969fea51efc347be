"""Issue 41 item 1, the tokenizer keys: special_tokens / tokens added and the base's embedding resized
as transformers' resize_token_embeddings does, on any layout; the export and the LoRA adapter
directory reloaded by transformers and PEFT with the new tokens; chat_template by name rendering each
family's published markup (hand-written expected strings); model_type / tokenizer_type checked
against the checkpoint. Tiny models and tokenizers built here, nothing downloaded."""
import json
import os

import pytest
import torch
import transformers
from harness import run_world
from safetensors.torch import load_file
from test_hf_load import TINY, _corpus, _tiny_tokenizer, make_checkpoint

from minipar.trainer.config.train_config import load_config
from minipar.trainer.data.chat_format import chat_example
from minipar.trainer.data.chat_template_table import TEMPLATES
from minipar.trainer.data.chat_templates import resolve
from minipar.trainer.data.example_data import make_tokenizer
from minipar.trainer.data.prepared import tokenizer_inputs
from minipar.trainer.data.special_tokens import embeddings_len, run_tokenizer
from minipar.trainer.data.tokenizer import load_tokenizer
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPECIAL = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
ADDED = ["<|im_start|>"]
SYS, USER, BOT = "Be brief.", "Who art thou?", "A king."
CHAT3 = [dict(role="system", content=SYS), dict(role="user", content=USER),
         dict(role="assistant", content=BOT)]
CHAT2 = CHAT3[1:]


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    """example_data's BPE (bos <s>, eos </s>) on the first plays' lines: a few seconds."""
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(d / "tokenizer"), vocab_size=300, max_chars=20_000)
    return str(d / "tokenizer")


def _build_base(directory, tied):
    """A transformers Llama whose vocabulary is exactly its tokenizer's (so added tokens resize it)."""
    n = len(_tiny_tokenizer(str(directory)))
    make_checkpoint(directory, vocab_size=n, tie_word_embeddings=tied)
    return n


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    made = {}
    for tied in (False, True):
        d = tmp_path_factory.mktemp("tied" if tied else "untied")
        made[tied] = (str(d), run_world(_build_base, 1, d, tied, timeout=60)[0])
    return made


# ------------------------------------------------------------------ chat templates by name
EXPECTED = {   # each family's published turn markup, written by hand (bos <s>, eos </s>)
    "chatml": (CHAT3, f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n"
                      f"<|im_start|>assistant\n{BOT}<|im_end|>\n"),
    "qwen_25": (CHAT2, "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                       f"assistant.<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n<|im_start|>assistant\n"
                       f"{BOT}<|im_end|>\n"),
    "llama3": (CHAT3, f"<s><|start_header_id|>system<|end_header_id|>\n\n{SYS}<|eot_id|><|start_header_id|>"
                      f"user<|end_header_id|>\n\n{USER}<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
                      f"\n\n{BOT}<|eot_id|>"),
    "mistral_v1": (CHAT3, f"<s> [INST] {SYS}\n\n{USER} [/INST] {BOT}</s>"),
    "mistral_v2v3": (CHAT2, f"<s>[INST] {USER}[/INST] {BOT}</s>"),
    "mistral_v3_tekken": (CHAT2, f"<s>[INST]{USER}[/INST]{BOT}</s>"),
    "gemma": (CHAT2, f"<s><start_of_turn>user\n{USER}<end_of_turn>\n<start_of_turn>model\n{BOT}"
                     f"<end_of_turn>\n"),
    "gemma3": (CHAT3, f"<s><start_of_turn>user\n{SYS}\n\n{USER}<end_of_turn>\n<start_of_turn>model\n{BOT}"
                      f"<end_of_turn>\n"),
    # Axolotl's phi_3 / phi_35 (no closing eos) and phi_4 (Phi-4-reasoning's; chat_templates.py)
    "phi_3": (CHAT3, f"<s><|system|>\n{SYS}<|end|>\n<|user|>\n{USER}<|end|>\n<|assistant|>\n{BOT}<|end|>\n"),
    "phi_35": (CHAT2, f"<|user|>\n{USER}<|end|>\n<|assistant|>\n{BOT}<|end|>\n"),
    "phi_4": (CHAT3, f"<|im_start|>system<|im_sep|>{SYS}<|im_end|><|im_start|>user<|im_sep|>{USER}<|im_end|>"
                     f"<|im_start|>assistant<|im_sep|>{BOT}<|im_end|>"),
    "alpaca": (CHAT3, f"<s>{SYS}\n\n### Instruction:\n{USER}\n\n### Response:\n{BOT}</s>"),
}
PROMPTS = {"chatml": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
           "gemma": "<start_of_turn>model\n", "phi_3": "<|assistant|>\n",
           "phi_4": "<|im_start|>assistant<|im_sep|>"}


def test_named_templates_render_each_familys_markup(chat_tok):
    tok = load_tokenizer(chat_tok)
    assert set(EXPECTED) <= set(TEMPLATES)         # every name: tests/test_chat_templates.py
    for name, (chat, want) in EXPECTED.items():
        assert tok.render_chat(chat, TEMPLATES[name]) == want, name
        # masking locates every turn (a system turn inside the next one)
        ids, labels = chat_example(chat, tok, False, name, template=TEMPLATES[name])
        trained = tok.decode([ids[t + 1] for t, x in enumerate(labels) if x != -100])
        assert trained.startswith(BOT), (name, trained)
    for name, prompt in PROMPTS.items():          # the generation prompt after a user turn
        text = tok.tok.apply_chat_template(CHAT2[:1], chat_template=TEMPLATES[name], tokenize=False,
                                           add_generation_prompt=True)
        assert text.endswith(prompt), (name, text)
    for name in ("mistral_v2v3", "gemma"):        # no system turn: refused, naming the row and the fix
        with pytest.raises(ValueError, match=f"row 7: the chat template refuses.*{name} has no system turn"):
            chat_example(CHAT3, tok, False, "row 7", template=TEMPLATES[name])


def test_template_choices_resolve_as_axolotl(tmp_path, chat_tok):
    own = load_tokenizer(chat_tok).chat_template
    assert resolve("tokenizer_default", None, own, "x") == own
    assert resolve("tokenizer_default_fallback_chatml", None, own, "x") == own
    assert resolve("tokenizer_default_fallback_chatml", None, None, "x") == TEMPLATES["chatml"]
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve("jinja", str(tmp_path / "t.jinja"), own, "x").startswith("{% for m")
    with pytest.raises(ValueError, match="tokenizer has no chat template; name one"):
        resolve("tokenizer_default", None, None, "x")
    # the run's template becomes the tokenizer's (saved with it), and the prepared data's key changes
    tok = run_tokenizer(dict(tokenizer_config=chat_tok, chat_template="llama3"))
    assert tok.chat_template == TEMPLATES["llama3"]
    assert tokenizer_inputs(tok) != tokenizer_inputs(load_tokenizer(chat_tok))


def test_named_template_trains_the_assistant_turns_with_the_added_eos(chat_tok):
    """chatml on a tokenizer that lacks its tokens, as Axolotl's ChatML examples write it: the eos
    <|im_end|> after each assistant content is trained, the headers never."""
    tok = run_tokenizer(dict(tokenizer_config=chat_tok, special_tokens=SPECIAL, tokens=ADDED,
                             chat_template="chatml"))
    assert tok.eos_token == "<|im_end|>" and tok.vocab_size == 300 + 2
    ids, labels = chat_example(CHAT3, tok, False, "row")
    assert ids.count(tok.eos_token_id) == 3 and ids.count(tok.tok.convert_tokens_to_ids("<|im_start|>")) == 3
    trained = [ids[t + 1] for t, x in enumerate(labels) if x != -100]
    assert trained == tok.encode(BOT) + [tok.eos_token_id]


# ------------------------------------------------------------------ the embedding resized
def _setup(base, out, *extra, dp=1, tp=1, lora=False):
    argv = [os.path.join(ROOT, "configs", "finetune.yaml"), "--base_model", base, "--output_dir", str(out),
            "--max_steps", "1", *TINY, "--dataset", _corpus(), "--dp_shard_size", str(dp),
            "--tensor_parallel_size", str(tp), "--context_parallel_size", "1",
            "--special_tokens", "{eos_token: '<|im_end|>', pad_token: '<pad>'}",
            "--tokens", "['<|im_start|>']", *extra]
    if lora:
        argv += ["--adapter", "lora", "--lora_r", "4", "--lora_alpha", "8",
                 "--lora_target_modules", "[q_proj]"]
    return argv


def _vocab_rows(argv):
    """The run's full embedding and lm_head after loading, and its first step's loss."""
    torch.set_num_threads(1)
    run = setup_run(argv)
    trainer = Trainer(run)
    full = trainer.model.full_state_dict()
    rows = {k: full[k].float().cpu() for k in ("model.embed_tokens.weight", "lm_head.weight") if k in full}
    return dict(rows=rows, loss=float(trainer.train_step(0)["loss"]), notes=run.notes,
                eos=run.cfg.model.eos_token_id, pad=run.cfg.model.pad_token_id)


def _transformers_resized(base, mean):
    """transformers' own: the checkpoint, the tokenizer with the same tokens, resize_token_embeddings."""
    hf = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(base)
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(ADDED)
    hf.resize_token_embeddings(len(tok), mean_resizing=mean)
    return dict(rows={"model.embed_tokens.weight": hf.model.embed_tokens.weight.detach().clone(),
                      "lm_head.weight": hf.lm_head.weight.detach().clone()},
                eos=tok.eos_token_id, pad=tok.pad_token_id)


@pytest.mark.parametrize("mean", [True, False])
def test_added_tokens_resize_the_embedding_as_transformers(tmp_path, bases, mean):
    base, n = bases[False]
    extra = ["--mean_resizing_embeddings", str(mean).lower()]
    one = run_world(_vocab_rows, 1, _setup(base, tmp_path / "one", *extra), timeout=120)[0]
    assert any(f"vocabulary {n} -> {n + 3}" in x for x in one["notes"]), one["notes"]
    # transformers on the same checkpoint and tokenizer: the old rows kept, the new ones its mean
    # (sampled there with 1e-9 of the rows' covariance: the mean up to ~3e-5 of their spread)
    hf = run_world(_transformers_resized, 1, base, mean, timeout=60)[0]
    assert (one["eos"], one["pad"]) == (hf["eos"], hf["pad"])
    for key, theirs in hf["rows"].items():
        ours = one["rows"][key]
        assert ours.shape == theirs.shape == (n + 3, 64)
        torch.testing.assert_close(ours[:n], theirs[:n], rtol=0, atol=0)
        if mean:
            assert torch.equal(ours[n:], ours[:n].mean(0, keepdim=True).expand(3, -1))
            torch.testing.assert_close(ours[n:], theirs[n:], rtol=0, atol=1e-4)
        else:                                      # N(0, initializer_range), as transformers' init
            assert abs(ours[n:].std().item() - 0.02) < 0.005 and not torch.equal(ours[n], ours[n + 1])
    if mean:                                       # every layout loads the same rows: ZeRO-3 x tp 2
        got = run_world(_vocab_rows, 4, _setup(base, tmp_path / "par", *extra,
                                               "--resize_token_embeddings_to_32x", "true", dp=2, tp=2),
                        timeout=120)
        for g in got:
            for key, rows in g["rows"].items():
                assert rows.shape == (-(-(n + 3) // 32) * 32, 64)
                torch.testing.assert_close(rows[: n + 3], one["rows"][key], rtol=0, atol=0)


def test_tp_needs_a_vocabulary_it_divides(tmp_path, bases, monkeypatch):
    base, n = bases[True]
    extra = [] if (n + 3) % 2 else ["--tokens", "['<|im_start|>', '<x>']"]   # an odd vocabulary
    monkeypatch.setenv("WORLD_SIZE", "2")         # refused before any group exists, on every rank
    with pytest.raises(ValueError, match="does not divide by tp_size 2.*resize_token_embeddings_to_32x: "):
        setup_run(_setup(base, tmp_path / "tp", *extra, tp=2))
    assert embeddings_len(302, 384) is None and embeddings_len(385, 384, to_32x=True) == 416
    assert embeddings_len(300, 384, shrink=True) == 300


def _finish(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    trainer.train()
    trainer.model.eval()
    ids = torch.tensor([[1, 2, trainer.run.tokenizer.eos_token_id, trainer.run.cfg.model.vocab_size - 1]])
    with torch.no_grad():
        return trainer.model(ids), ids


def _reload(directory, ids, adapter):
    """What transformers (or PEFT, for an adapter directory) loads from `directory`."""
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    if adapter:
        import peft
        model = peft.AutoPeftModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return dict(logits=logits, tokens=len(tok), eos=tok.eos_token, tokenizer_eos_id=tok.eos_token_id,
                start=tok.convert_tokens_to_ids("<|im_start|>"), vocab_size=model.config.vocab_size,
                eos_id=model.config.eos_token_id)


def _from_checkpoint(step_dir, hf_dir, ids):
    from minipar.trainer.checkpoint.export import export_checkpoint
    from minipar.trainer.load_model import load_model
    torch.set_num_threads(1)
    export_checkpoint(step_dir, hf_dir)
    model, tok = load_model(step_dir)
    with torch.no_grad():
        return dict(loaded=model(ids), tokens=tok.vocab_size)


def test_export_reloads_in_transformers_with_the_added_tokens(tmp_path, bases):
    base, n = bases[True]
    out = tmp_path / "full"
    logits, ids = run_world(_finish, 1, _setup(base, out, "--export_hf", "true", "--mean_resizing_embeddings",
                                               "true"), timeout=120)[0]
    hf = run_world(_reload, 1, str(out / "hf"), ids, False, timeout=60)[0]
    assert hf["tokens"] == n + 3 and hf["eos"] == "<|im_end|>" and hf["start"] == n + 2
    assert hf["vocab_size"] == n + 3 and hf["eos_id"] == hf["tokenizer_eos_id"]
    torch.testing.assert_close(hf["logits"], logits, rtol=1e-5, atol=1e-5)


def _lora_run(base, out, *extra):
    argv = _setup(base, out, "--export_hf", "true", *extra, lora=True)
    return run_world(_finish, 1, argv + ["--special_tokens", "{pad_token: '<pad>'}"], timeout=120)[0]


def test_lora_adapter_reloads_in_peft_with_the_added_tokens(tmp_path, bases):
    """The adapter directory holds the tokenizer and the resized embedding under PEFT's names; PEFT
    resizes the base to the saved tokenizer and loads them: the run's logits."""
    base, n = bases[True]
    out = tmp_path / "lora"
    logits, ids = _lora_run(base, out)
    keys = load_file(str(out / "adapter_model.safetensors"))
    assert keys["base_model.model.model.embed_tokens.weight"].shape == (n + 2, 64)
    peft_model = run_world(_reload, 1, str(out), ids, True, timeout=60)[0]
    assert peft_model["tokens"] == n + 2
    torch.testing.assert_close(peft_model["logits"], logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_lora_checkpoint_exports_onto_the_resized_base(tmp_path, bases):
    """A LoRA checkpoint holds the adapters only: the export merges them onto the base resized as the
    run's, and load_model rebuilds the same model and the run's tokenizer."""
    base, n = bases[True]
    out = tmp_path / "lora"
    logits, ids = _lora_run(base, out, "--save_final_checkpoint", "true")
    merged = run_world(_from_checkpoint, 1, str(out / "step-1"), str(tmp_path / "merged"), ids, timeout=60)[0]
    torch.testing.assert_close(merged["loaded"], logits, rtol=1e-5, atol=1e-5)
    assert merged["tokens"] == n + 2
    again = run_world(_reload, 1, str(tmp_path / "merged"), ids, False, timeout=60)[0]
    assert again["tokens"] == n + 2 and again["vocab_size"] == n + 2
    torch.testing.assert_close(again["logits"], logits, rtol=1e-5, atol=1e-5)


def test_lora_refuses_a_new_eos_as_axolotl(tmp_path, bases):
    base, _ = bases[True]
    with pytest.raises(ValueError, match="eos_token: <\\|im_end\\|>: new tokens under adapter: lora"):
        setup_run(_setup(base, tmp_path / "x", lora=True))


# ------------------------------------------------------------------ model_type / tokenizer_type
def test_model_and_tokenizer_types_checked_against_the_checkpoint(tmp_path, bases):
    base, _ = bases[False]
    with open(os.path.join(base, "tokenizer_config.json")) as f:
        declared = json.load(f).get("tokenizer_class")

    def load(text):
        (tmp_path / "c.yaml").write_text(f"base_model: {base}\nmax_steps: 1\n" + text)
        return load_config(str(tmp_path / "c.yaml"), [], notes=[])
    for model_type in ("AutoModelForCausalLM", "LlamaForCausalLM"):
        for tokenizer_type in ("AutoTokenizer", "LlamaTokenizer", "LlamaTokenizerFast", declared):
            load(f"model_type: {model_type}\ntokenizer_type: {tokenizer_type}\n")
    with pytest.raises(ValueError) as info:
        load("model_type: MistralForCausalLM\ntokenizer_type: Qwen2TokenizerFast\nchat_template: vicuna\n")
    msg = str(info.value)
    assert msg.startswith("3 config values are wrong"), msg
    assert f"model_type: MistralForCausalLM does not match base_model '{base}' (config.json: " \
           f"LlamaForCausalLM, model_type 'llama')" in msg
    assert "write model_type: AutoModelForCausalLM or LlamaForCausalLM" in msg
    assert "tokenizer_type: Qwen2TokenizerFast does not match the tokenizer of" in msg
    assert "chat_template: vicuna is not available here" in msg


# ------------------------------------------------------------------ per entry, overrides, a 2-step run
def test_a_datasets_entry_names_its_own_template(tmp_path, chat_tok):
    from minipar.trainer.data.datasets import check_entries, load_examples
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(dict(messages=CHAT3)) + "\n")
    tok = run_tokenizer(dict(tokenizer_config=chat_tok, special_tokens=SPECIAL, tokens=ADDED))
    entries = check_entries([dict(path=str(path), type="chat_template", chat_template="chatml"),
                             dict(path=str(path), type="chat_template")])
    ex = load_examples(entries, tok, 256)
    assert tok.decode(ex.example(0)[0].tolist()) == tok.render_chat(CHAT3, TEMPLATES["chatml"])
    assert tok.decode(ex.example(1)[0].tolist()).startswith("<s><|system|>\n")    # the tokenizer's own
    with pytest.raises(ValueError, match=r"datasets\[0\] .*chat_template: vicuna is not available here"):
        check_entries([dict(path=str(path), type="chat_template", chat_template="vicuna")])


def test_added_tokens_overrides_rename_without_new_rows(tmp_path, chat_tok):
    tok = run_tokenizer(dict(tokenizer_config=chat_tok, added_tokens_overrides={3: "<|im_start|>",
                                                                               "4": "<|im_end|>"}))
    assert tok.vocab_size == 300 and tok.encode("<|im_start|>x<|im_end|>")[::2] == [3, 4]
    assert tok.tok.convert_ids_to_tokens([3, 4, 5]) == ["<|im_start|>", "<|im_end|>", "<|assistant|>"]
    tok.save_pretrained(str(tmp_path / "saved"))             # what an export writes reloads the same
    again = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
    assert again.convert_tokens_to_ids("<|im_start|>") == 3 and len(again) == 300
    with pytest.raises(ValueError, match=r"ids \[299\] are no added tokens"):
        run_tokenizer(dict(tokenizer_config=chat_tok, added_tokens_overrides={299: "<x>"}))


AXOLOTL = """base_model: {base}
model_type: LlamaForCausalLM
tokenizer_type: AutoTokenizer
special_tokens:
  eos_token: "<|im_end|>"
  pad_token: "<pad>"
tokens: ["<|im_start|>"]
chat_template: chatml
datasets:
  - path: {rows}
    type: chat_template
sequence_len: 64
sample_packing: true
micro_batch_size: 2
gradient_accumulation_steps: 1
max_steps: 2
learning_rate: 1.0e-3
logging_steps: 1
eval_steps: 0
save_steps: 0
save_final_checkpoint: false
progress_bar: false
output_dir: {out}
"""


def _history(argv):
    torch.set_num_threads(1)
    return [r["loss"] for r in Trainer(setup_run(argv)).train()]


def test_an_axolotl_chatml_file_trains_two_steps(tmp_path, bases):
    base, n = bases[True]
    rows = tmp_path / "chat.jsonl"
    rows.write_text("".join(json.dumps(dict(messages=[dict(role="user", content=f"Who art thou, {i}?"),
                                                      dict(role="assistant", content=f"King {i}.")])) + "\n"
                            for i in range(8)))
    config = tmp_path / "axolotl.yaml"
    config.write_text(AXOLOTL.format(base=base, rows=rows, out=tmp_path / "out"))
    losses = run_world(_history, 1, [str(config)], timeout=120)[0]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    saved = json.load(open(tmp_path / "out" / "hf" / "tokenizer_config.json"))
    template = saved.get("chat_template") or open(tmp_path / "out" / "hf" / "chat_template.jinja").read()
    assert template == TEMPLATES["chatml"] and saved["eos_token"] == "<|im_end|>"
    assert json.load(open(tmp_path / "out" / "hf" / "config.json"))["vocab_size"] == n + 3
