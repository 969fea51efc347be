"""No hidden host syncs in a step (minipar/trainer/host_syncs.py): the counter tells a read of
what a GPU would hold from a read of host data, sees backward hooks too, and names the file and
line; and on 4 ranks each layout's steady-state steps hold to their number: a dense layout reads
the device once per logging step (the losses and norms of the steps since, at once) and not at all
in between, an MoE layer once per micro-batch (the all-to-all's splits)."""
import collections
import os

import pytest
import torch
from harness import run_world

from minipar.batch_split import count_label_tokens
from minipar.trainer.host_syncs import HostSyncs, host_tensors, is_host, optimizer_host_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")          # a torch.device: what a trainer names its compute device with


def test_counter_counts_device_reads_not_host_reads():
    data = torch.arange(100)
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(lin.parameters())
    with HostSyncs(host=[data]) as syncs:
        x = data[:8].float().view(2, 4)
        n = count_label_tokens(data)                    # a host tensor read on the host: nothing
        pinned = x.to(CPU, non_blocking=True)           # a copy the host need not wait for: nothing
        assert is_host(x) and not is_host(pinned) and n == 100
        loss = lin(pinned).sum()
        loss.backward()
        opt.step()                                      # AdamW's step counters live on the host
        assert syncs.counts() == {}
        x.to(CPU)                                       # pageable host -> device
        loss.item()
        bool(loss > 0)
        loss.detach().tolist()
        torch.tensor([1.0], device=CPU)                 # built on the host, copied
        torch.zeros(3, device=CPU).nonzero()            # a result sized by the data
        count_label_tokens(lin.weight.grad)             # minipar's line, read on a device tensor
        host = loss.detach().to("cpu", non_blocking=True)
        float(host)                                     # read from pinned memory: nothing
    kinds = collections.Counter(k.split(" ", 1)[1] for k in syncs.counts().elements())
    assert kinds == {"to host->device": 1, "item": 3, "tolist": 1, "tensor(device=) host->device": 1,
                     "nonzero": 1}, syncs.counts()
    where = [k for k in syncs.counts() if k.startswith("minipar/")]
    assert where and where[0].startswith("minipar/batch_split.py:"), syncs.counts()


def test_counter_sees_backward_hooks():
    lin = torch.nn.Linear(4, 4)
    def read(p):
        p.grad.sum().tolist()

    def copy(p):
        torch.tensor([1.0], device=CPU)
    lin.weight.register_post_accumulate_grad_hook(read)
    lin.bias.register_post_accumulate_grad_hook(copy)
    with HostSyncs() as syncs:
        lin(torch.ones(2, 4, device=CPU)).sum().backward()
    assert sorted(k.split(" ", 1)[1] for k in syncs.counts().elements()) == \
        ["tensor(device=) host->device", "tolist"], syncs.counts()
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist      # the patches are gone after


# ------------------------------------------------------------------------------ on 4 ranks
TINY = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_hidden_layers", "2",
        "--model.num_attention_heads", "4", "--model.num_key_value_heads", "2", "--sequence_len", "32",
        "--global_batch_size", "8", "--max_steps", "6", "--warmup_steps", "2", "--eval_steps", "0",
        "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
        "--logging_steps", "2", "--progress_bar", "false", "--save_steps", "0",
        "--save_final_checkpoint", "false", "--export_hf", "false",
        "--dataset", os.path.join(ROOT, "data", "shakespeare.txt")]
MOE = ["--model.model_type", "mixtral", "--model.num_local_experts", "4", "--model.num_experts_per_tok", "2",
       "--model.router_aux_loss_coef", "0.05"]
FIRST, LAST = 2, 5                 # steps 3, 4, 5 (1-based), after the first two warmed up


def _config(name):
    return os.path.join(ROOT, "configs", name)


