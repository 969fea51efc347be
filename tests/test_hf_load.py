"""base_model: a real (small) Hugging Face checkpoint, built on the meta device and loaded slice by slice.

The checkpoints are made by transformers itself (random weights, save_pretrained in two safetensors
shards), so the reader is checked against the independent reference: the first-step loss equals
transformers' loss on the same batch, every layout loads exactly the same full weights, trains as
one process does, and the export reloads in transformers with the same logits.
"""
import json
import os
import shutil
import tempfile

import pytest
import torch
import transformers
from harness import run_world
from safetensors.torch import load_file

import minipar
from minipar import ParallelismConfig
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.hf_checkpoint import HFCheckpoint
from models.llama import LlamaForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
VARIANTS = {
    "untied": dict(),
    "tied-llama3": dict(tie_word_embeddings=True, rope_scaling=LLAMA3, rope_theta=500000.0),
    "bias-bf16": dict(attention_bias=True, mlp_bias=True, dtype=torch.bfloat16),
}


def make_checkpoint(directory, dtype=torch.float32, seed=0, **overrides):
    """transformers.LlamaForCausalLM with random weights (norms and biases too), in two shards."""
    torch.manual_seed(seed)
    shape = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg = transformers.LlamaConfig(**{**shape, **overrides})
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf = hf.to(dtype)
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    hf.save_pretrained(str(directory), max_shard_size=int(total * 0.6))
    if cfg.vocab_size == 384:                # base_model is also the tokenizer (tokenizer_config's default)
        _tiny_tokenizer(str(directory))
    shards = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    assert len(shards) == 2 and os.path.exists(os.path.join(directory, "model.safetensors.index.json")), \
        shards
    return str(directory)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One checkpoint per variant for the whole module (tests that edit one copy it first)."""
    made = {}

    def get(variant):
        if variant not in made:
            made[variant] = make_checkpoint(tmp_path_factory.mktemp(variant), **VARIANTS[variant])
        return made[variant]
    return get


def hf_state(directory):
    """The checkpoint's full tensors as stored (fp32), the ground truth of every layout."""
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update({k: v.float() for k, v in load_file(os.path.join(directory, f)).items()})
    return out


TINY = ["--datasets", "[]", "--sample_packing", "false", "--val_set_size", "0",    # the byte-corpus path
        "--sequence_len", "32", "--global_batch_size", "8", "--warmup_steps", "2", "--learning_rate", "0.001",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--eval_steps", "0", "--logging_steps", "100", "--progress_bar", "false", "--save_steps", "0",
        "--save_final_checkpoint", "false"]


def _corpus():
    """The first 40 kB of the plays: enough rows for these runs, quick to tokenize on every rank."""
    path = os.path.join(tempfile.gettempdir(), f"minipar-hf-load-corpus-{os.getuid()}.txt")
    if not os.path.exists(path):
        text = open(os.path.join(ROOT, "data", "shakespeare.txt"), encoding="utf-8").read()[:40_000]
        with open(path + f".{os.getpid()}", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(path + f".{os.getpid()}", path)
    return path


def _argv(base, out, steps, *extra, dp=1, cp=1, tp=1):
    return [os.path.join(ROOT, "configs", "finetune.yaml"), "--base_model", base, "--output_dir", str(out),
            "--max_steps", str(steps), "--export_hf", "false", *TINY, "--dataset", _corpus(),
            "--dp_shard_size", str(dp),
            "--context_parallel_size", str(cp), "--tensor_parallel_size", str(tp), *extra]


# ------------------------------------------------------------------ one process against transformers
def _first_step_and_hf_loss(argv):
    torch.set_num_threads(1)
    run = setup_run(argv)
    trainer = Trainer(run)
    ids, labels = trainer.sampler.global_batch(run.train_tokens, 0)
    hf = transformers.LlamaForCausalLM.from_pretrained(run.cfg.base_model, dtype=torch.float32).eval()
    with torch.no_grad():     # our labels arrive shifted (label[t] = token t + 1): a plain mean CE
        logits = hf(input_ids=ids).logits
        ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), labels.flatten(),
                                                ignore_index=-100)
    return trainer.train_step(0)["loss"], ref.item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_first_step_loss_equals_transformers(tmp_path, checkpoints, variant):
    base = checkpoints(variant)
    got, ref = run_world(_first_step_and_hf_loss, 1, _argv(base, tmp_path / "out", 1), timeout=120)[0]
    assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)


def test_llama3_rope_scaling_changes_the_model(checkpoints):
    """The llama3 variant really exercises the scaling: without it the logits differ."""
    base = checkpoints("tied-llama3")
    scaled = LlamaForCausalLM.from_pretrained(base).eval()
    plain = LlamaForCausalLM.from_pretrained(base).eval()
    plain.config.rope_scaling = None
    ids = torch.randint(0, 256, (1, 64))
    with torch.no_grad():
        assert (scaled(ids) - plain(ids)).abs().max() > 1e-3


