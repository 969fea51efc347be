"""Issue 10: numbers as people write them, Axolotl configs, one run per output_dir, writability
before step 1, checkpoints that run no code, the smaller traps of resume and of the API."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from harness import run_program, run_world

import minipar
from minipar.trainer import lifecycle, run_lock
from minipar.trainer.checkpoint import atomic as cio
from minipar.trainer.checkpoint import files as ck_files
from minipar.trainer.checkpoint import save_load as ck
from minipar.trainer.checkpoint import verify
from minipar.trainer.config import keys as config_keys
from minipar.trainer.config.train_config import TrainConfig, load_config
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
AXOLOTL = os.path.join(ROOT, "tests", "data", "axolotl_fsdp.yaml")
TINY = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "32",
        "--global_batch_size", "4", "--warmup_steps", "1", "--eval_steps", "0", "--logging_steps", "100",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--progress_bar", "false", "--export_hf", "false", "--dp_replicate_size", "1",
        "--context_parallel_size", "1", "--tensor_parallel_size", "1"]


def _error(argv):
    """setup_run's error on this rank, as text ('no error' if it passed)."""
    try:
        setup_run(argv)
    except (ValueError, FileNotFoundError) as err:
        return str(err)
    return "no error"


def _train(argv):
    torch.set_num_threads(1)
    run = setup_run(argv)
    history = Trainer(run).train()
    return dict(steps=[r["step"] for r in history], notes=run.notes, cfg=run.cfg.to_dict())


# ------------------------------------------------------------------ 2. floats as people write them
def test_float_keys_take_exponents_from_cli_and_yaml(tmp_path):
    cfg = load_config(DEFAULT, ["--learning_rate", "3e-4", "--adam_beta2", "1E-1",
                                "--model.rope_theta", "1e4"])
    assert (cfg.learning_rate, cfg.adam_beta2, cfg.model.rope_theta) == (3e-4, 0.1, 1e4)
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 2e-5\nmax_grad_norm: 1e0\nmin_lr_ratio: 5E-2\nweight_decay: 0\n")
    cfg = load_config(str(path))
    assert (cfg.learning_rate, cfg.max_grad_norm, cfg.min_lr_ratio, cfg.weight_decay) \
        == (2e-5, 1.0, 0.05, 0.0)
    assert isinstance(cfg.weight_decay, float)
    for argv, message in [(["--max_steps", "2.5"], "'max_steps' must be an integer, got 2.5"),
                          (["--max_steps", "3e-4"], "'max_steps' must be an integer, got '3e-4'"),
                          (["--learning_rate", "fast"], "'learning_rate' must be a number"),
                          (["--sequence_parallel", "1"], "'sequence_parallel' must be true or false"),
                          (["--micro_batch_size", "2.0"], "'micro_batch_size' must be an integer")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(DEFAULT, argv)


# ------------------------------------------------------------------ 3. Axolotl configs
def test_every_unknown_key_in_one_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learnig_rate: 1e-3\nwarmup_step: 10\nflash_attn: true\nmodel:\n  hidden_siz: 64\n"
                    "fsdp_config:\n  fsdp_reshard_after_forwrd: true\n")
    with pytest.raises(ValueError) as info:
        load_config(str(path), ["--max_stesp", "3"])
    msg = str(info.value)
    assert msg.startswith("6 unknown config keys"), msg
    for part in ["'learnig_rate' (Did you mean 'learning_rate'?)",
                 "'warmup_step' (Did you mean 'warmup_steps'?)",
                 "'flash_attention'", "'model.hidden_siz' (Did you mean 'model.hidden_size'?)",
                 "'fsdp_config.fsdp_reshard_after_forwrd'", "'max_stesp' (Did you mean 'max_steps'?)"]:
        assert part in msg, (part, msg)


