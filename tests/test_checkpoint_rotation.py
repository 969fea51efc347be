"""Rotation and failed saves (issue 19, items 1 to 3): save_total_limit never deletes the newest
good checkpoint nor the one just saved, whatever its value; a damaged checkpoint is moved aside
(step-N.corrupt) and said so instead of being kept over a good one, at rotation and when
`resume_from_checkpoint: latest` skips it; a full disk during a save is one line that names the
checkpoint being written and the one left intact, on every rank, and train.py exits 1 with it.

The saves are of a tiny decoder on one process (tens of milliseconds each); the runs through the
Trainer and train.py are forked worlds (tests/harness.py), so no process group outlives a test."""
import errno
import os
import runpy
import sys

import pytest
import torch
import torch._dynamo  # noqa: F401 - here once, not in every forked run (the optimizer imports it: 1 s)
from harness import run_world

import minipar
from minipar import ParallelismConfig
from minipar import optim as moptim
from minipar.trainer.checkpoint import atomic as cio
from minipar.trainer.checkpoint import save_load as ck
from minipar.trainer.checkpoint import verify as cv
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

try:                                      # the loss-curve plot's import, once here as well
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
except ImportError:
    pass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
TINY = ["--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_hidden_layers", "1",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "16",
        "--global_batch_size", "4", "--warmup_steps", "1", "--eval_steps", "0", "--logging_steps", "100",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--progress_bar", "false", "--export_hf", "false", "--save_final_checkpoint", "true",
        "--dataset", os.path.join(ROOT, "data", "shakespeare.txt")]
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def save(tmp_path):
    """save(step, keep_last=None) -> the path of output_dir/step-N, of a one-process tiny model."""
    model = LlamaForCausalLM(LlamaConfig(**CFG))
    opt = moptim.build_optimizer(model, lr=1e-3)
    return lambda step, keep_last=None: ck.save_checkpoint(str(tmp_path / f"step-{step}"), model, opt,
                                                           model.pgm, step=step, keep_last=keep_last)


def _flip(directory, rel="trainer_state.pt"):
    path = os.path.join(directory, rel)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01                  # same size: only the checksum can tell
    open(path, "wb").write(bytes(data))


def _names(out, prefix=""):
    """The names in `out` that start with `prefix`, by step number."""
    return sorted((n for n in os.listdir(out) if n.startswith(prefix)),
                  key=lambda n: (int(n.split("-")[1].split(".")[0]), n))


# ------------------------------------------------------------------ 1. never the newest good one
def test_no_limit_deletes_the_newest_good_or_the_just_saved_checkpoint(tmp_path, save):
    save(2, keep_last=-1)
    save(4, keep_last=-1)
    assert _names(tmp_path) == ["step-4"], "a negative limit keeps one: the newest"
    save(6, keep_last=-5)
    assert _names(tmp_path) == ["step-6"]
    save(3, keep_last=1)                  # saved after a resume from an older step: kept, and step-6 too
    assert _names(tmp_path) == ["step-3", "step-6"]
    save(8, keep_last=0)                  # 0 and None keep every checkpoint
    save(9)
    assert _names(tmp_path) == ["step-3", "step-6", "step-8", "step-9"]


# ------------------------------------------------------------------ 2. damaged ones moved aside
def test_rotation_moves_a_damaged_checkpoint_aside_and_keeps_the_good_one(tmp_path, save, capsys,
                                                                          monkeypatch):
    for step in (2, 4, 6):
        save(step)
    _flip(tmp_path / "step-6")            # the newest damaged; a run resumed from step-4 saves step-5
    save(5, keep_last=2)
    err = capsys.readouterr().err
    assert _names(tmp_path) == ["step-4", "step-5", "step-6.corrupt"]
    assert f"checkpoint {tmp_path / 'step-6'} is damaged" in err and "sha256" in err, err
    assert f"moved it aside to {tmp_path / 'step-6.corrupt'}" in err and len(err.strip().splitlines()) == 1
    # nothing lists, resumes from, cleans or counts a .corrupt directory
    assert cv.list_checkpoints(str(tmp_path)) == [str(tmp_path / "step-4"), str(tmp_path / "step-5")]
    assert cv.find_latest_verified(str(tmp_path)) == (str(tmp_path / "step-5"), [])
    assert cio.clean_stale(str(tmp_path)) == [] and (tmp_path / "step-6.corrupt").is_dir()
    # each checkpoint is hashed once a run (by the rotation of its own save), not at every save
    hashed, real = [], cv.sha256_file
    monkeypatch.setattr(cv, "sha256_file", lambda path, *a: hashed.append(path) or real(path, *a))
    save(8, keep_last=3)                  # step-4 and step-5 were hashed by step-5's rotation
    assert {os.path.relpath(p, tmp_path).split(os.sep)[0] for p in hashed} == {"step-8"}, hashed
    hashed.clear()
    save(9, keep_last=2)
    assert {os.path.relpath(p, tmp_path).split(os.sep)[0] for p in hashed} == {"step-9"}, hashed
    assert _names(tmp_path) == ["step-6.corrupt", "step-8", "step-9"]
    _flip(tmp_path / "step-8")            # changed since its check (a mtime of its own: clocks are coarse)
    os.utime(tmp_path / "step-8" / "trainer_state.pt", ns=(1, 1))
    save(10, keep_last=3)                 # so hashed again: damaged, moved aside
    assert _names(tmp_path) == ["step-6.corrupt", "step-8.corrupt", "step-9", "step-10"]
    save(11, keep_last=1)
    assert _names(tmp_path) == ["step-6.corrupt", "step-8.corrupt", "step-11"], "left for a person to see"
    real_write = cio.write_file           # the files on disk differ from what the writer hashed

    def bad_write(root, rel, data):
        entry = real_write(root, rel, data)
        _flip(root, rel)
        return entry

    capsys.readouterr()
    monkeypatch.setattr(cio, "write_file", bad_write)
    save(12, keep_last=1)
    err = capsys.readouterr().err
    assert "step-12 is damaged" in err and "just saved: kept, but not counted" in err, err
    assert _names(tmp_path) == ["step-6.corrupt", "step-8.corrupt", "step-11", "step-12"]

