"""The environment a GPU run needs (minipar/cuda_env.py), its rules tested without a GPU: the
environment and the facts about CUDA are arguments; and the summary's memory lines."""
import os

import pytest

from minipar import cuda_env
from minipar.trainer.run_summary import memory_lines


@pytest.mark.parametrize("env,visible,want", [
    (dict(LOCAL_RANK="3"), 8, 3),                                   # torchrun on an 8-GPU node
    (dict(), 8, 0),                                                 # one process
    (dict(LOCAL_RANK="5", CUDA_VISIBLE_DEVICES="5"), 1, 0),         # a scheduler gave each its own GPU
])
def test_local_rank_maps_onto_the_visible_devices(env, visible, want):
    assert cuda_env.device_index(env, visible) == want


@pytest.mark.parametrize("env,visible,match", [
    (dict(LOCAL_RANK="4"), 4, r"LOCAL_RANK=4, but this process sees 4 CUDA device\(s\) \(all of the node's\)"
                              r".*--nproc-per-node 4"),
    (dict(LOCAL_RANK="2", CUDA_VISIBLE_DEVICES="0,1"), 2, r"CUDA_VISIBLE_DEVICES='0,1'"),
    (dict(LOCAL_RANK="1"), 1, r"sees 1 CUDA device"),               # two processes, one GPU, no binding
])
def test_two_processes_on_one_gpu_are_refused(env, visible, match):
    with pytest.raises(ValueError, match=match):
        cuda_env.device_index(env, visible)


def test_max_connections_set_before_cuda_starts_or_refused_with_the_line():
    env = {}
    notes = cuda_env.settle(env, tp_async_overlap=True, cuda_started=False, torch_version="2.13.0")
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} and len(notes) == 1
    for env, started, why in [({}, True, "CUDA started before"),
                              ({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, False, "it is '8'")]:
        with pytest.raises(ValueError, match=f"{why}.*add `export CUDA_DEVICE_MAX_CONNECTIONS=1`"):
            cuda_env.settle(env, tp_async_overlap=True, cuda_started=started, torch_version="2.13.0")
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}                     # already right: nothing to do
    assert cuda_env.settle(env, tp_async_overlap=True, cuda_started=True, torch_version="2.13.0") == []
    env = {}                                                        # no overlap: left alone
    assert cuda_env.settle(env, tp_async_overlap=False, cuda_started=True, torch_version="2.13.0") == [] \
        and env == {}


@pytest.mark.parametrize("version,env,want", [
    ("2.4.1+cu121", {}, "1"), ("2.7.0", {}, "1"),                  # torch that records streams: set
    ("2.8.0", {}, None), ("2.13.0.dev20260101", {}, None),          # stashes by default: left unset
    ("2.5.0", {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}, "0"),       # the launch's own value is kept
])
def test_avoid_record_streams_on_the_torch_versions_that_record(version, env, want):
    cuda_env.settle(env, tp_async_overlap=False, cuda_started=False, torch_version=version)
    assert env.get("TORCH_NCCL_AVOID_RECORD_STREAMS") == want


def test_cpu_run_is_left_alone():
    env = {"LOCAL_RANK": "7"}
    assert cuda_env.prepare(True, env) == [] and env == {"LOCAL_RANK": "7"}   # (no CUDA here)


def test_summary_reports_reserved_beside_allocated():
    assert memory_lines([[1000.4, 1200.0], [990.0, 1300.6]], cuda=True) == [
        "peak CUDA memory allocated per rank (MiB): r0=1000 r1=990",
        "peak CUDA memory reserved per rank (MiB): r0=1200 r1=1301"]
    assert memory_lines([[300.0], [310.0]], cuda=False) == \
        ["peak resident memory per rank (MiB): r0=300 r1=310"]


def test_bf16_auto_sets_max_connections_before_it_asks_the_device(monkeypatch):
    """bf16: auto asks the device whether it has bfloat16, which starts CUDA: with async TP the
    variable must already be set then (else minipar.init would have to refuse the run)."""
    import torch

    from minipar.trainer.config.train_config import REPO_ROOT, load_config
    seen = []
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("TORCH_NCCL_AVOID_RECORD_STREAMS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda: seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")) or True)
    argv = ["--bf16", "auto", "--tensor_parallel_size", "2", "--tp_async_overlap", "true"]
    cfg = load_config(os.path.join(REPO_ROOT, "configs", "default.yaml"), argv)
    assert cfg.dtype == "bfloat16" and seen == ["1"]