def test_axolotl_yaml_loads_in_one_go_and_trains(tmp_path):
    notes = []
    cfg = load_config(AXOLOTL, notes=notes)                 # every key known, in one go
    assert config_keys.resolve_batch(cfg, 2) == 2 and (cfg.global_batch_size, cfg.micro_batch_size) == (8, 2)
    assert cfg.max_steps is None and cfg.num_epochs == 1.0   # derived once the dataset is read
    config_keys.resolve_max_steps(cfg, 1000, notes)
    assert cfg.max_steps == 125
    assert "max_steps = ceil(1 x 1000 samples per epoch / global batch 8) = 125" in notes[-1]
    assert cfg.dtype == "float32" and "bf16: auto -> dtype float32 (no GPU with bfloat16 here)" in notes
    assert vars(cfg.fsdp) == dict(wrap=["LlamaDecoderLayer"], prefetch=1, reshard_after_forward=True,
                                  state_dict_type="FULL_STATE_DICT", sync_each_batch=True)
    assert any("fsdp_sync_module_states" in n and "no effect" in n for n in notes)
    assert (cfg.optimizer, cfg.gradient_checkpointing, cfg.learning_rate, cfg.fsdp_version) == \
        ("adamw_torch_fused", True, 2e-5, 2)
    # and it trains on 2 ranks (ZeRO-3, accumulation 2, fused AdamW); an explicit max_steps wins
    out = run_world(_train, 2, [AXOLOTL, "--output_dir", str(tmp_path / "b"), "--max_steps", "2",
                                # no peak measured, no PNG: unread here
                                "--peak_tflops", "1", "--loss_curve", "false",
                                "--progress_bar", "false", "--export_hf", "false",
                                "--save_final_checkpoint", "false"], timeout=180)[0]
    assert out["steps"] == [1, 2]
    assert any("max_steps 2 given: num_epochs 1 is not used" in n for n in out["notes"])
    assert (out["cfg"]["global_batch_size"], out["cfg"]["gradient_accumulation_steps"]) == (8, 2)


def _batch(**kw):
    cfg = TrainConfig()
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_batch_any_two_imply_the_third_and_contradictions_name_all_three(tmp_path):
    cfg = _batch(global_batch_size=None, micro_batch_size=2, gradient_accumulation_steps=4)
    assert config_keys.resolve_batch(cfg, 2) == 4 and cfg.global_batch_size == 16
    cfg = _batch(global_batch_size=16, gradient_accumulation_steps=4)
    assert config_keys.resolve_batch(cfg, 2) == 4 and cfg.micro_batch_size == 2
    cfg = _batch(global_batch_size=16, micro_batch_size=2)
    assert config_keys.resolve_batch(cfg, 2) == 4 and cfg.gradient_accumulation_steps == 4
    cfg = _batch(global_batch_size=16, micro_batch_size=2, gradient_accumulation_steps=4)
    assert config_keys.resolve_batch(cfg, 2) == 4
    with pytest.raises(ValueError, match=r"global_batch_size=32, micro_batch_size=2, "
                                         r"gradient_accumulation_steps=4 "
                                         r"contradict.*2 x 4 x 2 = 16, not 32"):
        config_keys.resolve_batch(_batch(global_batch_size=32, micro_batch_size=2,
                                         gradient_accumulation_steps=4), 2)
    # from a config: accumulation and micro given, the global batch follows (the default 16 is not "given")
    path = tmp_path / "c.yaml"
    path.write_text("micro_batch_size: 2\ngradient_accumulation_steps: 3\n")
    cfg = load_config(str(path))
    assert cfg.global_batch_size is None and config_keys.resolve_batch(cfg, 4) == 3 \
        and cfg.global_batch_size == 24
    with pytest.raises(ValueError, match="contradict"):     # configs/default.yaml sets global_batch_size: 16
        config_keys.resolve_batch(load_config(DEFAULT, ["--micro_batch_size", "2",
                                                        "--gradient_accumulation_steps", "3"]), 4)


