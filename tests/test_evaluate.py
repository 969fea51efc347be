"""Evaluation (minipar/post/scoring.py, python -m minipar.evaluate): minipar's per-example
log-probabilities equal transformers' on the same weights for every example (1e-5), on one process
and on parallel layouts (they run the training composition's forward); lm-evaluation-harness's
request split; acc and acc_norm; perplexity; the command on an HF directory."""
import contextlib
import io
import json
import math
import os

import pytest
import torch
import transformers
from harness import run_world

import minipar
from minipar.api import prepare
from minipar.evaluate import main
from minipar.post.scoring import Scorer, multiple_choice, perplexity, split_request
from minipar.trainer.data.batches import ByteTokenizer
from minipar.trainer.data.tokenizer import save_byte_tokenizer
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

HF_CLASSES = (transformers.LlamaForCausalLM, transformers.Qwen3MoeForCausalLM)   # imported before any fork

ROWS = [dict(context="The cat sat on the", choices=[" mat", " moon", " hat"], gold=0),
        dict(context="2 + 2 =", choices=[" 4", " five"], gold=0),
        dict(context="Paris is in ", choices=["France", "Spain", "Peru", "Italy"], gold=2),
        dict(context="x", choices=["yz", "y"], gold=1),
        dict(context="Hello, ", choices=["world", "there"], gold=1)]