def _train(argv):
    torch.set_num_threads(1)
    return [r["step"] for r in Trainer(setup_run(argv)).train()]


def test_resume_latest_moves_the_damaged_newest_aside(tmp_path, capfd):
    out = tmp_path / "run"
    base = [*TINY, "--output_dir", str(out), "--save_total_limit", "2"]
    run_world(_train, 1, [*base, "--max_steps", "4", "--save_steps", "2"], timeout=60)
    _flip(out / "step-4")
    capfd.readouterr()
    steps = run_world(_train, 1, [*base, "--max_steps", "4", "--save_steps", "3",
                                  "--resume_from_checkpoint", "latest"], timeout=60)[0]
    printed = capfd.readouterr().out
    assert steps[-2:] == [3, 4], steps                     # resumed from step-2, the good one
    assert f"moved the damaged checkpoint {out / 'step-4'} aside to {out / 'step-4.corrupt'}" in printed
    assert _names(out, "step-") == ["step-3", "step-4", "step-4.corrupt"]


# ------------------------------------------------------------------ 3. a full disk during a save
def test_full_disk_is_one_line_naming_the_checkpoint_and_the_intact_one(tmp_path, save, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)       # the writer's fsync: where a full disk shows
    with pytest.raises(cio.CheckpointWriteError) as info:
        save(2)
    msg = str(info.value)
    assert "there is no earlier checkpoint" in msg and os.listdir(tmp_path) == [], msg
    monkeypatch.undo()
    save(2)
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(cio.CheckpointWriteError) as info:
        save(4)
    msg = str(info.value)
    assert msg.startswith(f"could not write checkpoint {tmp_path / 'step-4'}: No space left on device "
                          f"(writing {tmp_path}/step-4.tmp-"), msg
    assert "rng/rank-00000.pt" in msg and "temporary directory was removed" in msg, msg
    assert f"the previous checkpoint {tmp_path / 'step-2'} is intact" in msg and "\n" not in msg, msg
    assert os.listdir(tmp_path) == ["step-2"]
    monkeypatch.undo()
    assert cv.find_latest_verified(str(tmp_path)) == (str(tmp_path / "step-2"), [])


def _save_with_a_full_rank(out, bad_rank):
    pgm = minipar.init(ParallelismConfig(2, 1, 1, 1))

    def write(tmp):
        if pgm.global_rank == bad_rank and os.path.basename(tmp).startswith("step-2"):
            raise ENOSPC
        return cio.write_file(tmp, f"part/rank-{pgm.global_rank}.bin", b"x" * 64)

    cio.atomic_save(os.path.join(out, "step-1"), pgm, "cpu", write, lambda: dict(step=1))
    try:
        cio.atomic_save(os.path.join(out, "step-2"), pgm, "cpu", write, lambda: dict(step=2))
    except cio.CheckpointWriteError as e:
        return str(e)
    return "saved"


def test_full_disk_on_one_rank_is_one_line_on_every_rank(tmp_path):
    got = run_world(_save_with_a_full_rank, 2, str(tmp_path), 1, timeout=60)
    step2, step1 = tmp_path / "step-2", tmp_path / "step-1"
    assert got[1].startswith(f"could not write checkpoint {step2}: No space left on device;"), got
    assert got[0].startswith(f"could not write checkpoint {step2}: another rank could not write its part "
                             f"(see that rank's error)"), got
    assert all(f"the previous checkpoint {step1} is intact" in m for m in got), got
    assert os.listdir(tmp_path) == ["step-1"], "the temporary directory is removed"


def _train_py(argv):
    """train.py run as a program, its writer failing at step-4 as a full disk does; the exit code."""
    real = cio.write_file

    def write_file(root, rel, data):
        if os.path.basename(root).startswith("step-4."):
            raise ENOSPC
        return real(root, rel, data)

    cio.write_file = write_file                # (a forked rank: nothing to undo)
    sys.argv = [os.path.join(ROOT, "train.py"), *argv]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0


def test_train_py_exits_1_with_one_line_on_a_full_disk(tmp_path, capfd):
    out = tmp_path / "run"
    capfd.readouterr()
    code = run_world(_train_py, 1, [*TINY, "--output_dir", str(out), "--max_steps", "4", "--save_steps", "2"],
                     timeout=60)[0]
    err = capfd.readouterr().err
    assert code == 1, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"[rank 0] error: could not write checkpoint {out / 'step-4'}: No space left"), err
    assert f"the previous checkpoint {out / 'step-2'} is intact" in last, err
    assert _names(out, "step-") == ["step-2"]