def test_bf16_scheduler_optimizer_fsdp_keys(tmp_path):
    assert load_config(DEFAULT, ["--bf16", "true"]).dtype == "bfloat16"
    assert load_config(DEFAULT, ["--bf16", "auto", "--dtype", "bfloat16"]).dtype == "bfloat16"
    refused = [(["--bf16", "true", "--dtype", "float32"], "bf16: true contradicts dtype: float32"),
               (["--bf16", "false", "--dtype", "bfloat16"], "bf16: false contradicts dtype: bfloat16"),
               (["--bf16", "maybe"], "bf16 must be true, false or auto"),
               (["--lr_scheduler", "polynomial"], "lr_scheduler 'polynomial' is not supported; "
                                                  "supported: ['cosine', "),
               (["--optimizer", "sgd"], "optimizer 'sgd' is not supported; supported: ['adamw_torch', "
                                        "'adamw_torch_fused']"),
               (["--fsdp_version", "3"], "fsdp_version 3 is not supported")]
    for argv, message in refused:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(DEFAULT, argv)
    path = tmp_path / "f.yaml"
    path.write_text("fsdp_config:\n  reshard_after_forward: false\n  state_dict_type: FULL_STATE_DICT\n"
                    "  transformer_layer_cls_to_wrap: LlamaDecoderLayer\n  activation_checkpointing: true\n")
    cfg = load_config(str(path))
    assert (cfg.fsdp.reshard_after_forward, cfg.fsdp.state_dict_type, cfg.fsdp.wrap,
            cfg.gradient_checkpointing) == (False, "FULL_STATE_DICT", ["LlamaDecoderLayer"], True)
    for text, message in [("fsdp_config:\n  offload_params: true\n", "offload_params: True (CPU offload"),
                          ("fsdp_config:\n  fsdp_offload_params: true\n",
                           "fsdp_offload_params: True (CPU offload"),
                          ("fsdp: [full_shard, offload]\n", "fsdp: offload (CPU offload"),
                          ("fsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: MistralDecoderLayer\n",
                           "only [LlamaDecoderLayer] units"),
                          ("fsdp_config:\n  sharding_strategy: SHARD_GRAD_OP\n",
                           "SHARD_GRAD_OP' is not supported")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(str(path))
    path.write_text("fsdp: [full_shard, auto_wrap]\n")
    assert load_config(str(path)).fsdp.wrap == ["LlamaDecoderLayer"]


def test_num_epochs_gives_max_steps_from_the_dataset(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_epochs: 2.5\n")
    cfg = load_config(str(path))
    assert cfg.max_steps is None
    notes = []
    cfg.global_batch_size = 16
    config_keys.resolve_max_steps(cfg, 1000, notes)
    assert cfg.max_steps == 157 and "ceil(2.5 x 1000 samples per epoch / global batch 16) = 157" in notes[0]
    with pytest.raises(ValueError, match="num_epochs must be > 0"):
        load_config(DEFAULT, ["--num_epochs", "0"])


# ------------------------------------------------------------------ 4. one run per output_dir
HOLD = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("run_lock", sys.argv[3])   # the file alone: no torch import
run_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
run_lock.acquire(sys.argv[1], 0)
print("held", flush=True)
if sys.argv[2] == "die":
    os._exit(0)                 # no release: the lock of a dead process stays behind
time.sleep(120)
"""


def _holder(out, mode):
    # another launch: its own torchrun rendezvous (forked test ranks share the holder's parent,
    # pytest, which would make it look like their own launch)
    env = dict(os.environ, PYTHONPATH=ROOT, MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",
               TORCHELASTIC_RUN_ID="other")
    proc = subprocess.Popen([PY, "-c", HOLD, str(out), mode, run_lock.__file__], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_run_is_refused_on_every_rank_naming_the_holder(tmp_path):
    out = tmp_path / "run"
    holder = _holder(out, "live")
    try:
        errors = run_world(_error, 2, [DEFAULT, *TINY, "--output_dir", str(out)], timeout=60)
        for e in errors:
            assert f"output_dir {out} is in use by another run: pid {holder.pid} on {run_lock.host()}" in e, e
    finally:
        holder.kill()
        holder.wait()
    assert json.loads((out / "minipar.lock").read_text())["pid"] == holder.pid   # untouched by the refusal


def test_dead_holder_is_taken_over_with_a_note_and_released_at_the_end(tmp_path):
    out = tmp_path / "run"
    dead = _holder(out, "die")
    dead.wait()
    got = run_world(_train, 1, [DEFAULT, *TINY, "--output_dir", str(out), "--max_steps", "2"], timeout=120)[0]
    assert got["steps"] == [1, 2]
    assert any(f"took over {out / 'minipar.lock'} from pid {dead.pid}" in n
               for n in got["notes"]), got["notes"]
    assert not (out / "minipar.lock").exists(), "the lock is released when the run ends"


RACE = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("run_lock", sys.argv[3])   # the file alone: no torch import
run_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
me, gate, n = sys.argv[4], sys.argv[2], int(sys.argv[5])
open(os.path.join(gate, "ready-" + me), "w").close()
deadline = time.time() + 50
while len([f for f in os.listdir(gate) if f.startswith("ready-")]) < n and time.time() < deadline:
    pass                        # every launch spins here until all have started: then all go at once
try:
    run_lock.acquire(sys.argv[1], 0)
    print("took", flush=True)
    while len([f for f in os.listdir(gate) if f.startswith("looked-")]) < n - 1 and time.time() < deadline:
        time.sleep(0.01)        # held until every other launch has looked
except ValueError as e:
    print("refused" if "is in use by another run" in str(e) else e, flush=True)
    open(os.path.join(gate, "looked-" + me), "w").close()
"""


def test_rank_0s_starting_at_one_moment_one_takes_the_lock(tmp_path):
    """The read-decide-write of the lock under filelock's guard: of 4 launches starting into one
    output_dir at the same moment, one takes it and 3 refuse; nothing is left behind at the end."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    procs = [subprocess.Popen([PY, "-c", RACE, str(out), str(gate), run_lock.__file__, str(i), "4"],
                              text=True, stdout=subprocess.PIPE, env=dict(os.environ, MASTER_ADDR="127.0.0.1",
                                                                MASTER_PORT=str(29100 + i)))
             for i in range(4)]
    said = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert said == ["refused"] * 3 + ["took"], said
    assert os.listdir(out) == [], os.listdir(out)


def test_cleanup_never_touches_a_live_runs_temporary_directories(tmp_path):
    live = _holder(tmp_path / "elsewhere", "live")          # any live process on this host
    dead = subprocess.Popen([PY, "-c", "pass"])
    dead.wait()
    try:
        mine = cio.temp_dir_for(str(tmp_path / "step-4"), 1)                 # this process: a save in flight
        other_live = cio.temp_dir_for(str(tmp_path / "step-5"), 2, cio.owner_tag(pid=live.pid))
        other_dead = cio.temp_dir_for(str(tmp_path / "step-6"), 3, cio.owner_tag(pid=dead.pid))
        old_live = other_live.replace(".tmp-", ".old-")
        for d in (mine, other_live, other_dead, old_live):
            os.makedirs(d)
        cio.clean_stale(str(tmp_path), keep=mine)
        assert os.path.isdir(mine) and os.path.isdir(other_live) and os.path.isdir(old_live)
        assert not os.path.exists(other_dead)
        assert not os.path.exists(tmp_path / "step-5"), "a live run's .old- copy is not put back under it"
    finally:
        live.kill()
        live.wait()
    cio.clean_stale(str(tmp_path), keep=mine)
    assert not os.path.exists(other_live) and os.path.isdir(tmp_path / "step-5")   # owner gone: cleaned


# ------------------------------------------------------------------ 5. writability before step 1
def test_output_dir_under_a_regular_file_is_refused_before_step_one(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for key, value in [("--output_dir", blocker / "out"),
                       ("--metrics_file", blocker / "m" / "metrics.jsonl")]:
        errors = run_world(_error, 2, [DEFAULT, *TINY, "--output_dir", str(tmp_path / "o"), key, str(value)],
                           timeout=60)
        name = key[2:]
        for e in errors:
            assert e.startswith(f"{name} '{value.parent if name == 'metrics_file' else value}' cannot be "
                                f"written: {blocker} is a regular file"), e
    # train.py: one line, exit 2
    proc = run_program(os.path.join(ROOT, "train.py"), [*TINY, "--output_dir", str(blocker / "out")],
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "is a regular file" in proc.stderr


def _check_as_nobody(directory):
    """check_writable in a child that dropped root (root writes through chmod 0o555)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            run_lock.check_writable(os.path.join(directory, "out"), os.path.join(directory, "out", "m.jsonl"))
            code = 0
        except ValueError as e:
            code = 1 if "cannot be written: Permission denied" in str(e) else 2
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_read_only_output_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    tmp_path.chmod(0o755)
    try:
        if os.geteuid() != 0:
            with pytest.raises(ValueError, match="cannot be written: Permission denied"):
                run_lock.check_writable(str(ro / "out"), str(ro / "out" / "m.jsonl"))
        else:
            # as root chmod blocks nothing: drop to `nobody` in a forked child to test the real thing
            assert _check_as_nobody(str(ro)) == 1
    finally:
        ro.chmod(0o755)
    # a file system that refuses everyone, root included (procfs)
    with pytest.raises(ValueError, match=r"output_dir '/proc/minipar-test/out' cannot be written"):
        run_lock.check_writable("/proc/minipar-test/out", "/proc/minipar-test/out/metrics.jsonl")


# ------------------------------------------------------------------ 9. checkpoints run no code
class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _tiny_checkpoint(path):
    from minipar import lr_schedule
    from minipar import optim as moptim
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))
    opt = moptim.build_optimizer(model, lr=1e-3)
    sched = lr_schedule.build_scheduler(opt, 1, 10)
    ck.save_checkpoint(str(path), model, opt, model.pgm, step=1, scheduler=sched,
                       extra=dict(step=1, note="x"))
    return model, opt, sched