def _count(argv):
    """{step: {file: syncs}} of steps FIRST+1 .. LAST: each loop iteration whole (the step, the
    record, the stop flag), the data loader's host work included (its tensors are host roots)."""
    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    t = Trainer(setup_run(argv))
    original, state = t.train_step, {}

    def train_step(step):
        if step == FIRST:
            state["syncs"] = HostSyncs(host=[host_tensors(t.batches), optimizer_host_state(t.optimizer)])
            state["syncs"].__enter__()
        if step == LAST:
            state["syncs"].__exit__(None, None, None)
        elif "syncs" in state:
            state["syncs"].at_step(step + 1)
        return original(step)
    t.train_step = train_step
    t.train()
    return {s: dict(state["syncs"].counts(s)) for s in range(FIRST + 1, LAST + 1)}


def _files(counts: dict) -> dict:
    out = collections.Counter()
    for key, n in counts.items():
        out[key.split(":", 1)[0]] += n
    return dict(out)


READ = "minipar/trainer/train_loop.py"      # the logging step's one read of the losses and norms


@pytest.mark.parametrize("layout,argv,per_step", [
    # DDP: no pageable copy in the backward hooks, no read of the used flags (all used)
    ("ddp", [_config("ddp.yaml")], {}),
    # an MoE of 2 layers on ep 2: one read per layer and micro-batch, the all-to-all's splits
    ("moe", [_config("ddp.yaml"), "--dp_replicate_size", "1", "--dp_shard_size", "4",
             "--expert_parallel_size", "2", *MOE], {"minipar/expert_parallel/dispatch.py": 2}),
    pytest.param("zero3_tp_sp", [_config("fsdp_tp.yaml"), "--sequence_parallel", "true"], {},
                 marks=pytest.mark.slow),
    pytest.param("ring_cp", [_config("ddp.yaml"), "--dp_replicate_size", "1", "--dp_shard_size", "2",
                             "--context_parallel_size", "2"], {}, marks=pytest.mark.slow),
    pytest.param("pp2", [_config("pp.yaml"), "--pipeline_parallel_size", "2", "--dp_shard_size", "2"], {},
                 marks=pytest.mark.slow),
])
def test_each_layout_holds_to_its_syncs_per_step(tmp_path, layout, argv, per_step):
    got = run_world(_count, 4, [*argv, *TINY, "--output_dir", str(tmp_path / layout)], timeout=300)
    for rank, steps in enumerate(got):
        for step, counts in steps.items():
            want = dict(per_step)
            if step % 2 == 0:                  # logging_steps 2: the losses of steps step-1, step
                want[READ] = want.get(READ, 0) + 1
            assert _files(counts) == want, f"{layout}, rank {rank}, step {step}: {counts}"


# ------------------------------------------------------------------- the deferred loss read
def _nan_at(argv, bad_step):
    """Train with step `bad_step`'s loss made NaN on the device; (error message, steps in
    metrics.jsonl, steps in the history)."""
    import json

    from minipar.trainer.run_setup import setup_run
    from minipar.trainer.trainer import Trainer
    torch.set_num_threads(1)
    t = Trainer(setup_run(argv))
    original = t.train_step

    def train_step(step):
        out = original(step)
        if step + 1 == bad_step:
            out["loss"] = out["loss"] * float("nan")
        return out
    t.train_step = train_step
    try:
        t.train()
    except FloatingPointError as err:
        lines = [json.loads(x)["step"] for x in open(t.cfg.metrics_path)]
        return str(err), lines, [r["step"] for r in t.history]
    return None


def test_a_non_finite_loss_is_named_at_the_next_read_before_any_later_record(tmp_path):
    # logging_steps 4: steps 1-4 are read together after step 4; step 3's NaN stops the run there,
    # naming step 3, with steps 1 and 2 written (as a step-by-step check would have left them)
    argv = [_config("ddp.yaml"), "--dp_replicate_size", "1", *TINY, "--logging_steps", "4",
            "--output_dir", str(tmp_path / "nan")]
    message, lines, history = run_world(_nan_at, 1, argv, 3, timeout=120)[0]
    assert "loss is nan at step 3" in message, message
    assert lines == [1, 2] and history == [1, 2]
