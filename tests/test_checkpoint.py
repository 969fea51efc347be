"""Checkpoints: exact resume on the same layout, resharding to other layouts, FULL_STATE_DICT,
refusal of damaged / partial / foreign checkpoints, atomic saves, and the Hugging Face export.

Every run trains the tiny decoder with minipar's AdamW (weight decay), the warmup-cosine schedule,
global-norm clipping, and batches drawn from the global torch / python / numpy generators, so a
resume that forgot any of them would diverge."""
import os
import random
import shutil

import numpy as np
import pytest
import torch
from harness import run_world

import minipar
from minipar import ParallelismConfig, ProcessGroupManager, batch_split, comm, lr_schedule
from minipar import optim as moptim
from minipar.trainer.checkpoint import atomic as cio
from minipar.trainer.checkpoint import files as ck_files
from minipar.trainer.checkpoint import layout as ck_layout
from minipar.trainer.checkpoint import save_load as ck
from minipar.trainer.checkpoint import verify
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

CFG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
B, T, K, MORE = 4, 16, 3, 3           # batch, sequence, steps before the save, steps after


def _setup(shape, zero3, seed=0, tied=False):
    """(model, optimizer, scheduler, pgm) on the current world (shape = dp_replicate, dp_shard, cp, tp)."""
    pgm = ProcessGroupManager.local() if shape == (1, 1, 1, 1) else minipar.init(ParallelismConfig(*shape))
    model = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=tied), pgm, seed=seed)
    if zero3:
        from minipar.zero3 import fully_shard
        fully_shard(model, pgm)
    opt = moptim.build_optimizer(model, lr=1e-2, weight_decay=0.1)
    return model, opt, lr_schedule.build_scheduler(opt, 2, 20), pgm


def _grad_sync(model, pgm):
    """Plain data parallelism (no ZeRO-3): sum the gradients over dp_cp (losses are global means)."""
    if getattr(model, "zero3", None) is None:
        for p in model.parameters():
            comm.all_reduce(p.grad, pgm.dp_cp)


