"""tests/harness.py: a failing rank fails the world with its traceback, a deadlock times out."""

import time

import pytest
import torch
import torch.distributed as dist
from harness import RankError, WorldTimeout, run_world


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def test_results_from_every_rank():
    assert run_world(_sum_ranks, 4) == [6.0] * 4


def _raise_on_rank_2():
    if dist.get_rank() == 2:
        raise KeyError("boom on two")
    dist.barrier()          # the others wait for rank 2, which never comes


def test_rank_error_carries_traceback():
    with pytest.raises(RankError) as info:
        run_world(_raise_on_rank_2, 4, timeout=30)
    assert "rank 2 of 4" in str(info.value) and "boom on two" in str(info.value)


def _deadlock():
    t = torch.zeros(1)
    dist.recv(t, src=1 - dist.get_rank())   # both ranks wait for the other: a classic deadlock


def test_deadlock_fails_by_timeout():
    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        run_world(_deadlock, 2, timeout=1)
    assert "[0, 1]" in str(info.value)
    assert time.monotonic() - start < 20


def test_sixteen_ranks_start_quickly():
    start = time.monotonic()
    assert run_world(_sum_ranks, 16) == [120.0] * 16
    assert time.monotonic() - start < 60   # a generous bound: this checks the harness works, not speed