# ------------------------------------------------------------------ many ranks against one
def _load_on_layout(base, sizes, world):
    """Build on meta, fill under ZeRO-3 from the files, gather the full weights back."""
    from minipar.zero3 import fully_shard
    torch.set_num_threads(1)
    pgm = minipar.init(ParallelismConfig(**sizes).resolve(world))
    ckpt = HFCheckpoint(base)
    model = LlamaForCausalLM(ckpt.config, pgm, device="meta")
    ckpt.check(model)
    source = ckpt.source(pgm.tp)
    if pgm.config.dp_shard_size > 1:
        fully_shard(model, pgm, init=source)
    else:
        from models.llama_init import materialize
        materialize(model, source)
    return model.full_state_dict(), source.bytes_read


@pytest.mark.parametrize("variant", ["untied", "tied-llama3"])
def test_sharded_load_equals_the_files(checkpoints, variant):
    base = checkpoints(variant)
    want = hf_state(base)
    if VARIANTS[variant].get("tie_word_embeddings"):
        want.pop("lm_head.weight", None)
    total = sum(t.numel() * 4 for t in want.values())
    results = run_world(_load_on_layout, 4, base, dict(dp_shard_size=2, tp_size=2), 4, timeout=120)
    for full, bytes_read in results:
        assert sorted(full) == sorted(want)
        for name, t in want.items():
            assert torch.equal(full[name], t), name
        # each rank read its TP slice of the tensors that overlap its shard, never the whole model
        assert bytes_read < 0.6 * total, (bytes_read, total)


def _train(argv):
    torch.set_num_threads(1)
    return [(r["loss"], r["grad_norm"]) for r in Trainer(setup_run(argv)).train()]


def _same_curve(ref, got, rel=1e-4):
    # the gradient norm too: AdamW's update does not change with the gradient's scale, so a loss
    # curve alone would not see a gradient scaled by a wrong factor
    assert len(ref) == len(got) and got
    for step, ((a, ga), (b, gb)) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= rel * abs(a), f"step {step}: loss {b} vs one process {a}"
        assert abs(ga - gb) <= rel * abs(ga), f"step {step}: grad_norm {gb} vs one process {ga}"


def test_dp_shard2_tp2_trains_like_one_process(tmp_path, checkpoints):
    base = checkpoints("tied-llama3")
    ref = run_world(_train, 1, _argv(base, tmp_path / "one", 3), timeout=200)[0]
    got = run_world(_train, 4, _argv(base, tmp_path / "four", 3, dp=2, tp=2), timeout=300)
    for losses in got:
        _same_curve(ref, losses)


@pytest.mark.slow
def test_dp_shard2_cp2_tp2_trains_like_one_process(tmp_path, checkpoints):
    base = checkpoints("bias-bf16")
    sizes = dict(dp_shard_size=2, cp_size=2, tp_size=2)
    full = run_world(_load_on_layout, 8, base, sizes, 8, timeout=300)[0][0]
    want = hf_state(base)
    assert all(torch.equal(full[n], want[n]) for n in want)
    ref = run_world(_train, 1, _argv(base, tmp_path / "one", 20), timeout=600)[0]
    got = run_world(_train, 8, _argv(base, tmp_path / "eight", 20, dp=2, cp=2, tp=2), timeout=900)
    for losses in got:
        _same_curve(ref, losses)
    assert ref[-1][0] < ref[0][0]


# ---------------------------------------------------------- end to end: checkpoint + chat data + packing
@pytest.fixture(scope="module")
def chat_example(tmp_path_factory):
    """example_data's BPE tokenizer (2048 tokens, a chat template) and chat rows, beside a
    transformers-made checkpoint of that vocabulary (two shards, tied, llama3 RoPE)."""
    from minipar.trainer.data.example_data import make_example
    d = tmp_path_factory.mktemp("chat")
    paths = make_example(str(d), num_conversations=120, vocab_size=2048, tokenizer_chars=60_000)
    base = make_checkpoint(d / "model", **dict(VARIANTS["tied-llama3"], vocab_size=2048))
    for f in os.listdir(paths["tokenizer"]):          # the model's own tokenizer, as on the Hub
        shutil.copyfile(os.path.join(paths["tokenizer"], f), os.path.join(base, f))
    return dict(paths, base=base)


