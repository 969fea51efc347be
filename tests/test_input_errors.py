"""Bad input is one line naming the file or value and the fix, exit 2, before anything is written.

Issue 19, items 1 (config part), 3, 4 and 7 (CLI part): negative save_total_limit; every value check
before step 1, all wrong values in one error, and no output_dir, lock file or metrics.jsonl left
behind; YAML with a tab or a syntax error (train.py and the planner); an invalid config.json, a
truncated .safetensors in base_model; a dataset path that is a directory or an empty file;
`python -m minipar.mesh --tp 0`, `minipar.plan --world -4 / 0` and a gpt2 config.json.

Most checks call setup_run / load_config / the tools' main(argv) in this process (fast); four
programs run whole (their __main__ blocks, forked: tests/harness.py run_program) for the end-to-end
promise: exit 2, one line on stderr, no traceback.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from harness import run_program

from minipar.mesh import main as mesh_main
from minipar.plan.__main__ import main as plan_main
from minipar.trainer.config.train_config import load_config
from minipar.trainer.run_setup import setup_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
LLAMA_8B = os.path.join(ROOT, "configs", "models", "llama-3.1-8b.json")
TINY = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "32",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--global_batch_size", "4", "--max_steps", "2", "--progress_bar", "false", "--export_hf", "false"]
# configs/finetune.yaml on the byte corpus: base_model fixes the model, no `model` section
FINETUNE = [os.path.join(ROOT, "configs", "finetune.yaml"), "--datasets", "[]", "--sample_packing", "false",
            "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
            "--val_set_size", "0", "--max_steps", "2", "--progress_bar", "false"]
SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _refused(argv, out):
    """setup_run's error text for argv (with --output_dir out); asserts nothing was written."""
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        setup_run([*argv, "--output_dir", str(out)])
    assert not os.path.exists(out), f"a refused run wrote {sorted(os.listdir(out))}"
    assert not torch.distributed.is_initialized()
    return str(info.value)


def _run(args, out=None):
    """`python *args` (train.py or -m a tool) with its __main__ in a forked child (tests/harness.py
    run_program: the program's own exit status and stderr, without a fresh interpreter's imports):
    (exit status, stderr); asserts one line, no traceback, output_dir untouched."""
    before = sorted(os.listdir(out)) if out is not None else None
    module = args[0] == "-m"
    program, argv = (args[1], args[2:]) if module else (args[0], args[1:])
    proc = run_program(program, argv, module=module, cwd=ROOT, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    err = proc.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    if out is not None:
        assert sorted(os.listdir(out)) == before, "output_dir changed"
    return proc.returncode, err


def _base_model(directory):
    """A Hugging Face directory (config.json + model.safetensors) of a tiny Llama, no transformers."""
    from safetensors.torch import save_file

    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    cfg = LlamaConfig(**SHAPE)
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=1)
    model = LlamaForCausalLM(cfg, None, device="meta")
    save_file({n: torch.zeros(p.tp_full_shape) for n, p in model.named_parameters()},
              os.path.join(directory, "model.safetensors"))
    return str(directory)


# ------------------------------------------------------------------ item 1 and 4: every value, at once, early
def test_negative_save_total_limit_and_every_wrong_value_in_one_error(tmp_path):
    msg = _refused(["--save_total_limit", "-1"], tmp_path / "out")
    assert "save_total_limit must be >= 0" in msg and "0 or null: keep every checkpoint" in msg, msg
    assert load_config(None, ["--save_total_limit", "0"]).save_total_limit == 0      # keep all, as before
    assert load_config(None, ["--save_total_limit", "null"]).save_total_limit is None
    wrong = dict(learning_rate="-1", weight_decay="-0.1", warmup_steps="-1", min_lr_ratio="2",
                 max_grad_norm="-1", save_total_limit="-3")
    msg = _refused([a for k, v in wrong.items() for a in (f"--{k}", v)], tmp_path / "out")
    assert msg.startswith(f"{len(wrong)} config values are wrong: "), msg
    for key in wrong:
        assert f"; {key} must" in msg or f": {key} must" in msg, (key, msg)
    assert ("save_total_limit must be >= 0 (0 or null: keep every checkpoint; N: keep the newest N), "
            "got -3") in msg


