"""Tied embeddings under pipeline parallelism (minipar/pipeline_parallel/tied_ends.py): a tiny tied
Llama on pp 2 trains as one process (loss, grad norm, val loss, 1e-4), its two copies of the
embedding bitwise equal after the steps, and its checkpoints move between pp 2 and pp 1.

Fast: 1f1b (3 steps, the copies compared, saved sharded and exported: resumed on one process, the
export equal to one process's and reloaded by transformers with a tied lm_head) and
interleaved_1f1b; pp 2 x dp_shard 2 (ZeRO-3: the shards of the two copies summed element for
element) for 2 steps, its FULL_STATE_DICT resumed on one process; pp 2 x tp 2 with sp under zb_h1
for 2 steps; pp 2 x dp_shard 2 under zb_h1 (the copy's root gets
its gradient in W only) for 2 steps; a one-process checkpoint resumed on pp 2; stages stepping alone
(pipeline_overlap_steps) as the synchronous run; the ends group.
Slow: afab, zb_h1 and zbv (the V: both ends on rank 0, one Parameter) for 3 steps; pp 2 x
dp_shard 2 (also interleaved, clipped at 0.5), tp 2, DDP 2, cp 2 and HSDP 2 x 2 for 3 steps; pp 4 x
dp_shard 2 (the middle stages hold no copy).
A tied Gemma 2 on pp 2: tests/test_gemma.py (pp2-tied).
"""
import pytest
import torch
from harness import run_world
from test_pipeline import _argv, _curve, _reference, _same, _train

from minipar.mesh import all_groups

TIE = ("--model.tie_word_embeddings", "true")


def _train_copies(argv):
    """The curve, this rank's tensor of the tied weight after the steps (None: no copy), its coords."""
    from minipar.pipeline_parallel.tied_ends import _local_tensor
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    curve = _curve(trainer.train())
    t = _local_tensor(trainer.model)
    marked = bool(getattr(t, "tied_copy", False)) if t is not None else None
    return curve, None if t is None else t.detach().clone(), trainer.pgm.coords, marked


def _check(ref, got, steps):
    """Every rank's curve equals one process's; the first and the last stage's copies at the same
    (dp_replicate, dp_shard, cp, tp) coordinates are bitwise equal, and only the last's is marked."""
    ends = {}
    for curve, t, coords, marked in got:
        _same(ref[:steps], curve)
        if t is not None:
            key = tuple(v for k, v in coords.items() if k != "pp")
            ends.setdefault(key, {})[coords["pp"]] = (t, marked)
    pp = max(c["pp"] for *_, c, _ in got) + 1
    assert ends and all(sorted(e) == [0, pp - 1] for e in ends.values()), ends.keys()
    for e in ends.values():
        (first, m0), (last, m1) = e[0], e[pp - 1]
        assert torch.equal(first, last) and not m0 and m1


def _ref(tmp_path_factory):
    return _reference(tmp_path_factory, 4, 5, *TIE)       # 5 steps, evaluated at 3 and 5


# ------------------------------------------------------------------------------ pure
def test_the_ends_group_and_the_refusals_are_gone():
    from minipar.config import ParallelismConfig
    from minipar.pipeline_parallel.tied_ends import ends_apart
    groups = all_groups(ParallelismConfig(dp_shard_size=2, pp_size=3).resolve(6))
    assert groups["pp"] == [[0, 2, 4], [1, 3, 5]] and groups["pp_ends"] == [[0, 4], [1, 5]]
    assert all_groups(ParallelismConfig(tp_size=2).resolve(2))["pp_ends"] == [[0], [1]]
    assert ends_apart("1f1b", 2) and ends_apart("interleaved_1f1b", 2, 2) and not ends_apart("zbv", 2, 2)


# ------------------------------------------------------------------- equal to one process (fast)
def test_tied_pp2_1f1b_matches_one_process_saves_resumes_and_exports(tmp_path_factory, tmp_path):
    import transformers
    from safetensors.torch import load_file

    from minipar.trainer.checkpoint.export import export_checkpoint
    ref = _ref(tmp_path_factory)
    save = tmp_path / "pp2"
    got = run_world(_train_copies, 2, _argv(save, *TIE, "--pipeline_parallel_size", "2",
                                            "--save_final_checkpoint", "true", "--export_hf", "true"),
                    timeout=300)
    _check(ref, got, 3)
    # resumed on one process: steps 4-5 of the uninterrupted run
    resumed = run_world(_train, 1, _argv(tmp_path / "one", *TIE, "--resume_from_checkpoint",
                                         str(save / "step-3"), steps=5), timeout=300)[0]
    _same(ref[3:], resumed)
    # the export holds embed_tokens only, as one process's does, bit for bit; transformers ties it
    export_checkpoint(str(save / "step-3"), str(tmp_path / "hf1"))
    mine, one = load_file(str(save / "hf" / "model.safetensors")), load_file(str(tmp_path / "hf1" /
                                                                                 "model.safetensors"))
    assert sorted(mine) == sorted(one) and "lm_head.weight" not in mine
    for name in one:
        torch.testing.assert_close(mine[name], one[name], rtol=0, atol=0)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(save / "hf"))
    assert hf.config.tie_word_embeddings
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(hf.lm_head.weight.detach(), mine["model.embed_tokens.weight"], rtol=0, atol=0)


def test_tied_interleaved_pp2_matches_one_process(tmp_path_factory, tmp_path):
    ref = _ref(tmp_path_factory)
    got = run_world(_train_copies, 2, _argv(tmp_path, *TIE, "--pipeline_parallel_size", "2",
                                            "--pipeline_schedule", "interleaved_1f1b"), timeout=300)
    _check(ref, got, 3)


