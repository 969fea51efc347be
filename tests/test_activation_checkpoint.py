"""Selective activation checkpointing (models/activation_checkpoint.py): the same training as one
process without it, and the bytes it keeps as the planner counts them (minipar/plan/activation_bytes.py)."""
import os
import time

import pytest
import torch
from harness import run_world

from minipar import batch_split, comm_ledger
from minipar.plan import Batch, Layout, ModelShape, Options, activations, collectives
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.activation_checkpoint import ActivationCheckpointing
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [os.path.join(ROOT, "configs", "fsdp.yaml"), "--model.hidden_size", "64", "--model.intermediate_size",
        "128", "--model.num_hidden_layers", "4", "--model.num_attention_heads", "4",
        "--model.num_key_value_heads", "2", "--sequence_len", "32", "--global_batch_size", "8",
        "--max_steps", "3", "--warmup_steps", "1", "--eval_steps", "0", "--progress_bar", "false",
        "--save_final_checkpoint", "false", "--export_hf", "false", "--peak_tflops", "1",
        "--loss_curve", "false",
        "--dataset", os.path.join(ROOT, "data", "shakespeare.txt")]


@pytest.mark.parametrize("how", [("full", "op"), ("selective", "op"), ("selective", 2), ("selective", 3)])
def test_each_policy_gives_the_gradients_of_no_checkpointing(how):
    """One process, 4 layers: the loss and every gradient equal to the model's without checkpointing."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out = []
    for policy in (None, how):
        model = LlamaForCausalLM(cfg, seed=1)
        if policy:
            model.gradient_checkpointing_enable(*policy)
        loss = model(ids, labels=ids.roll(-1, 1))
        loss.backward()
        out.append((loss.item(), [p.grad for p in model.parameters()]))
    assert out[0][0] == out[1][0]
    for a, b in zip(out[0][1], out[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bad_policies_are_refused_by_name():
    with pytest.raises(ValueError, match="selective_ac_option must be op .* or an integer n >= 1"):
        ActivationCheckpointing("selective", 0)
    with pytest.raises(ValueError, match="gradient_checkpointing must be true, false or selective"):
        setup_run(TINY + ["--gradient_checkpointing", "sometimes"])   # (offload: Axolotl's, read as true)


def _curve(argv):
    return [(r["loss"], r["grad_norm"]) for r in Trainer(setup_run(argv)).train()]


_REFERENCE = []     # one process, no checkpointing: computed once for every layout below


@pytest.mark.parametrize("world,layout", [
    (4, ["--dp_shard_size", "2", "--tensor_parallel_size", "2", "--sequence_parallel", "true",
         "--gradient_checkpointing", "selective"]),            # per op, under ZeRO-3 x TP + SP
    (2, ["--dp_shard_size", "1", "--context_parallel_size", "2", "--gradient_checkpointing", "selective"]),
    # per op over ring attention's autograd Function (its block kernels cached, its hops run again)
    pytest.param(4, ["--dp_shard_size", "2", "--context_parallel_size", "2", "--gradient_checkpointing",
                     "selective", "--selective_ac_option", "2"], marks=pytest.mark.slow),   # every 2nd layer
])
def test_selective_checkpointing_trains_as_one_process(tmp_path, world, layout):
    """3 steps: loss and gradient norm within 1e-4 of one process without checkpointing."""
    if not _REFERENCE:
        argv = TINY + ["--dp_shard_size", "1", "--output_dir", str(tmp_path / "one")]
        _REFERENCE.append(run_world(_curve, 1, argv)[0])
    ref = _REFERENCE[0]
    argv = TINY + layout + ["--output_dir", str(tmp_path / "many")]
    for got in run_world(_curve, world, argv, timeout=300):
        for (a, ga), (b, gb) in zip(ref, got):
            assert abs(a - b) <= 1e-4 * abs(a) and abs(ga - gb) <= 1e-4 * abs(ga), (ref, got)


def _forward_bytes(model, batch, n_items, collectives):
    """Bytes a forward leaves allocated for backward, from the profiler's memory records (every
    allocation and free of the forward, on the CPU): what autograd saved plus what the selective
    policy cached, whoever holds it. The loss is kept alive until the count is taken."""
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        loss = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     num_items_in_batch=n_items)
        if collectives:        # gloo's threads drop their references to the collectives' buffers
            time.sleep(0.3)    # (one process: the forward made none, nothing to wait for)
    del loss
    return sum(e.self_cpu_memory_usage for e in prof.key_averages())


def _measure(argv):
    torch.set_num_threads(1)
    tr = Trainer(setup_run(argv))
    with comm_ledger.ledger() as led:
        tr.train_step(0)
    ledger = {k: list(v) for k, v in led.summary().items()}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (tr.cfg.global_batch_size, tr.cfg.sequence_len), generator=g)
    batch = batch_split.local_batch(ids, ids.roll(-1, 1), tr.pgm, 0, tr.run.num_micro_steps)
    measured = {}
    for how in (False, ("full", "op"), ("selective", "op"), ("selective", 2)):
        tr.model.gradient_checkpointing = how and ActivationCheckpointing(*how)
        # the least of three: a buffer gloo's threads still hold only ever adds to a count
        measured[how] = min(_forward_bytes(tr.model, batch, ids.numel(), tr.pgm.world_size > 1)
                            for _ in range(3))
    return ledger, measured


# one process in the default suite: under tp 2 gloo's threads may still hold a collective's buffer
# when the count is taken (rarely, even after the least of three), so that twin is slow
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_planner_counts_what_selective_checkpointing_keeps(tmp_path, world):
    """One micro-batch's forward at a shape where activations dominate (hidden 256, 128 tokens x 2
    rows), on one process and under tp 2: the planner's bytes for no checkpointing, full, per op and
    every 2nd layer within 15 % of the measured ones (tests/test_plan.py's bound; they agree within
    3 % here), and its collectives under selective checkpointing equal to the ledger's. (Under
    sequence parallelism gloo still holds about one all-gather output per gather when the forward
    ends, 9 of them here, which this measurement would count and the planner does not.)"""
    argv = TINY + ["--model.hidden_size", "256", "--model.intermediate_size", "768", "--sequence_len",
                   "128", "--global_batch_size", "2", "--dp_shard_size", "1", "--tensor_parallel_size",
                   str(world), "--gradient_checkpointing", "selective", "--output_dir", str(tmp_path)]
    ledger, measured = run_world(_measure, world, argv, timeout=300)[0]
    shape = ModelShape(256, 256, 768, 4, 4, 2, 64)
    lay = Layout(tp=world)
    batch = Batch(2, None, 128)
    for how, got in measured.items():
        mode = {False: False, "full": True, "selective": "selective"}[how and how[0]]
        opts = Options(dtype="float32", gradient_checkpointing=mode,
                       selective_ac_option=how[1] if how else "op")
        act = activations(shape, lay, batch, opts)
        kept = act["as_configured_kept"]
        assert abs(kept - got) <= 0.15 * got, f"{how}: planned {kept} B, measured {got} B"
    opts = Options(dtype="float32", gradient_checkpointing="selective")
    assert ledger == {k: list(v) for k, v in collectives(shape, lay, batch, opts).items()}