def _train(model, opt, sched, pgm, steps):
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, CFG["vocab_size"], (B, T))          # the global generators drive the data
        labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)
        labels[0, :random.randint(0, 4)] = -100
        labels[1, :int(np.random.randint(0, 4))] = -100
        batch = batch_split.local_batch(ids, labels, pgm)
        loss = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     num_items_in_batch=batch_split.count_label_tokens(labels))
        loss.backward()
        _grad_sync(model, pgm)
        moptim.clip_grad_norm_(model.parameters(), 1.0, pgm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().double()
        comm.all_reduce(total, pgm.dp_cp)
        losses.append(total.item())
    return losses


def _seed_all(seed=123):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _full(model, opt, pgm):
    states, scalars = ck_layout.full_optimizer_state(model, opt, pgm)
    return dict(params=model.full_state_dict(), states=states, steps=scalars)


def _save_and_resume(shape, zero3, directory, sdt="SHARDED_STATE_DICT", export=None, tied=False):
    """Train K steps, save, train MORE (the uninterrupted run); then a fresh model (other seed)
    loads the checkpoint and trains MORE (the resumed run). Returns both."""
    _seed_all()
    model, opt, sched, pgm = _setup(shape, zero3, tied=tied)
    _train(model, opt, sched, pgm, K)
    ck.save_checkpoint(directory, model, opt, pgm, step=K, scheduler=sched, extra=dict(step=K, note="hi"),
                       state_dict_type=sdt)
    saved = _full(model, opt, pgm)
    ref = _train(model, opt, sched, pgm, MORE)
    out = dict(saved=saved, ref=ref, ref_end=model.full_state_dict(), lr=opt.param_groups[0]["lr"])
    if export:
        ck.export_hf(export, model)
        with torch.no_grad():
            out["logits"] = model(torch.arange(24).view(2, 12) % CFG["vocab_size"])
    model, opt, sched, pgm = _setup(shape, zero3, seed=7, tied=tied)
    _seed_all(999)                                            # the checkpoint must restore the generators
    out["extra"] = ck.load_checkpoint(directory, model, opt, pgm, scheduler=sched)
    out["loaded"] = _full(model, opt, pgm)
    out["resumed"] = _train(model, opt, sched, pgm, MORE)
    out["resumed_end"], out["resumed_lr"] = model.full_state_dict(), opt.param_groups[0]["lr"]
    return out


def _load_and_train(shape, zero3, directory):
    model, opt, sched, pgm = _setup(shape, zero3, seed=7)
    extra = ck.load_checkpoint(directory, model, opt, pgm, scheduler=sched)
    return dict(extra=extra, loaded=_full(model, opt, pgm), resumed=_train(model, opt, sched, pgm, MORE))


def _equal(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k}"


def _same_state(got, want):
    _equal(got["params"], want["params"], "params")
    assert got["states"].keys() == want["states"].keys() == {"exp_avg", "exp_avg_sq"}
    for kind in want["states"]:
        _equal(got["states"][kind], want["states"][kind], kind)
    assert got["steps"] == want["steps"] and {s["step"] for s in want["steps"].values()} == {float(K)}


def _check_exact(results):
    for r in results:
        _same_state(r["loaded"], r["saved"])
        assert r["extra"] == dict(step=K, note="hi")
        assert r["resumed"] == r["ref"], "a resumed run must continue bit for bit"
        assert r["resumed_lr"] == r["lr"]
        _equal(r["resumed_end"], r["ref_end"], "params after the resumed steps")


# ---------------------------------------------------------------------------- exact resume
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_roundtrip_one_process(tmp_path, tied):
    _check_exact([_save_and_resume((1, 1, 1, 1), False, str(tmp_path / "step-3"), tied=tied)])
    assert verify.find_latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-3")


@pytest.mark.parametrize("shape,zero3,tied", [((1, 1, 1, 2), False, True), ((1, 2, 1, 1), True, True),
                                              ((2, 1, 1, 2), False, False)],
                         ids=["tp2-tied", "zero3-dp2-tied", "dp2xtp2-plain"])
def test_roundtrip_distributed(tmp_path, shape, zero3, tied):
    world = int(np.prod(shape))
    results = run_world(_save_and_resume, world, shape, zero3, str(tmp_path / "step-3"), tied=tied,
                        timeout=180)
    _check_exact(results)
    files = verify.read_manifest(str(tmp_path / "step-3"))["files"]
    shards = sorted(f for f in files if f.startswith("shards/"))
    # one copy per distinct shard: tp ranks of dp_cp rank 0 (plain), every dp_shard_cp rank (ZeRO-3)
    assert len(shards) == (world if zero3 else shape[3]), shards
    assert len([f for f in files if f.startswith("rng/")]) == world


# --------------------------------------------------------------------- resharding, FULL, export
@pytest.fixture(scope="module")
def saved_4d(tmp_path_factory):
    """ZeRO-3 over dp_shard 2 x tp 2 (4 ranks): a SHARDED and a FULL checkpoint, and an HF export."""
    root = tmp_path_factory.mktemp("ckpt")
    sharded = run_world(_save_and_resume, 4, (1, 2, 1, 2), True, str(root / "sharded" / "step-3"),
                        export=str(root / "hf"), timeout=180)
    full = run_world(_save_and_resume, 4, (1, 2, 1, 2), True, str(root / "full" / "step-3"),
                     "FULL_STATE_DICT", timeout=180)
    return root, sharded, full


def test_zero3_tp_roundtrip_sharded_and_full(saved_4d):
    root, sharded, full = saved_4d
    _check_exact(sharded)
    _check_exact(full)
    _same_state(full[0]["saved"], sharded[0]["saved"])            # the same run, saved two ways
    rngs = [f"rng/rank-0000{r}.pt" for r in range(4)]
    files = sorted(verify.read_manifest(str(root / "full" / "step-3"))["files"])
    assert files == ["model.safetensors", "optimizer.pt"] + rngs + ["trainer_state.pt"]


RESHARD = {"sharded-1proc": ("sharded", (1, 1, 1, 1), False),
           "sharded-tp2": ("sharded", (1, 1, 1, 2), False),
           "sharded-zero3-dp4": ("sharded", (1, 4, 1, 1), True),
           "sharded-hsdp2x2": ("sharded", (2, 2, 1, 1), True),
           "full-1proc": ("full", (1, 1, 1, 1), False),
           "full-dp2xtp2": ("full", (2, 1, 1, 2), False)}


@pytest.mark.parametrize("kind,shape,zero3", RESHARD.values(), ids=RESHARD.keys())
def test_reshard(saved_4d, kind, shape, zero3):
    """Saved by ZeRO-3 on dp_shard 2 x tp 2; loaded elsewhere, with and without ZeRO-3."""
    root, sharded, _ = saved_4d
    directory = str(root / kind / "step-3")
    if shape == (1, 1, 1, 1):
        results = [_load_and_train(shape, zero3, directory)]
    else:
        results = run_world(_load_and_train, int(np.prod(shape)), shape, zero3, directory, timeout=180)
    want = sharded[0]
    for r in results:
        _same_state(r["loaded"], want["saved"])                  # pure data movement: exact
        assert r["extra"] == dict(step=K, note="hi")
        np.testing.assert_allclose(r["resumed"], want["ref"], rtol=1e-5)   # other layout: float rounding


def test_reshard_8_ranks_with_cp(tmp_path):
    """The issue's example: saved at dp_shard 2 x cp 2 x tp 2 (ZeRO-3 over dp_shard_cp), resumed at
    dp_shard 4 x tp 2."""
    saved = run_world(_save_and_resume, 8, (1, 2, 2, 2), True, str(tmp_path / "step-3"), timeout=180)
    _check_exact(saved)
    for r in run_world(_load_and_train, 8, (1, 4, 1, 2), True, str(tmp_path / "step-3"), timeout=180):
        _same_state(r["loaded"], saved[0]["saved"])
        np.testing.assert_allclose(r["resumed"], saved[0]["ref"], rtol=1e-5)


def test_export_hf_loads_in_transformers(saved_4d):
    import transformers
    root, sharded, _ = saved_4d
    hf = transformers.LlamaForCausalLM.from_pretrained(str(root / "hf")).float().eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.arange(24).view(2, 12) % CFG["vocab_size"]).logits
    torch.testing.assert_close(logits, sharded[0]["logits"], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------- damage and refusal
@pytest.fixture
def two_saves(tmp_path):
    """output_dir with step-2 and step-4 of a one-process run, and the model/optimizer to load into."""
    _seed_all()
    model, opt, sched, pgm = _setup((1, 1, 1, 1), False)
    for step in (2, 4):
        _train(model, opt, sched, pgm, 2)
        ck.save_checkpoint(str(tmp_path / f"step-{step}"), model, opt, pgm, step=step, scheduler=sched)
    return tmp_path, model, opt, sched, pgm


def _refused(path, model, opt, pgm, match):
    with pytest.raises(ValueError, match=match):
        ck.load_checkpoint(str(path), model, opt, pgm)


def test_damaged_truncated_missing_files_are_refused(two_saves):
    out, model, opt, sched, pgm = two_saves
    shard = out / "step-4" / "shards" / "rank-00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _refused(out / "step-4", model, opt, pgm, r"rank-00000\.pt fails its sha256 checksum")
    shard.write_bytes(bytes(data[:100]))
    _refused(out / "step-4", model, opt, pgm, r"rank-00000\.pt has 100 bytes.*truncated")
    assert verify.find_latest_checkpoint(str(out)) == str(out / "step-2")   # sizes are checked when listing
    os.remove(out / "step-2" / "rng" / "rank-00000.pt")
    _refused(out / "step-2", model, opt, pgm, r"rank-00000\.pt is missing")
    assert verify.find_latest_checkpoint(str(out)) is None


def test_missing_manifest_and_crashed_save_are_skipped(two_saves):
    out, model, opt, sched, pgm = two_saves
    os.remove(out / "step-4" / "manifest.json")
    _refused(out / "step-4", model, opt, pgm, r"step-4/manifest\.json is missing")
    stale = out / "step-6.tmp-0123456789abcdef"                  # what a killed save leaves
    shutil.copytree(out / "step-2", stale)
    assert verify.find_latest_checkpoint(str(out)) == str(out / "step-2")
    assert verify.list_checkpoints(str(out)) == [str(out / "step-2")]
    ck.save_checkpoint(str(out / "step-6"), model, opt, pgm, step=6, scheduler=sched, keep_last=2)
    assert not stale.exists(), "the next save cleans temporary directories of crashed saves"
    assert verify.find_latest_checkpoint(str(out)) == str(out / "step-6")
    assert ck.load_checkpoint(str(out / "step-2"), model, opt, pgm) is None


def test_failing_save_keeps_last_good_checkpoint(two_saves, monkeypatch):
    out, model, opt, sched, pgm = two_saves
    before = (out / "step-4" / "manifest.json").read_bytes()
    real, calls = cio.write_file, []

    def flaky(root, rel, data):
        calls.append(rel)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(root, rel, data)

    monkeypatch.setattr(cio, "write_file", flaky)
    with pytest.raises(OSError, match="No space left"):
        ck.save_checkpoint(str(out / "step-4"), model, opt, pgm, step=4, scheduler=sched)
    monkeypatch.undo()
    assert (out / "step-4" / "manifest.json").read_bytes() == before
    assert sorted(os.listdir(out)) == ["step-2", "step-4"], "the temporary directory is removed"
    ck.load_checkpoint(str(out / "step-4"), model, opt, pgm)
    ck.save_checkpoint(str(out / "step-4"), model, opt, pgm, step=4, scheduler=sched)    # replaces it
    assert sorted(os.listdir(out)) == ["step-2", "step-4"]
    assert (out / "step-4" / "manifest.json").read_bytes() != before
    os.rename(out / "step-2", out / "step-2.old-00000000000000aa")   # killed while replacing step-2
    ck.save_checkpoint(str(out / "step-6"), model, opt, pgm, step=6, scheduler=sched)
    assert sorted(os.listdir(out)) == ["step-2", "step-4", "step-6"], "the old copy is put back"


def test_another_model_shape_is_refused(two_saves):
    out = two_saves[0]
    other = LlamaForCausalLM(LlamaConfig(**dict(CFG, intermediate_size=96)))
    _refused(out / "step-4", other, moptim.build_optimizer(other, lr=1e-2), other.pgm,
             r"another model shape: intermediate_size: checkpoint 64, model 96")
    with pytest.raises(ValueError, match="state_dict_type"):
        ck.save_checkpoint(str(out / "x"), other, None, other.pgm, step=1, state_dict_type="FULL")
    # token ids are no shape: a checkpoint without them (an older minipar's) loads into a model with them
    manifest = verify.read_manifest(str(out / "step-4"))
    same = dict(manifest["model_config"], eos_token_id=2)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        manifest["model_config"].pop(key, None)
    ck_files.check_model(str(out / "step-4"), manifest, same, manifest["params"])


def _load_damaged(directory):
    model, opt, sched, pgm = _setup((1, 1, 1, 2), False)
    try:
        ck.load_checkpoint(directory, model, opt, pgm, scheduler=sched)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_damaged_checkpoint_refused_on_every_rank(tmp_path):
    run_world(_save_and_resume, 2, (1, 1, 1, 2), False, str(tmp_path / "step-3"), timeout=180)
    shard = tmp_path / "step-3" / "shards" / "rank-00001.pt"
    data = bytearray(shard.read_bytes())
    data[-50] ^= 0x01
    shard.write_bytes(bytes(data))
    messages = run_world(_load_damaged, 2, str(tmp_path / "step-3"), timeout=120)   # no rank hangs
    assert all("shards/rank-00001.pt fails its sha256 checksum" in m for m in messages), messages


def test_model_only_checkpoint(tmp_path):
    model, opt, sched, pgm = _setup((1, 1, 1, 1), False)
    ck.save_checkpoint(str(tmp_path / "step-0"), model, None, pgm, step=0, state_dict_type="FULL_STATE_DICT")
    other, other_opt, _, _ = _setup((1, 1, 1, 1), False, seed=5)
    _refused(tmp_path / "step-0", other, other_opt, pgm, "holds no optimizer state")
    ck.load_checkpoint(str(tmp_path / "step-0"), other, None, pgm)
    _equal(other.full_state_dict(), model.full_state_dict(), "params")