def test_one_process_checkpoint_resumes_on_tied_pp2(tmp_path_factory, tmp_path):
    ref = _ref(tmp_path_factory)
    save = tmp_path / "one"
    run_world(_train, 1, _argv(save, *TIE, "--save_final_checkpoint", "true"), timeout=300)
    got = run_world(_train_copies, 2, _argv(tmp_path / "pp2", *TIE, "--pipeline_parallel_size", "2",
                                            "--resume_from_checkpoint", str(save / "step-3"), steps=5),
                    timeout=300)
    for curve, *_ in got:
        _same(ref[3:], curve)
    (a, *_), (b, *_) = [g[1:] for g in got]
    assert torch.equal(a, b)                     # both copies loaded from embed_tokens, stepped alike


# ZeRO-3 (the two copies' shards summed element for element) and tp 2: 2 steps fast, 3 slow
LAYOUTS = {
    "zero3": (4, ["--dp_shard_size", "2", "--fsdp.state_dict_type", "FULL_STATE_DICT"]),
    "tp2-sp-zb_h1": (4, ["--tensor_parallel_size", "2", "--sequence_parallel", "true",
                         "--pipeline_schedule", "zb_h1"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tied_pp2_layouts_match_one_process_fast(tmp_path_factory, tmp_path, layout):
    ref = _ref(tmp_path_factory)
    world, extra = LAYOUTS[layout]
    save = tmp_path / layout
    got = run_world(_train_copies, world, _argv(save, *TIE, "--pipeline_parallel_size", "2", *extra,
                                                "--save_final_checkpoint", "true", steps=2), timeout=300)
    _check(ref, got, 2)
    if layout == "zero3":                        # gathered over the shards and the stages, once
        resumed = run_world(_train, 1, _argv(tmp_path / "one", *TIE, "--resume_from_checkpoint",
                                             str(save / "step-2"), "--eval_steps", "3", steps=5),
                           timeout=300)[0]
        _same(ref[2:], resumed)


def test_tied_zero3_under_a_split_backward_matches_one_process(tmp_path_factory, tmp_path):
    # pp 2 x dp_shard 2 under ZB-H1: the last stage's ZeRO-3 root holds its copy of E alone, whose
    # gradient comes only in W (the lm_head's matmul split), so each B hands the root's flat buffer
    # an undefined gradient: its post-accumulate-grad hook must take that as nothing to add
    ref = _ref(tmp_path_factory)
    layout = ["--pipeline_parallel_size", "2", "--dp_shard_size", "2", "--pipeline_schedule", "zb_h1"]
    got = run_world(_train_copies, 4, _argv(tmp_path, *TIE, *layout, steps=2), timeout=300)
    _check(ref, got, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world,extra", [
    (2, ["--pipeline_schedule", "afab"]),
    (2, ["--pipeline_schedule", "zb_h1"]),
    (2, ["--pipeline_schedule", "zbv"]),
    (4, ["--dp_shard_size", "2"]),
    (4, ["--tensor_parallel_size", "2"]),
    (4, ["--dp_shard_size", "2", "--pipeline_schedule", "interleaved_1f1b", "--max_grad_norm", "0.5"]),
    (4, ["--dp_replicate_size", "2", "--dp_shard_size", "1"]),
    (4, ["--context_parallel_size", "2"]),
    (8, ["--dp_replicate_size", "2", "--dp_shard_size", "2", "--micro_batch_size", "1"]),
], ids=["afab", "zb_h1", "zbv", "zero3", "tp2", "zero3-interleaved", "ddp2", "cp2", "hsdp2x2"])
def test_tied_pp2_slow(tmp_path_factory, tmp_path, world, extra):
    ref = _ref(tmp_path_factory) if "--max_grad_norm" not in extra else \
        _reference(tmp_path_factory, 4, 5, *TIE, "--max_grad_norm", "0.5")
    got = run_world(_train_copies, world, _argv(tmp_path, *TIE, "--pipeline_parallel_size", "2", *extra),
                    timeout=600)
    if "zbv" in extra:                           # the V: both ends on rank 0, one Parameter, no sum
        for curve, t, coords, marked in got:
            _same(ref[:3], curve)
            assert (t is not None) == (coords["pp"] == 0) and not marked
        return
    _check(ref, got, 3)


@pytest.mark.slow
def test_tied_pp4_zero3_middle_stages_hold_no_copy(tmp_path_factory, tmp_path):
    ref = _ref(tmp_path_factory)
    got = run_world(_train_copies, 8, _argv(tmp_path, *TIE, "--pipeline_parallel_size", "4",
                                            "--dp_shard_size", "2", "--micro_batch_size", "1"), timeout=600)
    _check(ref, got, 3)
    assert all((t is None) == (coords["pp"] in (1, 2)) for _, t, coords, _ in got)


def test_tied_stages_stepping_alone_train_as_the_synchronous_run(tmp_path):
    # pipeline_overlap_steps with clipping (post-validated): the sum is part of each stage's
    # schedule, so a stage stepping alone updates its copy as the synchronous run does
    pp = [*TIE, "--pipeline_parallel_size", "2", "--pipeline_schedule", "1f1b"]
    sync = run_world(_train_copies, 2, _argv(tmp_path / "sync", *pp, steps=4), timeout=300)
    alone = run_world(_train_copies, 2, _argv(tmp_path / "alone", *pp, "--pipeline_overlap_steps", "true",
                                              steps=4), timeout=300)
    for a, b in zip(sync, alone):
        _same(a[0], b[0], rel=1e-6)
        assert torch.equal(a[1], b[1])
    assert torch.equal(alone[0][1], alone[1][1])
