"""How a run ends, stops and fails across ranks (issue 10): clean exits, agreement on the config,
stuck peers, preemption, several launchers. The real-launch proofs (torchrun) are slow-marked and
each has a forked twin here."""
import json
import multiprocessing as mp
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import harness
import pytest
import torch
from harness import run_world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TINY = ["--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "16",
        "--global_batch_size", "4", "--max_steps", "12", "--warmup_steps", "2", "--eval_steps", "0",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--logging_steps", "100", "--progress_bar", "false", "--save_steps", "0",
        "--save_final_checkpoint", "false", "--export_hf", "false",
        "--dataset", os.path.join(ROOT, "data", "shakespeare.txt")]

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _argv(out, *extra):
    # no config file: the sizes given (every test gives some) replace the default layout
    return [*TINY, "--output_dir", str(out), *extra]


def _curve(history):
    return [(r["step"], r["loss"]) for r in history]


def _train(argv):
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    return _curve(Trainer(setup_run(argv)).train())


def _same_after(full, resumed, step):
    tail = [h for h in full if h[0] > step]
    resumed = [h for h in resumed if h[0] > step]            # (the history also holds the kept lines)
    assert [h[0] for h in resumed] == [h[0] for h in tail], (resumed, tail)
    for (s, a), (_, b) in zip(tail, resumed):
        assert abs(a - b) <= 1e-6 * abs(a), f"step {s}: resumed loss {b} vs uninterrupted {a}"


# ---------------------------------------------------------------- 1. a finished run exits cleanly
def _distributed_threads() -> list:
    """The names of this process's torch.distributed threads: gloo's workers and I/O loops, the
    TCPStore server."""
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n or "nccl" in n)


