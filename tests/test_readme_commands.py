"""The README's commands work as written after `make install`, without activating .venv.

A bare `python train.py` runs the system's python, which has no torch: every command of the
README's code blocks must start with `.venv/bin/` (python, torchrun) or be a `make` target, and so
must the commands quoted inline in its prose. Then, in process and without training:

    train.py ARGS (also under torchrun)   its config file exists and the project's own parser
                                          (train_config.load_config) accepts every --key
    -m module / a script                  the module or script exists, as does every file named
    make TARGET                           the Makefile has it

(tests/test_docs.py also runs run_setup on each train command, and checks the options of the
others' argparse.) A few cheap ones really run, as written, with `--max_steps 2 --output_dir TMP`
appended where the command trains; the torchrun and make runs are marked slow. The last line a
failing rank prints is its one-line reason (what a torchrun user reads above torchrun's report).
"""
import os
import re
import shlex
import subprocess

import pytest

from tests.test_docs import _code_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
VENV = os.path.join(ROOT, ".venv", "bin")
PROGRAM = re.compile(r"^(?:\S*/)?(?:python3?|torchrun|make)(?: |$)")
# a command quoted in prose: a program and what it runs (not `torchrun --max-restarts`, an option named)
INLINE = re.compile(r"`((?:\S*/)?(?:python3?|torchrun) [^`]*(?:-m \w|\.py)[^`]*)`")


def _block_lines(text):
    """Lines of the README's code blocks (test_docs' reading of them), comments cut."""
    return [cut for cut in (line.split("  #")[0].strip() for line in _code_lines(text)) if cut]


def _commands():
    return [line for line in _block_lines(open(README).read()) if PROGRAM.match(line)]


def _split(line):
    """(program, the train.py/-m/script arguments after it, torchrun's process count)."""
    argv = shlex.split(line)
    prog, rest, world = os.path.basename(argv[0]), argv[1:], 1
    if prog == "torchrun":
        while rest and rest[0].startswith("--"):
            opt, _, value = rest[0].partition("=")
            if opt in ("--nproc-per-node", "--nproc_per_node"):
                world = int(value or rest[1])
            rest = rest[1:] if value else rest[2:]
    return prog, rest, world


def test_every_readme_command_runs_from_the_venv():
    bare = [c for c in _commands() if not (c.startswith(".venv/bin/") or c.startswith("make "))]
    bare += [c for c in INLINE.findall(open(README).read()) if not c.startswith(".venv/bin/")]
    assert not bare, "commands that need an activated venv (write .venv/bin/...):\n" + "\n".join(bare)


def test_make_train_with_args_is_documented():
    assert any(c.startswith('make train ARGS="--max_steps') for c in _commands()), _commands()


@pytest.mark.parametrize("line", _commands())
def test_readme_command_refers_to_what_exists(line):
    from minipar.trainer.config.train_config import load_config
    prog, args, _ = _split(line)
    if prog == "make":
        targets = set(re.findall(r"^([\w-]+):", open(os.path.join(ROOT, "Makefile")).read(), re.M))
        assert {a for a in args if "=" not in a} <= targets, line
        return
    assert os.path.isfile(os.path.join(ROOT, ".venv", "bin", prog)) or not os.path.isdir(VENV), line
    if args[0] == "-m":
        base = os.path.join(ROOT, *args[1].split("."))
        assert os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__main__.py")), line
        args = args[2:]
    else:
        assert os.path.isfile(os.path.join(ROOT, args[0])), line
        script, args = args[0], args[1:]
        if script == "train.py":                 # the config file and every --key, by train.py's parser
            config = os.path.join(ROOT, args[0]) if args and not args[0].startswith("--") else None
            try:
                load_config(config, args[1:] if config else args)
            except (FileNotFoundError, ValueError) as err:   # files an earlier command writes under out/
                # (several missing files come as one ValueError listing each: check.py collects them)
                written = set(re.findall(r"out/\w+", str(err)))
                earlier = _commands()[:_commands().index(line)]
                assert "not found" in str(err) and written, (line, err)
                assert all(any(w in c for c in earlier) for w in written), (line, err)
    named = [a for a in args if re.search(r"\.(ya?ml|json|py)$", a) and not a.startswith("out/")]
    assert all(os.path.isfile(os.path.join(ROOT, a)) for a in named), (line, named)