def test_a_pickle_that_runs_a_command_is_refused_and_does_not_run(tmp_path):
    step = tmp_path / "step-1"
    model, opt, sched = _tiny_checkpoint(step)
    # plain data loads
    assert ck.load_checkpoint(str(step), model, opt, model.pgm, scheduler=sched)["note"] == "x"
    marker = tmp_path / "pwned"
    state = torch.load(step / ck.TRAINER_STATE, weights_only=True)
    evil = ck_files.to_bytes(dict(state, extra=_RunsCode(str(marker))))     # all else as saved
    (step / ck.TRAINER_STATE).write_bytes(evil)
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"][ck.TRAINER_STATE] = dict(bytes=len(evil),
                                               sha256=verify.sha256_file(str(step / ck.TRAINER_STATE)))
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"trainer_state\.pt holds more than tensors and plain data"
                                         r".*refused"):
        ck.load_checkpoint(str(step), model, opt, model.pgm, scheduler=sched)
    assert not marker.exists(), "the command ran"


# ------------------------------------------------------------------ 10. smaller ones
def test_latest_skips_a_truncated_and_a_bit_flipped_newest_checkpoint(tmp_path):
    for s in (1, 2, 3):
        _tiny_checkpoint(tmp_path / f"step-{s}")
    flipped = tmp_path / "step-3" / ck.TRAINER_STATE
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated = tmp_path / "step-2" / "rng" / "rank-00000.pt"
    truncated.write_bytes(truncated.read_bytes()[:10])
    path, skipped = verify.find_latest_verified(str(tmp_path))
    assert path == str(tmp_path / "step-1")
    assert [p for p, _ in skipped] == [str(tmp_path / "step-3"), str(tmp_path / "step-2")]
    assert "sha256" in skipped[0][1] and "truncated" in skipped[1][1]