def _main_then_list_threads(port, argv):
    """train.py's main on a world made from the environment, as torchrun makes it; then the
    threads left. A gloo group alive at interpreter exit may have a worker thread drop the last
    reference to a finished work's tensor during shutdown: SIGABRT, 'terminate called without
    an active exception' (seen in about 1 of 4 8-rank torchrun runs)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, ROOT)
    import train
    train.main(argv)
    import torch.distributed as dist
    return _distributed_threads(), dist.is_initialized()


def test_teardown_leaves_no_distributed_thread(tmp_path):
    # ZeRO-3 x TP: async gathers and reduce-scatters, a save and an export at the end
    argv = _argv(tmp_path, "--max_steps", "1", "--dp_shard_size", "2", "--tensor_parallel_size", "2",
                 "--save_final_checkpoint", "true", "--export_hf", "true")
    for threads, initialized in run_world(_main_then_list_threads, 4, _free_port(), argv, init=False,
                                          timeout=300):
        assert not initialized
        assert threads == [], f"still alive after train.main: {threads} (a group not destroyed)"


@pytest.mark.slow
def test_soak_short(tmp_path):
    # benchmarks/soak.py, shortened: real torchrun launches of 8 ranks, every one must exit 0 (its
    # table written under tmp_path: a test leaves the checkout's results as they are)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import soak
    assert soak.main(["--runs", "5", "--name", "soak-test", "--results", str(tmp_path)]) == 0
    assert "| 5 | 5 | 0 |" in (tmp_path / "soak-test.md").read_text()


# --------------------------------------------------------------- 6. ranks started with other flags
def _setup_error(argv):
    from minipar.trainer.run_setup import setup_run
    rank = int(os.environ["RANK"])
    try:
        setup_run(argv + ["--max_steps", str(10 + rank)] + (["--learning_rate", "0.01"] if rank == 2 else []))
    except ValueError as err:
        return str(err)
    return "no error"


def test_ranks_with_different_configs_all_refuse(tmp_path):
    errors = run_world(_setup_error, 4, _argv(tmp_path, "--tensor_parallel_size", "2"), timeout=120)
    for e in errors:
        assert "different configs" in e, e
        assert "max_steps (10 on rank 0; 11 on rank 1; 12 on rank 2; 13 on rank 3)" in e, e
        assert "learning_rate" in e and "0.01 on rank 2" in e, e
        assert "warmup_steps" not in e
    assert len(set(errors)) == 1                     # the same message on every rank


# ------------------------------------------------------------------------- 7. a stuck peer
def _group_timeouts(argv):
    from minipar.trainer.run_setup import setup_run
    pgm = setup_run(argv).pgm
    return {name: dim.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, dim in pgm.dims.items() if dim.size > 1}


def test_ddp_timeout_reaches_every_group(tmp_path):
    argv = _argv(tmp_path, "--ddp_timeout", "7", "--dp_shard_size", "2", "--tensor_parallel_size", "2")
    timeouts = run_world(_group_timeouts, 4, argv, timeout=120)[0]
    assert timeouts and set(timeouts.values()) == {7.0}, timeouts


def _stop_at(port, argv, rank_to_stop, step_to_stop, mark):
    """A rank SIGSTOPs itself at the start of a step (a hung GPU, a swapped-out node); the others
    must fail within ddp_timeout with an error naming the collective."""
    from minipar.trainer.trainer import Trainer
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    original = Trainer.train_step

    def train_step(self, step):
        if step == step_to_stop and self.pgm.global_rank == rank_to_stop:
            open(mark, "w").write(str(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        return original(self, step)

    Trainer.train_step = train_step
    return _train(argv)


def test_stuck_peer_fails_the_others_within_ddp_timeout(tmp_path):
    timeout_s, world, stuck = 3, 2, 1
    argv = _argv(tmp_path, "--ddp_timeout", str(timeout_s), "--dp_shard_size", "2", "--max_steps", "4")
    tmp, mark, port = str(tmp_path), str(tmp_path / "stopped"), _free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=harness._worker, daemon=True,
                         args=(_stop_at, r, world, tmp, (port, argv, stuck, 2, mark), {}, 120, False))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 180
        while any(p.exitcode is None for i, p in enumerate(procs) if i != stuck) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = time.time()
        assert os.path.exists(mark), "the rank never stopped"
        assert procs[stuck].exitcode is None                          # still stopped
        waited = ended - float(open(mark).read())
        for r in range(world):
            if r == stuck:
                continue
            assert procs[r].exitcode == 1, f"rank {r} exit {procs[r].exitcode}"
            text = open(os.path.join(tmp, f"error{r}.txt")).read()
            assert "CollectiveError" in text, text
            assert re.search(r"(all_gather|reduce_scatter|all_reduce|send_recv|broadcast|barrier) over "
                             r"(tp|dp_shard_cp|dp_cp|dp|world|cp)", text), text
        assert waited < timeout_s + 20, \
            f"the others took {waited:.1f} s to give up (ddp_timeout {timeout_s} s)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()                                              # SIGKILL ends a stopped process too
            p.join(timeout=10)


# --------------------------------------------------------------------------- 8. preemption
def _train_signalled(argv, rank_to_signal, step_to_signal):
    """Train; one rank gets SIGTERM in the middle of a step (as from a scheduler, whose signal
    reaches the ranks at different moments). Returns ('preempted', step, curve) or the curve."""
    from minipar.trainer import lifecycle
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    original = Trainer.train_step

    def train_step(self, step):
        if step == step_to_signal and self.pgm.global_rank == rank_to_signal:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, step)

    Trainer.train_step = train_step
    trainer = Trainer(setup_run(argv))
    try:
        trainer.train()
    except lifecycle.Preempted as stop:
        return ("preempted", stop.step, _curve(trainer.history))
    return ("finished", None, _curve(trainer.history))


def test_sigterm_saves_the_agreed_step_and_resume_is_exact(tmp_path):
    layout = ["--dp_shard_size", "2", "--max_steps", "7"]
    full = run_world(_train, 2, _argv(tmp_path / "full", *layout), timeout=300)[0]
    out = tmp_path / "run"
    # rank 1 is signalled during step 5 (index 4); rank 0 never is, yet both stop after step 6:
    # the flags of step 5 are summed while step 6 runs and read after it (lifecycle.StopFlag)
    got = run_world(_train_signalled, 2, _argv(out, *layout), 1, 4, timeout=300)
    assert [g[:2] for g in got] == [("preempted", 6)] * 2, got
    assert got[0][2] == full[:6]
    assert os.listdir(out / "step-6") and not (out / "step-7").exists()
    lines = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert [x["step"] for x in lines] == list(range(1, 7))
    resumed = run_world(_train, 2, _argv(out, *layout, "--resume_from_checkpoint", "latest"), timeout=300)[0]
    _same_after(full, resumed, 6)


def _wait_for_steps(path, n, proc, deadline):
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path) and sum(1 for line in open(path) if line.strip()) >= n:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_and_resumes(tmp_path):
    out = tmp_path / "run"
    # 400 steps of about 20 ms: the SIGTERM, sent once 3 steps are logged, lands seconds before the
    # end even when this process is scheduled late (with 40 the run could finish first)
    steps_in_run = "400"
    argv = _argv(out, "--dp_shard_size", "2", "--max_steps", steps_in_run)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node", "2",
                             os.path.join(ROOT, "train.py"), *argv],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait_for_steps(out / "metrics.jsonl", 3, proc, time.monotonic() + 300), proc.stdout.read()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = [json.loads(x)["step"] for x in open(out / "metrics.jsonl")]
    assert took < 30, f"{took:.0f} s after SIGTERM: past torchrun's 30 s grace period\n{text}"
    assert "forcefully" not in text, text                            # torchrun never had to SIGKILL
    assert (out / f"step-{steps[-1]}").is_dir(), text
    assert "stopped on SIGTERM" in text, text
    n = steps[-1]
    assert n < int(steps_in_run)
    full = run_world(_train, 2, _argv(tmp_path / "full", "--dp_shard_size", "2", "--max_steps", steps_in_run),
                     timeout=300)[0]
    resumed = run_world(_train, 2, _argv(out, "--dp_shard_size", "2", "--max_steps", steps_in_run,
                                         "--resume_from_checkpoint", "latest"), timeout=300)[0]
    _same_after(full, resumed, n)


# ---------------------------------------------------------------------- 12. several machines
SLURM = os.path.join(ROOT, "examples", "slurm.sbatch")


def _torchrun_lines(text):
    """The torchrun commands of a README or a shell script (continuation lines joined)."""
    text = text.replace("\\\n", " ")
    return [line[line.index("torchrun"):] for line in text.splitlines()
            if re.search(r"(^|\s|/)torchrun\s", line) and "--nnodes" in line]


def test_multi_node_launch_commands_parse():
    # the fast twin of the two-launcher test: the documented launches are valid torchrun commands
    # with a c10d rendezvous, and the SLURM script's layout fits 2 nodes x 8 GPUs
    from torch.distributed.run import get_args_parser
    readme = open(os.path.join(ROOT, "README.md")).read()
    commands = _torchrun_lines(readme) + _torchrun_lines(open(SLURM).read())
    assert len(commands) >= 2, commands
    for cmd in commands:
        words = shlex.split(cmd.replace("$", ""))[1:]
        args = get_args_parser().parse_args(words)
        assert args.rdzv_backend == "c10d" and args.rdzv_endpoint and args.nnodes, cmd
        assert args.training_script.endswith("train.py"), cmd
    slurm = open(SLURM).read()
    assert "srun" in slurm and "--resume_from_checkpoint latest" in slurm
    assert "--dp_shard_size 4 --tensor_parallel_size 2" in slurm and "GPUS_PER_NODE=8" in slurm


def _launcher(node_rank, port, out, argv):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [TORCHRUN, "--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
           "--rdzv-id", "minipar-test", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           os.path.join(ROOT, "train.py"), *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_two_launchers_equal_one_process(tmp_path):
    # two "nodes" of 2 ranks on localhost: dp_replicate 2 across them, tp 2 inside each
    run = ["--dp_replicate_size", "2", "--tensor_parallel_size", "2"]
    port = _free_port()
    procs = [_launcher(k, port, tmp_path / f"node{k}.log", _argv(tmp_path / "multi", *run)) for k in range(2)]
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join(open(tmp_path / f"node{k}.log").read()[-3000:] for k in range(2))
    assert codes == [0, 0], logs
    multi = [(x["step"], x["loss"]) for x in map(json.loads, open(tmp_path / "multi" / "metrics.jsonl"))]
    single = run_world(_train, 1, _argv(tmp_path / "single", "--tensor_parallel_size", "1"), timeout=300)[0]
    assert len(multi) == len(single) == 12
    for (s, a), (_, b) in zip(single, multi):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {s}: two launchers {b} vs one process {a}"