def _chat_argv(ex, out, steps, **layout):
    argv = _argv(ex["base"], out, steps, **layout)
    for key, value in (("--datasets", f"[{{path: {ex['chat']}, type: chat_template}}]"),
                       ("--sample_packing", "true"), ("--val_set_size", "0.1"), ("--sequence_len", "64"),
                       ("--eval_steps", str(steps))):
        argv[argv.index(key) + 1] = value
    return argv + ["--eval_batches", "1"]


def _packed_finetune(ex, tmp_path, steps, world, **layout):
    ref = run_world(_train, 1, _chat_argv(ex, tmp_path / "one", steps), timeout=300)[0]
    got = run_world(_train, world, _chat_argv(ex, tmp_path / "par", steps, **layout), timeout=900)
    for losses in got:
        _same_curve(ref, losses)
    return ref


def test_packed_chat_finetune_cp2_tp2_like_one_process(tmp_path, chat_example):
    _packed_finetune(chat_example, tmp_path, 3, 4, cp=2, tp=2)


@pytest.mark.slow
def test_packed_chat_finetune_8_ranks_like_one_process(tmp_path, chat_example):
    ref = _packed_finetune(chat_example, tmp_path, 20, 8, dp=2, cp=2, tp=2)
    assert ref[-1][0] < ref[0][0], "and it learns"


# ------------------------------------------------------------------ export
def _train_and_export(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    trainer.train()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    with torch.no_grad():
        return trainer.model(ids)


def test_export_reloads_in_transformers_with_the_tokenizer(tmp_path, checkpoints):
    base = checkpoints("tied-llama3")
    tok = transformers.AutoTokenizer.from_pretrained(base)
    out = tmp_path / "out"
    argv = _argv(base, out, 2, dp=2)
    argv[argv.index("--export_hf") + 1] = "true"
    logits = run_world(_train_and_export, 2, argv, timeout=200)[0]
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, logits, atol=1e-5, rtol=1e-5)
    again = transformers.AutoTokenizer.from_pretrained(str(out / "hf"))
    assert again("to be or not")["input_ids"] == tok("to be or not")["input_ids"]


def _tiny_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.train_from_iterator(["to be or not to be, that is the question"] * 4,
                          trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>")
    fast.save_pretrained(directory)
    return fast


# ------------------------------------------------------------------ refusals, before any collective
def _edit_config(base, **changes):
    path = os.path.join(base, "config.json")
    d = json.load(open(path))
    d.update(changes)
    json.dump(d, open(path, "w"))


@pytest.mark.parametrize("case,match", [
    ("architecture", "loads only LlamaForCausalLM"),
    ("rope", "rope_type 'yarn' is not supported"),
    ("shape", "config.json implies"),
    ("missing", "lacks 1 tensors"),
    ("extra", "does not have"),
    ("model-key", "fixes the model shape"),
    ("no-weights", "neither model.safetensors"),
])
def test_refuses_before_any_collective(tmp_path, checkpoints, case, match):
    base = str(tmp_path / "base")
    shutil.copytree(checkpoints("untied"), base)
    argv = _argv(base, tmp_path / "out", 1)
    index_path = os.path.join(base, "model.safetensors.index.json")
    index = json.load(open(index_path))
    if case == "architecture":
        _edit_config(base, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")   # (Mistral loads)
    elif case == "rope":
        _edit_config(base, rope_scaling=dict(rope_type="yarn", factor=4.0), rope_parameters=None)
    elif case == "shape":
        _edit_config(base, intermediate_size=96)
    elif case == "missing":
        index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
        _drop_tensor(base, index, "model.layers.1.mlp.up_proj.weight")
    elif case == "extra":
        _edit_config(base, num_hidden_layers=1)
    elif case == "model-key":
        argv += ["--model.hidden_size", "128"]
    elif case == "no-weights":
        for f in os.listdir(base):
            if "safetensors" in f:
                os.remove(os.path.join(base, f))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        setup_run(argv)
    assert not torch.distributed.is_initialized()


def _drop_tensor(base, index, name):
    from safetensors.torch import save_file
    path = os.path.join(base, next(f for f in os.listdir(base) if f.endswith("00002-of-00002.safetensors")))
    tensors = load_file(path)
    if name not in tensors:
        path = os.path.join(base, next(f for f in os.listdir(base)
                                       if f.endswith("00001-of-00002.safetensors")))
        tensors = load_file(path)
    tensors.pop(name)
    save_file(tensors, path, metadata={"format": "pt"})
    json.dump(index, open(os.path.join(base, "model.safetensors.index.json"), "w"))


def test_meta_model_holds_no_storage():
    base_cfg = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                    num_attention_heads=32)
    from models.llama_config import LlamaConfig
    model = LlamaForCausalLM(LlamaConfig(**base_cfg), device="meta")     # Llama-2-7B's shapes, instantly
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 6e9