def test_resume_drops_a_partial_metrics_line_and_skips_a_damaged_latest(tmp_path, capfd):
    out = tmp_path / "run"
    base = [DEFAULT, *TINY, "--output_dir", str(out), "--save_steps", "1", "--save_total_limit", "0"]
    run_world(_train, 1, [*base, "--max_steps", "3"], timeout=120)
    data = bytearray((out / "step-3" / ck.TRAINER_STATE).read_bytes())
    data[len(data) // 2] ^= 0x01
    (out / "step-3" / ck.TRAINER_STATE).write_bytes(bytes(data))
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 5.1')                 # a write cut short by a crash
    capfd.readouterr()
    got = run_world(_train, 1, [*base, "--max_steps", "4", "--resume_from_checkpoint", "latest"],
                    timeout=120)[0]
    printed = capfd.readouterr().out
    assert got["steps"] == [1, 2, 3, 4]                    # step 2's lines kept, 3 and 4 trained again
    assert f"skips {out / 'step-3'}" in printed and "sha256" in printed, printed
    assert f"{out / 'metrics.jsonl'}: dropped 1 unreadable line(s) (line 4" in printed, printed
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_world_size_hint_suggests_a_launch_that_fits(tmp_path, monkeypatch):
    argv = ["--tensor_parallel_size", "2", "--output_dir", str(tmp_path), *TINY[:10]]
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError) as info:
        setup_run(argv)
    launches = re.findall(r"`torchrun --nproc-per-node (\d+) train\.py([^`]*)`", str(info.value))
    assert [n for n, _ in launches] == ["2", "4"], str(info.value)
    # no groups: check the layout only
    monkeypatch.setattr(minipar, "init", lambda config, **kw: config)
    monkeypatch.setattr(lifecycle, "check_same_config", lambda cfg, pgm: None)   # (its digest needs a world)
    for n, args in launches:
        monkeypatch.setenv("WORLD_SIZE", n)
        run = setup_run(shlex.split(args))
        assert run.pgm.tp_size == 2 and run.pgm.total_size == int(n)
        run.lock.release()