# ------------------------------------------------------------------------------ real runs
needs_venv = pytest.mark.skipif(not os.path.isdir(VENV), reason="no .venv (make install)")


def _run(line, timeout=120, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)         # buffered, as a log file gets it: the order must hold
    out = subprocess.run(line, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, f"{line}: exit {out.returncode}\n{out.stdout[-3000:]}"
    return out


def _the(prefix):
    found = [c for c in _commands() + INLINE.findall(open(README).read()) if c.startswith(prefix)]
    assert found, f"the README no longer shows {prefix!r}"
    return found[0]


@needs_venv
def test_mesh_runs_as_written():
    assert "tp groups" in _run(_the(".venv/bin/python -m minipar.mesh"), timeout=60).stdout


@needs_venv
@pytest.mark.slow
def test_the_configuration_example_trains_and_plan_runs(tmp_path):
    """The Configuration section's train.py command, capped at 2 steps (about 10 s: the export, the
    loss-curve PNG); its export loads as a tokenizer. And the planner's first command."""
    assert _run(_the(".venv/bin/python -m minipar.plan configs/4d.yaml"), timeout=120).stdout.strip()
    line = _the(".venv/bin/python train.py configs/default.yaml")
    out = _run(f"{line} --max_steps 2 --progress_bar false --output_dir {tmp_path}")
    assert "done: 2 steps" in out.stdout, out.stdout[-2000:]
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert tok("to be")["input_ids"] == list(b"to be")


@needs_venv
def test_a_refused_run_prints_its_reason_last(tmp_path):
    """exit 2, and the `[rank R] error: ...` line is the last thing the rank writes (the README
    points torchrun users at it, above torchrun's own report)."""
    out = _run(f".venv/bin/python train.py --max_steps 1 --learning_rate -1 --output_dir {tmp_path}",
               check=False)
    assert out.returncode == 2, out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("[rank 0] error: "), out.stdout[-2000:]
    text = open(README).read()
    for said in ("ChildFailedError", "[rank R] error: ...", "Root Cause", "exitcode"):
        assert said in text, f"the README does not tell a torchrun user about {said!r}"


@needs_venv
@pytest.mark.slow
def test_make_train_and_torchrun_run_as_written(tmp_path):
    make = _the('make train ARGS="')
    if subprocess.run(["make", "-q", ".venv/.installed"], cwd=ROOT).returncode != 0:
        pytest.skip("setup.cfg changed since `make install`: make train would reinstall .venv first")
    head, args = make.split('ARGS="', 1)
    _run(f'{head}ARGS="{args[:-1]} --max_steps 2 --progress_bar false --output_dir {tmp_path / "make"}"',
         timeout=300)
    line = _the(".venv/bin/torchrun --nproc-per-node 4 train.py configs/fsdp.yaml")
    _run(f"{line} --max_steps 2 --progress_bar false --output_dir {tmp_path / 'fsdp'}", timeout=300)
    # a rank's reason is its last line after the groups exist too; torchrun itself exits 1
    empty = tmp_path / "empty"
    empty.mkdir()
    out = _run(f".venv/bin/torchrun --nproc-per-node 2 train.py --tensor_parallel_size 2 --max_steps 1 "
               f"--resume_from_checkpoint {empty} --output_dir {tmp_path / 'bad'}", timeout=300, check=False)
    assert out.returncode == 1 and "exitcode  : 2" in out.stdout, out.stdout[-3000:]
    lines = out.stdout.splitlines()
    last = max(i for i, text in enumerate(lines) if text.startswith("[rank "))
    assert all(not text.startswith(("[rank", "model:", "grid")) for text in lines[last + 1:])
