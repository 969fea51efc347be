"""The pipelined forward-only pass (minipar/pipeline_parallel/executor.py's forward_only over a list).

M = 4 micro-batches through pp 2 (1F1B's placement), pp 2 interleaved (2 chunks) and pp 2 zbv (the V)
in one pipelined pass equal, per micro-batch, M passes of one micro-batch each (the former
forward_only, its M = 1 case) exactly, in float64, with one num_items_in_batch for all or one each
and micro-batches of different lengths; the recorded posts replay under NCCL's rules
(tests/nccl_replay.py), and each rank sends M x (its chunks' boundaries that cross ranks)
activations, the bytes the ledger counts. The head (where DPO's recording PairLoss reads its rows)
sees each micro-batch's labels, in order. Also pp 2 x tp 2 with sequence parallelism (4 ranks,
~2 s). Pure: forward_order is the F's of AFAB and of interleaved_1f1b, and forward_span prices
what the planner uses.
"""
import pytest
import torch
from harness import run_world
from nccl_replay import Recording, replay

import minipar
from minipar import comm_ledger
from minipar.config import ParallelismConfig
from minipar.pipeline_parallel import (
    build_stage,
    forward_only,
    forward_order,
    forward_span,
    schedule_order,
)
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

M, T = 4, 8


def _pass(schedule, tp=1, sp=False):
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    pgm = minipar.init(ParallelismConfig(pp_size=2, tp_size=tp, dp_shard_size=1, sequence_parallel=sp))
    v = 2 if schedule in ("interleaved_1f1b", "zbv") else 1
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
    stage = build_stage(LlamaForCausalLM(cfg, pgm, seed=0), pgm, v, None, schedule).eval()
    gen = torch.Generator().manual_seed(0)
    lengths = [T, T, 2 * T, T]                     # a longer micro-batch: the link's buffers per micro
    micro = [dict(input_ids=torch.randint(0, 64, (2, n), generator=gen),
                  labels=torch.randint(0, 64, (2, n), generator=gen),
                  position_ids=torch.arange(n).expand(2, -1)) for n in lengths]
    one_by_one = [forward_only(stage, pgm, mb, 16, act_dtype=torch.float64) for mb in micro]
    rec = Recording()
    with comm_ledger.ledger() as led:
        together = forward_only(stage, pgm, micro, 16, act_dtype=torch.float64, transport=rec)
    each = forward_only(stage, pgm, micro, [16, 32, 16, 8], act_dtype=torch.float64)
    head = _HeadLabels(stage)
    forward_only(stage, pgm, micro, 16, act_dtype=torch.float64)
    order = [next(i for i, mb in enumerate(micro) if mb["labels"] is lab) for lab in head.seen]
    head.remove()
    return dict(rank=pgm.pp.rank, one=torch.stack(one_by_one), together=together, each=each,
                events=rec.events, sent=led.total_bytes("send"), heads=order, last=stage.is_last)


class _HeadLabels:
    """Which micro-batch's labels reach the head, in order (the stage's forward wrapped)."""

    def __init__(self, stage):
        self.stage, self.seen, self.forward = stage, [], stage.forward

        def forward(x, position_ids, labels=None, num_items_in_batch=None, chunk=0, document_ids=None):
            if stage.is_last_virtual(chunk):
                self.seen.append(labels)
            return self.forward(x, position_ids, labels, num_items_in_batch, chunk, document_ids)
        stage.forward = forward

    def remove(self):
        del self.stage.forward


def _check(got, schedule, crossing):
    for r in got:
        assert r["together"].dtype == torch.float64 and r["together"].shape == (M,)
        assert torch.equal(r["together"], r["one"]), schedule            # per micro-batch, exactly
        if r["last"]:
            assert (r["together"] != 0).all()
            assert torch.allclose(r["each"], r["one"] * torch.tensor([1, 0.5, 1, 2]), rtol=1e-12)
            assert r["heads"] == list(range(M))                          # each micro-batch, in order
        else:
            assert (r["together"] == 0).all() and r["heads"] == []
    traces = {r["rank"]: r["events"] for r in got}
    posts = sum(e[0] == "post" for ev in traces.values() for e in ev)
    for streams in ("rank", "peer"):
        assert replay(traces, streams) == posts > 0
    # each rank sends each micro-batch's h once per chunk boundary it holds that crosses ranks
    h = 2 * 32 * 8 * (T + T + 2 * T + T)            # float64 bytes of the four micro-batches' h
    for r in got:
        sends = [op for e in r["events"] if e[0] == "post" for op in e[2] if op[0] == "send"]
        assert len(sends) == M * crossing[r["rank"]], (schedule, r["rank"])
        assert r["sent"] == crossing[r["rank"]] * h


@pytest.mark.parametrize("schedule,crossing", [("1f1b", (1, 0)), ("interleaved_1f1b", (2, 1)),
                                               ("zbv", (1, 1))])
def test_pipelined_forward_equals_one_micro_batch_at_a_time(schedule, crossing):
    _check(run_world(_pass, 2, schedule, timeout=120), schedule, crossing)


def test_pipelined_forward_on_pp2_tp2_sp():
    got = run_world(_pass, 4, "1f1b", 2, True, timeout=240)
    for r in got:             # tp ranks of a stage send their own sequence half: h / 2 each
        r["sent"] *= 2
    _check(got, "1f1b-tp2-sp", (1, 0))


def test_forward_order_is_the_forward_half_of_afab_and_interleaved():
    for p in (2, 3, 4):
        for m in (1, p, 2 * p + 1):
            for r in range(p):
                assert forward_order("afab", p, m, r) == [a for a in schedule_order("afab", p, m, r)
                                                          if a.kind == "F"]
                assert forward_order("1f1b", p, m, r) == forward_order("afab", p, m, r)
                if m % p == 0:
                    assert forward_order("interleaved_1f1b", p, m, r, 2) == \
                        [a for a in schedule_order("interleaved_1f1b", p, m, r, 2) if a.kind == "F"]
            assert forward_span("1f1b", p, m) == m + p - 1          # was m p, one micro-batch at a time
            assert forward_span("zbv", p, m, 2) == m + p - 1
            if m % p == 0:
                assert forward_span("interleaved_1f1b", p, m, 2) == (2 * m + p - 1) / 2