def test_negative_steps_and_bare_booleans():
    for key in ("save_steps", "eval_steps"):
        with pytest.raises(ValueError, match=f"{key} must be >= 0"):
            load_config(DEFAULT, [f"--{key}", "-5"])
    with pytest.raises(ValueError) as info:
        load_config(DEFAULT, ["--sequence_parallel", "--max_steps", "3"])
    assert "--sequence_parallel true" in str(info.value) and "20" not in str(info.value)


def test_python_m_mesh_prints_no_runtime_warning():
    proc = subprocess.run([PY, "-m", "minipar.mesh", "--tp", "2"], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert proc.returncode == 0 and "2 ranks" in proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------ 11. API traps
def _grads_without_num_items(shape):
    from tiny_llama import CFG, tiny_batch

    from minipar.context_parallel import zigzag_shard
    from minipar.data_parallel import replicate
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    pgm = minipar.init(minipar.ParallelismConfig(*shape))
    model = LlamaForCausalLM(LlamaConfig(**CFG), pgm, seed=0)
    replicate(model, pgm.dp_cp)
    ids, labels = tiny_batch(0)
    rows = slice(pgm.dp.rank * len(ids) // pgm.dp.size, (pgm.dp.rank + 1) * len(ids) // pgm.dp.size)
    model(zigzag_shard(ids[rows], 1, pgm.cp), labels=zigzag_shard(labels[rows], 1, pgm.cp)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("shape", [(2, 1, 1, 1), (1, 1, 2, 1)], ids=["dp2", "cp2"])
def test_loss_without_num_items_in_batch_gives_single_process_grads(shape):
    from tiny_llama import CFG, tiny_batch

    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    ref = LlamaForCausalLM(LlamaConfig(**CFG), seed=0)
    ids, labels = tiny_batch(0)
    ref(ids, labels=labels).backward()
    for got in run_world(_grads_without_num_items, 2, shape, timeout=60):
        for n, p in ref.named_parameters():
            torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)