@pytest.mark.parametrize("key,value", [("learning_rate", "0"), ("weight_decay", "-1"), ("warmup_steps", "-5"),
                                       ("min_lr_ratio", "-0.5"), ("max_grad_norm", "-1")])
def test_optimizer_values_are_refused_before_the_lock_and_step_one(tmp_path, key, value):
    out = tmp_path / "out"
    msg = _refused([*TINY, f"--{key}", value], out)       # was: a lock (or an empty metrics.jsonl) left
    assert msg.startswith(f"{key} must ") and f"got {value}" in msg, msg


def test_train_py_value_errors_leave_output_dir_as_it_was(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, err = _run(["train.py", *TINY, "--output_dir", str(out), "--max_grad_norm", "-1",
                      "--learning_rate", "-1"], out)
    assert code == 2 and err.startswith("[rank 0] error: 2 config values are wrong: "), err
    assert "learning_rate must be > 0, got -1.0" in err and "max_grad_norm must be >= 0" in err, err
    assert not (out / "minipar.lock").exists() and not (out / "metrics.jsonl").exists()


# ------------------------------------------------------------------ item 4: data paths say what they are
def test_dataset_directory_and_empty_files_say_what_they_are(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    msg = _refused([*TINY, "--dataset", str(folder)], tmp_path / "out")
    assert f"dataset file '{folder}' is a directory, not a file; set `dataset` to a text file" in msg, msg
    entry = "[{path: %s, type: completion}]"
    msg = _refused([*TINY, "--datasets", entry % folder], tmp_path / "out")
    assert f"datasets: file '{folder}' is a directory" in msg and ".jsonl" in msg, msg
    for name, text, what in [("empty.jsonl", "", "empty (0 bytes)"),
                             ("blank.jsonl", "\n \n", "empty (blank lines only)")]:
        path = tmp_path / name
        path.write_text(text)
        msg = _refused([*TINY, "--datasets", entry % path], tmp_path / "out")
        assert f"datasets: file '{path}' is {what}" in msg and "trained label" not in msg, msg
    # two wrong paths and a wrong value: one error naming all three
    msg = _refused([*TINY, "--dataset", str(folder), "--datasets", entry % (tmp_path / "empty.jsonl"),
                    "--learning_rate", "-1"], tmp_path / "out")
    assert msg.startswith("3 config values are wrong") and "is a directory" in msg and "is empty" in msg, msg


# ------------------------------------------------------------ item 3: YAML and JSON errors name the place
def test_yaml_with_a_tab_or_a_syntax_error_names_file_line_column(tmp_path, capsys):
    tab, broken = tmp_path / "tab.yaml", tmp_path / "broken.yaml"
    tab.write_text("max_steps: 3\n\tlearning_rate: 1e-3\n")
    broken.write_text("max_steps: 3\ndatasets: [a, b\n")
    for path, where in [(tab, "line 2, column 1"), (broken, "line 3, column 1")]:
        with pytest.raises(ValueError) as info:
            load_config(str(path))
        assert str(info.value).startswith(f"{path}, {where}: not valid YAML"), info.value
        assert plan_main([str(path)]) == 2                  # the planner reads the same config
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {path}, {where}: not valid YAML") and "\n" not in err, err
    with pytest.raises(ValueError, match="replace it with spaces"):
        load_config(str(tab))
    with pytest.raises(ValueError, match=r"--max_steps '\[3': not a YAML value"):
        load_config(None, ["--max_steps", "[3"])


def test_invalid_config_json_and_truncated_safetensors_in_base_model(tmp_path):
    base = _base_model(tmp_path / "base")
    config = os.path.join(base, "config.json")
    good = open(config).read()
    with open(config, "w") as f:
        f.write("{\n,\n")
    msg = _refused([*FINETUNE, "--base_model", base], tmp_path / "out")
    assert msg.startswith(f"{config}, line 2, column 1: not valid JSON") and "re-download" in msg, msg
    with open(config, "w") as f:
        f.write(good)
    weights = os.path.join(base, "model.safetensors")
    data = open(weights, "rb").read()
    with open(weights, "wb") as f:
        f.write(data[:len(data) // 2])                     # a download cut off half-way
    msg = _refused([*FINETUNE, "--base_model", base], tmp_path / "out")
    assert f"{weights} is truncated or damaged" in msg and "re-download" in msg and "re-export" in msg, msg
    # end to end: train.py prints that one line and exits 2
    out = tmp_path / "out"
    out.mkdir()
    code, err = _run(["train.py", *FINETUNE, "--base_model", base, "--output_dir", str(out)], out)
    assert code == 2 and err.startswith("[rank 0] error: base_model") and weights in err, err


# ------------------------------------------------------------------ item 7: the command-line tools
def test_planner_refuses_bad_world_and_non_llama_configs(tmp_path, capsys):
    for world in ("-4", "0"):
        assert plan_main(["--model", LLAMA_8B, "--world", world]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --world must be a positive integer (the number of GPUs), got {world}", err
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps(dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=768,
                                    n_layer=12, n_head=12, vocab_size=50257, hidden_size=768,
                                    num_attention_heads=12,
                                    num_hidden_layers=12, intermediate_size=3072)))
    assert plan_main(["--model", str(gpt2), "--world", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model_type 'gpt2'" in err and "LlamaForCausalLM" in err and str(gpt2) in err, err
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 64,\n')
    assert plan_main(["--model", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {bad}, line 2, column 1: not valid JSON") and "\n" not in err, err
    code, err = _run(["-m", "minipar.plan", "--model", LLAMA_8B, "--world", "-4"])
    assert code == 2 and "--world must be a positive integer" in err, err


def test_planner_reads_memory_units_and_refuses_bad_rates(capsys):
    def budget(memory):
        assert plan_main(["--model", LLAMA_8B, "--world", "8", "--gpu-memory", memory, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["memory"]["budget"]
    reserve = 0.1                                   # the planner's default share kept free
    assert budget("80") == budget("80GiB") == pytest.approx(80 * 2 ** 30 * (1 - reserve))
    assert budget("80GB") == pytest.approx(80e9 * (1 - reserve))
    assert budget("81920MiB") == budget("80GiB")
    for memory in ("abc", "80 parsecs", "0GB"):
        assert plan_main(["--model", LLAMA_8B, "--gpu-memory", memory]) == 2
        err = capsys.readouterr().err.strip()
        assert "--gpu-memory must be" in err and repr(memory) in err, err
    assert plan_main(["--model", LLAMA_8B, "--world", "0", "--efficiency", "1.5", "--reserve", "1",
                      "--gpu-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    for part in ("--world must be a positive integer", "--efficiency must be in (0, 1]", "got 1.5",
                 "--reserve must be in [0, 1)", "--gpu-memory must be a memory size"):
        assert part in err, (part, err)
    assert "\n" not in err


def test_mesh_refuses_a_zero_size_in_one_line(capsys):
    assert mesh_main(["--tp", "0", "--cp", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--tp must be a positive integer" in err and "--cp must be a positive integer" in err, err
    assert "\n" not in err
    code, err = _run(["-m", "minipar.mesh", "--tp", "0"])
    assert code == 2 and err == "error: --tp must be a positive integer (tensor-parallel ranks), got 0", err


# ------------------------------------------------------------------ item 4: the lock goes with the process
RAISE_AFTER_LOCK = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("run_lock", sys.argv[2])   # the file alone: no torch import
run_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
run_lock.acquire(sys.argv[1], 0)
if os.fork() == 0:
    sys.exit(0)                 # a forked child exits normally: it must not release its parent's lock
os.wait()
assert os.path.exists(os.path.join(sys.argv[1], "minipar.lock")), "a forked child released the lock"
raise ValueError("refused after the lock was taken (e.g. while the trainer is built)")
"""


def test_an_error_after_the_lock_releases_it(tmp_path):
    from minipar.trainer import run_lock
    out = tmp_path / "out"
    proc = subprocess.run([PY, "-c", RAISE_AFTER_LOCK, str(out), run_lock.__file__], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and "refused after the lock" in proc.stderr, proc.stderr
    assert not (out / "minipar.lock").exists(), "a refused run left output_dir/minipar.lock behind"
