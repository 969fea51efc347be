"""A resume that changes the plan: raising max_steps on resume follows the NEW schedule.

LambdaLR.load_state_dict writes the saved lambda's settings back, so without
lr_schedule.adopt_schedule a run of 6 steps resumed to 12 kept the 6-step cosine and sat at the minimum
rate for steps 7..12, with no word. The reference is the Hugging Face Trainer (the scheduler is
built from the new arguments, the saved state only moves it to the checkpoint's step): the lr of
steps 7..12 is a fresh 12-step run's, and a note names both lengths. The summary counts the steps
this run did, not the whole history.
"""
import contextlib
import io
import json
import os

import pytest
import torch
from harness import run_world

from minipar import lr_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_hidden_layers", "1",
        "--model.num_attention_heads", "2", "--model.num_key_value_heads", "1", "--sequence_len", "16",
        "--global_batch_size", "4", "--warmup_steps", "3", "--eval_steps", "0", "--logging_steps", "100",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--progress_bar", "false", "--save_steps", "0", "--export_hf", "false",
        "--dataset", os.path.join(ROOT, "data", "shakespeare.txt")]


def _train(argv):
    """One run on one process; returns its printed log (the notes and the summary)."""
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        Trainer(setup_run(argv)).train()
    return out.getvalue()


def _metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def _run(out_dir, *extra):
    return run_world(_train, 1, [os.path.join(ROOT, "configs", "ddp.yaml"), *TINY, "--dp_replicate_size", "1",
                                 "--output_dir", str(out_dir), *extra], timeout=240)[0]


def test_raised_max_steps_on_resume_follows_the_new_schedule(tmp_path):
    fresh_log = _run(tmp_path / "fresh", "--max_steps", "12")
    _run(tmp_path / "resumed", "--max_steps", "6")
    log = _run(tmp_path / "resumed", "--max_steps", "12", "--resume_from_checkpoint", "latest")
    fresh, resumed = _metrics(tmp_path / "fresh"), _metrics(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 13))
    # the rate of a fresh 12-step run (the weights differ: steps 4..6 ran on the 6-step cosine)
    for step in range(7, 13):
        assert resumed[step]["lr"] == pytest.approx(fresh[step]["lr"], rel=1e-9), step
    assert "max_steps 6 -> 12" in log and "schedule is rebuilt" in log, log
    # the summary counts what this run did: 6 steps, 7 to 12 (not the 12 lines of the history)
    assert "done: 6 steps (7-12) in" in log, log
    assert "done: 12 steps in" in fresh_log, fresh_log


def test_adopt_schedule_keeps_the_position_and_takes_the_new_settings():
    """The unit: load a 6-step scheduler's state into a 12-step one, at step 6."""
    p = torch.nn.Parameter(torch.zeros(2))
    old_opt = torch.optim.SGD([p], lr=1.0)
    old = lr_schedule.build_scheduler(old_opt, 2, 6, 0.1)
    for _ in range(6):
        old_opt.step()
        old.step()
    opt = torch.optim.SGD([p], lr=1.0)
    new = lr_schedule.build_scheduler(opt, 2, 12, 0.1)
    opt.load_state_dict(old_opt.state_dict())
    new.load_state_dict(old.state_dict())
    assert new.lr_lambdas[0].max_steps == 6            # what LambdaLR's load does by itself
    note = lr_schedule.adopt_schedule(new, 2, 12, 0.1)
    assert "max_steps 6 -> 12" in note
    expected = lr_schedule.WarmupCosine(2, 12, 0.1)
    assert opt.param_groups[0]["lr"] == pytest.approx(expected(6)) and new.get_last_lr() == [expected(6)]
    opt.step()
    new.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(expected(7))
    assert lr_schedule.adopt_schedule(new, 2, 12, 0.1) is None     # nothing changed: no note