def hf_model(family):
    torch.manual_seed(0)
    shape = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, intermediate_size=48)).eval()
    cfg = transformers.Qwen3MoeConfig(**shape, head_dim=16, intermediate_size=48, moe_intermediate_size=24,
                                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def hf_logprobs(hf, requests):
    out = []
    with torch.no_grad():
        for ctx, cont in requests:
            ids = torch.tensor([ctx + cont])
            logp = torch.log_softmax(hf(input_ids=ids).logits[0].double(), -1)
            pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
            out.append(float(logp[pos, torch.tensor(cont)].sum()))
    return out


def _score(tmp, family, sizes):
    pgm = minipar.init(minipar.ParallelismConfig(**sizes))
    d = os.path.join(tmp, family)
    if pgm.global_rank == 0:
        hf_model(family).save_pretrained(d)
    torch.distributed.barrier()
    pm, _, step = prepare(d, pgm)
    tok = ByteTokenizer()
    requests = [split_request(tok, r["context"], c) for r in ROWS for c in r["choices"]]
    got = Scorer(pm, step.step).logprobs(requests)
    mc = multiple_choice(Scorer(pm, step.step), tok, ROWS)
    ppl = perplexity(Scorer(pm, step.step), [list(b"some text to score here, a few windows long")], 8)
    ref = hf_logprobs(transformers.AutoModelForCausalLM.from_pretrained(d).float().eval(), requests) \
        if pgm.global_rank == 0 else None
    return got, ref, mc, ppl


def _check(results):
    got, ref, mc, ppl = results[0]
    assert len(got) == len(ref) == sum(len(r["choices"]) for r in ROWS)
    for g, r in zip(got, ref):
        assert abs(g - r) < 1e-5, (g, r)
    for other in results[1:]:
        assert other[0] == pytest.approx(got, abs=1e-5)
    flat = [lp for row in mc["logprobs"] for lp in row]
    assert flat == pytest.approx(ref, abs=1e-5)
    best = sum(max(range(len(s)), key=s.__getitem__) == r["gold"] for s, r in zip(mc["logprobs"], ROWS))
    norm = sum(max(range(len(s)), key=lambda i: s[i] / len(r["choices"][i])) == r["gold"]
               for s, r in zip(mc["logprobs"], ROWS))
    assert mc["acc"] == best / len(ROWS) and mc["acc_norm"] == norm / len(ROWS)
    assert ppl["tokens"] == len(b"some text to score here, a few windows long") - 1 and ppl["perplexity"] > 1


def test_loglikelihoods_equal_transformers_one_process(tmp_path):
    _check(run_world(_score, 1, str(tmp_path), "llama", {}, timeout=120))


def test_loglikelihoods_equal_transformers_dp_shard2(tmp_path):
    _check(run_world(_score, 2, str(tmp_path), "llama", dict(dp_shard_size=2), timeout=120))


@pytest.mark.slow
@pytest.mark.parametrize("family,sizes", [("llama", dict(tp_size=2, sequence_parallel=True)),
                                          ("llama", dict(cp_size=2)), ("llama", dict(pp_size=2)),
                                          ("qwen3_moe", dict(ep_size=2))],
                         ids=["tp2_sp", "cp2", "pp2", "moe_ep2"])
def test_loglikelihoods_equal_transformers_on_layouts(tmp_path, family, sizes):
    _check(run_world(_score, 2, str(tmp_path), family, sizes, timeout=300))


def test_split_request_moves_trailing_spaces_as_lm_eval():
    tok = ByteTokenizer()
    assert split_request(tok, "Q: hi ", "there") == (list(b"Q: hi"), list(b" there"))
    with pytest.raises(ValueError, match="empty context"):
        split_request(tok, "", "x")


def _cli(tmp):
    d = os.path.join(tmp, "hf")
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2), seed=2).save_pretrained(d)
    save_byte_tokenizer(d)
    with open(os.path.join(tmp, "mc.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in ROWS)
    with open(os.path.join(tmp, "t.txt"), "w") as f:
        f.write("a small text file to score")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main([d, "--text", os.path.join(tmp, "t.txt"), "--choices", os.path.join(tmp, "mc.jsonl"),
                     "--seq-len", "8", "--output", os.path.join(tmp, "out.json")])
    return code, buf.getvalue()


def test_the_command_scores_an_hf_directory(tmp_path):
    code, out = run_world(_cli, 1, str(tmp_path), timeout=120)[0]
    result = json.loads(out.splitlines()[-1])        # (the attention kernel note comes first)
    assert code == 0 and result["examples"] == len(ROWS)
    assert result["tokens"] == len("a small text file to score") - 1
    assert len(json.load(open(tmp_path / "out.json"))["logprobs"]) == len(ROWS)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(out, *extra, prompts=True):
    argv = [os.path.join(ROOT, "configs", "fsdp.yaml"), "--model.hidden_size", "32",
            "--model.intermediate_size", "64", "--model.num_hidden_layers", "2",
            "--model.num_attention_heads", "4",
            "--model.num_key_value_heads", "2", "--sequence_len", "32", "--global_batch_size", "4",
            "--max_steps", "2", "--warmup_steps", "1", "--eval_steps", "2", "--eval_batches", "1",
            "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
            "--progress_bar", "false", "--save_final_checkpoint", "false", "--export_hf", "false",
            "--dataset", os.path.join(ROOT, "data", "shakespeare.txt"), "--output_dir", out,
            *(["--eval_prompts", '["ROMEO:", "To be"]'] if prompts else []), *extra]
    logs = []
    trainer = Trainer(setup_run(argv))
    trainer.log = logs.append
    trainer.loop.log = logs.append
    trainer.train()
    return logs


def test_a_run_logs_perplexity_and_generations(tmp_path):
    run_world(_run, 1, str(tmp_path / "one"), "--use_tensorboard", "true", timeout=120)
    rows = [json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl")]
    last = rows[-1]
    assert last["val_perplexity"] == pytest.approx(math.exp(last["val_loss"]))
    assert [g["prompt"] for g in last["eval_generations"]] == ["ROMEO:", "To be"]
    assert all(isinstance(g["completion"], str) for g in last["eval_generations"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # optional package
    events = EventAccumulator(str(tmp_path / "one" / "runs"))
    events.Reload()
    assert "eval/perplexity" in events.Tags()["scalars"]


def _rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_a_sharded_run_generates_and_trains_as_without(tmp_path):
    """ZeRO-3 over dp_shard 2: generations at each eval, and the training around them unchanged:
    the same losses, step for step, as the run without eval_prompts (no gradient, ZeRO-3's learned
    prefetch orders and its gathered units as they were)."""
    three = ("--dp_shard_size", "2", "--max_steps", "3", "--eval_steps", "1")
    logs = run_world(_run, 2, str(tmp_path / "gen"), *three, timeout=120)[0]
    run_world(_run, 2, str(tmp_path / "plain"), *three, prompts=False, timeout=120)
    gen, plain = _rows(tmp_path / "gen"), _rows(tmp_path / "plain")
    assert not any("no generations" in line for line in logs)
    assert all([g["prompt"] for g in r["eval_generations"]] == ["ROMEO:", "To be"] for r in gen)
    assert [r["loss"] for r in gen] == [r["loss"] for r in plain] and len(gen) == 3
    assert [r["val_loss"] for r in gen] == [r["val_loss"] for r in plain]


def test_a_pipelined_run_notes_why_it_has_no_generations(tmp_path):
    logs = run_world(_run, 2, str(tmp_path / "pp"), "--pp_size", "2", "--dp_shard_size", "1",
                    "--micro_batch_size", "2", timeout=120)[0]
    assert any("eval_prompts: no generations" in line and "pp_size 2" in line for line in logs)
    rows = _rows(tmp_path / "pp")
    assert "val_perplexity" in rows[-1] and "eval_generations" not in rows[-1]
