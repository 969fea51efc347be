"""Selective activation checkpointing (models/activation_checkpoint.py): the same training as one
process without it, and the bytes it keeps as the planner counts them (minipar/plan/activation_bytes.py)."""
import os
import time

import pytest
import torch
from harness import run_world
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


class _Made(TorchDispatchMode):
    """Every storage an aten op returns, weakly (a dispatch mode sees each op below autograd, the
    ones the selective policy caches and the collectives among them): storage -> (weak ref, bytes,
    address), as last seen (an op may resize it)."""

    def __init__(self):
        super().__init__()
        self.storages = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ref = StorageWeakRef(st)
                self.storages[ref.cdata] = (ref, st.nbytes(), st.data_ptr())
        return out


def _forward_bytes(model, batch, n_items, collectives):
    """Bytes a forward leaves alive for backward: the storages its aten ops made that are still
    alive when it ends, parameters and buffers (and their views) excluded: what autograd saved plus
    what the selective policy cached, whoever holds it; the loss itself (the forward's output, kept
    until the count is taken) not counted. The micro-batch is cloned inside, its own storage as on
    a GPU (tests/test_plan.py's _saved_bytes): on the CPU it is a view of the global batch, made
    before the forward, whose int64 ids (8 n bytes) the embedding keeps at tp 1.
    Host memory that no aten op makes, on a GPU too, is not counted: the CPU generator's state that
    torch.utils.checkpoint keeps per checkpointed layer (preserve_rng_state, 5056 bytes; a CUDA
    generator's is a CPU tensor as well) and the 0-d int64 tensor Python wraps n_items into, which
    the loss's division keeps (8 bytes). The profiler's memory records, counted before, had both and
    the loss but not the ids: 4 x 5056 + 12 - 8 n bytes over the plan with 4 layers checkpointed.
    And they missed frees: gloo frees a collective's buffer on its worker thread when that thread
    drops the last reference, and the profiler does not record that free (an all-reduce's n d 4
    bytes, at times several, counted as kept however long it waited: 3 % of every 2nd layer's
    count at tp 2; 9 all-gathers' under sequence parallelism)."""
    made = _Made()
    with made:
        mine = {k: v.clone() for k, v in batch.items()}
        loss = model(mine["input_ids"], position_ids=mine["position_ids"], labels=mine["labels"],
                     num_items_in_batch=n_items)
        del mine                        # the clones no op kept die here
    fixed = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), loss)}

    def alive() -> int:
        return sum(nbytes for ref, nbytes, ptr in list(made.storages.values())
                   if not ref.expired() and ptr not in fixed)
    if not collectives:                 # one process: no other thread holds anything
        return alive()
    # gloo's worker threads drop their references to the last collectives' buffers when they get
    # to it: the count only falls, so it is read until it has held still for 0.3 s (at most 10 s)
    now, still_since, deadline = alive(), time.monotonic(), time.monotonic() + 10
    while time.monotonic() - still_since < 0.3 and time.monotonic() < deadline:
        time.sleep(0.02)
        was, now = now, alive()
        if now != was:
            still_since = time.monotonic()
    return now


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
        measured[how] = _forward_bytes(tr.model, batch, ids.numel(), tr.pgm.world_size > 1)
    return ledger, measured


# one process in the default suite; tp 2, with and without sequence parallelism, in the slow one
@pytest.mark.parametrize("world,sp", [(1, False), pytest.param(2, False, marks=pytest.mark.slow),
                                      pytest.param(2, True, marks=pytest.mark.slow)])
def test_planner_counts_what_selective_checkpointing_keeps(tmp_path, world, sp):
    """One micro-batch's forward at a shape where activations dominate (hidden 256, 128 tokens x 2
    rows), on one process and under tp 2 (+ SP): the planner's bytes for no checkpointing, full, per
    op and every 2nd layer equal, on every rank, to what the forward leaves alive (_forward_bytes),
    and its collectives under selective checkpointing equal to the ledger's."""
    argv = TINY + ["--model.hidden_size", "256", "--model.intermediate_size", "768", "--sequence_len",
                   "128", "--global_batch_size", "2", "--dp_shard_size", "1", "--tensor_parallel_size",
                   str(world), "--sequence_parallel", str(sp).lower(), "--gradient_checkpointing",
                   "selective", "--output_dir", str(tmp_path)]
    shape = ModelShape(256, 256, 768, 4, 4, 2, 64)
    lay = Layout(tp=world, sequence_parallel=sp)
    batch = Batch(2, None, 128)
    for rank, (ledger, measured) in enumerate(run_world(_measure, world, argv, timeout=300)):
        for how, got in measured.items():
            mode = {False: False, "full": True, "selective": "selective"}[how and how[0]]
            opts = Options(dtype="float32", gradient_checkpointing=mode,
                           selective_ac_option=how[1] if how else "op")
            kept = activations(shape, lay, batch, opts)["as_configured_kept"]
            assert kept == got, f"rank {rank}, {how}: planned {kept} B, measured {got} B"
        opts = Options(dtype="float32", gradient_checkpointing="selective")
        assert ledger == {k: list(v) for k, v in collectives(shape, lay, batch, opts).items()}, rank
