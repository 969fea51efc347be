"""Data parallelism (minipar/data_parallel/ddp.py) against one process: same weights, same global batch."""
import functools

import pytest
import torch
import torch.nn as nn
from harness import run_world
from tiny_llama import CFG, B
from tiny_llama import tiny_batch as _batch

import minipar
from minipar import ParallelismConfig, comm, comm_ledger
from minipar.data_parallel import replicate
from minipar.optim import build_optimizer
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig


def _train(shape=None, steps=5, micro=1, no_sync=True, tied=False, bucket_size_mb=25):
    pgm = minipar.init(ParallelismConfig(*shape)) if shape else None
    model = LlamaForCausalLM(LlamaConfig(**dict(CFG, tie_word_embeddings=tied)), pgm, seed=0)
    dim = model.pgm.dp_cp
    sync = replicate(model, dim, bucket_size_mb=bucket_size_mb) if shape else None
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    per = B // dim.size // micro
    losses, comm_per_micro = [], []
    for step in range(steps):
        ids, labels = _batch(step)
        n = (labels != -100).sum()
        total = torch.zeros((), dtype=torch.float64)
        for m in range(micro):
            rows = slice((dim.rank * micro + m) * per, (dim.rank * micro + m + 1) * per)
            quiet = sync is not None and no_sync and m < micro - 1
            with comm_ledger.ledger() as led, (sync.no_sync() if quiet else torch.enable_grad()):
                loss = model(ids[rows], labels=labels[rows], num_items_in_batch=n)
                loss.backward()
            comm_per_micro.append(led.count())
            total += loss.detach().double()
        if step == 0:                # Adam hides a wrong gradient scale: compare gradients too
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(comm.all_reduce(total, dim).item())
    return dict(losses=losses, params=model.full_state_dict(), grads=grads, comm=comm_per_micro)


@functools.lru_cache(maxsize=None)
def _reference(tied=False):
    return _train(tied=tied)


def _compare(got, want, atol=1e-5):
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    for name, w in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], w, atol=1e-7, rtol=1e-5, msg=name)
    for name, w in want["params"].items():
        torch.testing.assert_close(got["params"][name], w, atol=atol, rtol=0, msg=name)


@pytest.mark.parametrize("tied", [False, True])
def test_ddp_on_four_replicas_equals_one_process(tied):
    for got in run_world(_train, 4, (4, 1, 1, 1), tied=tied, timeout=120):
        _compare(got, _reference(tied))


@pytest.mark.parametrize("no_sync", [True, False])
def test_gradient_accumulation_equals_one_big_batch(no_sync):
    """2 micro-batches of 1 row per replica (4 replicas) = 1 batch of 2 rows = one process. With
    no_sync only the last micro-batch communicates; without, each does and the result is the same."""
    got = run_world(_train, 4, (4, 1, 1, 1), micro=2, no_sync=no_sync, timeout=120)
    for g in got:
        _compare(g, _reference())
    assert got[0]["comm"][0::2] == ([0] * 5 if no_sync else got[0]["comm"][1::2])
    assert all(c > 0 for c in got[0]["comm"][1::2])


def _buckets_world():
    pgm = minipar.init(ParallelismConfig(dp_replicate_size=2))
    model = LlamaForCausalLM(LlamaConfig(**CFG), pgm, seed=0)
    sync = replicate(model, pgm.dp_replicate, bucket_size_mb=0.02)      # ~20 KB: several buckets
    ids, labels = _batch(0)
    with comm_ledger.ledger() as led:
        model(ids[pgm.dp.rank::2], labels=labels[pgm.dp.rank::2],
              num_items_in_batch=(labels != -100).sum()).backward()
    params = [p for p in model.parameters()]
    return dict(events=[e if isinstance(e, str) else (e.op, e.group, e.bytes) for e in led.events],
                buckets=[[[id(q) for q in params].index(id(p)) for p in b.params] for b in sync.buckets],
                grad_bytes=sum(p.numel() * 4 for p in params), n=len(params),
                grads=[p.grad for p in params])


def test_buckets_in_reverse_order_launched_during_backward():
    r0, r1 = run_world(_buckets_world, 2, timeout=120)
    buckets, ev = r0["buckets"], r0["events"]
    assert len(buckets) >= 3
    assert [i for b in buckets for i in b] == list(range(r0["n"]))[::-1]      # reverse order, each once
    records = [e for e in ev if not isinstance(e, str)]
    assert [op for op, _, _ in records] == ["all_reduce"] * len(buckets)
    assert {g for _, g, _ in records} == {"dp_replicate"}
    assert sum(b for _, _, b in records) == r0["grad_bytes"] + 4 * r0["n"]     # + one used flag each
    # overlap: the buckets went out while backward was still running, not at its end
    end = ev.index("grad_sync.end_of_backward")
    assert sum(1 for e in ev[:end] if not isinstance(e, str)) == len(buckets)
    for a, b in zip(r0["grads"], r1["grads"]):                                  # replicas agree
        assert torch.equal(a, b)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.extra, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_extra):
        h = self.a(x)
        return (self.extra(h) if use_extra else h).pow(2).sum()


def _branchy_world():
    pgm = minipar.init(ParallelismConfig(dp_replicate_size=2))
    model = Branchy()
    replicate(model, pgm.dp_replicate, bucket_size_mb=1e-4)    # one parameter per bucket
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    model(x[2 * pgm.dp.rank:2 * pgm.dp.rank + 2], use_extra=pgm.dp.rank == 0).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_parameters_without_grad_do_not_hang():
    """`extra` gets a gradient on rank 0 only, `never` on no rank: the step finishes, both
    replicas hold the single-process gradient, and `never` keeps grad None as on one process
    (a zero gradient would let AdamW decay it)."""
    ref = Branchy()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    (ref(x[:2], True) + ref(x[2:], False)).backward()
    assert ref.never.weight.grad is None
    for got in run_world(_branchy_world, 2, timeout=60):
        for n, p in ref.named_parameters():
            if p.grad is None:
                assert got[n] is None, n
            else:
                torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-6, msg=n)


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="bucket_size_mb"):
        replicate(Branchy(), minipar.ProcessGroupManager.local().dp_replicate, bucket_size_mb=0)
