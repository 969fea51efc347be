"""ZeRO-3 (minipar/zero3/shard_manager.py) against one process: same weights, same global batch,
same steps."""
import contextlib
import functools

import pytest
import torch
import torch.nn as nn
from harness import run_world
from tiny_llama import CFG
from tiny_llama import tiny_batch as _batch

import minipar
from minipar import ParallelismConfig, comm, comm_ledger
from minipar.mesh import ProcessGroupManager
from minipar.optim import build_optimizer
from minipar.tensor_parallel import gather_tensor
from minipar.zero3 import ShardedStateDicts, fully_shard
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig
from models.llama_layer import LlamaDecoderLayer


def _rows(x, pgm, micro, n_micro):
    """This dp rank's rows of the global batch, then micro-batch `micro` of them."""
    per = x.shape[0] // pgm.dp.size
    mine = x[pgm.dp.rank * per:(pgm.dp.rank + 1) * per]
    step = per // n_micro
    return mine[micro * step:(micro + 1) * step]


def _train(pgm, steps=5, cfg=None, shard=True, micro=1, ckpt=False, dtype=None, sync_each=True, **kw):
    """Train the tiny Llama; returns the global loss per step and the full weights at the end."""
    local = pgm is None
    pgm = pgm or ProcessGroupManager.local()
    model = LlamaForCausalLM(LlamaConfig(**dict(CFG, **(cfg or {}))), None if local else pgm, seed=0)
    if dtype is not None:
        model = model.to(dtype)
    if ckpt:
        model.gradient_checkpointing_enable()
    if shard:
        fully_shard(model, pgm, **kw)
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        ids, labels = _batch(step)
        n = (labels != -100).sum()
        total = torch.zeros((), dtype=torch.float64)
        held = []
        for m in range(micro):
            no_sync = model.zero3.no_sync() if not sync_each and m < micro - 1 else contextlib.nullcontext()
            with no_sync, comm_ledger.ledger() as led:
                loss = model(_rows(ids, pgm, m, micro), labels=_rows(labels, pgm, m, micro),
                             num_items_in_batch=n)
                loss.backward()
            total += loss.detach().double()
            if shard:
                held.append((led.count("reduce_scatter"), model.zero3.accumulated_grad_bytes()))
        if step == 0:                # Adam hides a wrong gradient scale: compare gradients too
            grads = _full_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(comm.all_reduce(total, pgm.dp_cp).item())
    unit_bytes = [u.layout.padded_numel * 4 for u in model.zero3.units] if shard else []
    return dict(losses=losses, params=model.full_state_dict(), grads=grads, held=held, unit_bytes=unit_bytes)


def _full_grads(model):
    if getattr(model, "zero3", None) is not None:
        return ShardedStateDicts(model.zero3).full_from_shards([p.grad for p in model.zero3.shards])
    return {n: gather_tensor(p.grad, p.tp_split_dim, model.pgm.tp) for n, p in model.named_parameters()}


@functools.lru_cache(maxsize=None)
def _reference(tied=False, ckpt=False, dtype=None):
    return _train(None, cfg=dict(tie_word_embeddings=tied), shard=False, ckpt=ckpt, dtype=dtype)


def _compare(got, want, atol=1e-5):
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    for name, w in want["grads"].items():
        torch.testing.assert_close(got["grads"][name].to(w.dtype), w, atol=1e-7, rtol=1e-5, msg=name)
    assert got["params"].keys() == want["params"].keys()
    for name, w in want["params"].items():
        torch.testing.assert_close(got["params"][name].to(w.dtype), w, atol=atol, rtol=0, msg=name)


def _zero3_world(shape, **kw):
    return _train(minipar.init(ParallelismConfig(*shape)), **kw)


# ------------------------------------------------------------------ equivalence with one process
# With tp, the decoder's own fp32 rounding (sums split over tp ranks) moves a few weights by ~1e-5
# after 5 Adam steps even without ZeRO (Adam turns rounding noise on ~0 gradients into lr-sized
# steps), so the TP layouts run in float64: the comparison is then about the algorithm alone.
@pytest.mark.parametrize("shape,tied,dtype", [
    ((1, 2, 1, 1), True, None), ((1, 4, 1, 1), False, None), ((1, 8, 1, 1), False, None),
    ((2, 2, 1, 1), False, None), ((2, 4, 1, 1), True, None),
    ((1, 2, 1, 2), True, torch.float64), ((2, 2, 1, 2), False, torch.float64)],
    ids=["fsdp2-tied", "fsdp4", "fsdp8", "hsdp2x2", "hsdp2x4-tied", "fsdp2+tp2-tied-fp64",
         "hsdp2x2+tp2-fp64"])
def test_zero3_equals_one_process(shape, tied, dtype):
    want = _reference(tied=tied, dtype=dtype)
    world = shape[0] * shape[1] * shape[2] * shape[3]
    cfg = dict(tie_word_embeddings=tied)
    for got in run_world(_zero3_world, world, shape, cfg=cfg, dtype=dtype, timeout=180):
        _compare(got, want)


def test_zero3_one_process_and_no_prefetch_no_reshard():
    _compare(_train(ProcessGroupManager.local()), _reference())
    for got in run_world(_zero3_world, 2, (1, 2, 1, 1), prefetch=0, reshard_after_forward=False, timeout=120):
        _compare(got, _reference())


def test_gradient_accumulation_equals_one_big_batch():
    """2 micro-batches of 2 rows per rank (dp_shard 2) = 1 batch of 4 rows = one process."""
    for got in run_world(_zero3_world, 2, (1, 2, 1, 1), micro=2, timeout=120):     # every rank
        _compare(got, _reference())


@pytest.mark.parametrize("shape,tied", [((1, 2, 1, 1), False),
                                        pytest.param((2, 2, 1, 1), True, marks=pytest.mark.slow)],
                         ids=["fsdp2", "hsdp2x2-tied"])
def test_accumulation_without_sync_equals_one_process(shape, tied):
    """no_sync() for micro-batch 1 of 2: no reduce-scatter, the unsharded gradients (all units,
    padded, fp32) are held; micro-batch 2 reduce-scatters the sum once per unit."""
    got = run_world(_zero3_world, 4 if shape[0] == 2 else 2, shape, micro=2, sync_each=False,
                    cfg=dict(tie_word_embeddings=tied), timeout=120)
    want = _reference(tied=tied)
    for g in got:
        _compare(g, want, atol=1e-4)
        units = len(g["unit_bytes"])
        assert g["held"][:2] == [(0, sum(g["unit_bytes"])), (units, 0)]


def _regroup_world(directory):
    """Save a checkpoint with the old grouping (the root holds the embedding) and resume it on the
    default one (embedding a unit of its own): same weights and optimizer states, same next step."""
    from minipar.trainer.checkpoint import save_load as ckpt
    pgm = minipar.init(ParallelismConfig(dp_shard_size=2))
    out = {}
    for name, classes in (("old", (LlamaDecoderLayer,)), ("new", None)):
        model = fully_shard(LlamaForCausalLM(LlamaConfig(**CFG), pgm, seed=0 if name == "old" else 3), pgm,
                            unit_classes=classes)
        opt = build_optimizer(model, lr=1e-2)
        if name == "old":
            for s in range(2):
                if s == 1:
                    ckpt.save_checkpoint(directory, model, opt, pgm, step=1)
                ids, labels = _batch(s)
                model(_rows(ids, pgm, 0, 1), labels=_rows(labels, pgm, 0, 1),
                      num_items_in_batch=(labels != -100).sum()).backward()
                opt.step()
                opt.zero_grad()
                if s == 0:
                    saved_full = model.full_state_dict()
        else:
            ckpt.load_checkpoint(directory, model, opt, pgm)
            out["loaded"] = model.full_state_dict()
            ids, labels = _batch(1)
            model(_rows(ids, pgm, 0, 1), labels=_rows(labels, pgm, 0, 1),
                  num_items_in_batch=(labels != -100).sum()).backward()
            opt.step()
        out[name] = model.full_state_dict()
        out[name + "_units"] = [u.name for u in model.zero3.units]
    out["saved"] = saved_full
    return out


def test_checkpoint_from_another_unit_grouping_resumes(tmp_path):
    for got in run_world(_regroup_world, 2, str(tmp_path / "step-1"), timeout=120):   # every rank
        assert got["old_units"] == ["<root>"] + [f"model.layers.{i}" for i in range(2)]
        assert got["new_units"] == ["<root>", "model.embed_tokens"] + [f"model.layers.{i}" for i in range(2)]
        for name, w in got["saved"].items():
            assert torch.equal(got["loaded"][name], w), name
            torch.testing.assert_close(got["new"][name], got["old"][name], atol=1e-6, rtol=0, msg=name)


def test_activation_checkpointing_equals_plain():
    """The decoder layers' forward runs again inside backward: the pre-forward hook fires then."""
    for got in run_world(_zero3_world, 2, (1, 2, 1, 1), ckpt=True, timeout=120):   # every rank
        _compare(got, _reference())
        _compare(got, _reference(ckpt=True))


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _bf16_world(shape):
    pgm = minipar.init(ParallelismConfig(*shape))
    out = _train(pgm, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, steps=5)
    model = LlamaForCausalLM(LlamaConfig(**CFG), pgm, seed=0)
    fully_shard(model, pgm, param_dtype=torch.bfloat16)          # reduce_dtype defaults to param_dtype
    ids, labels = _batch(0)
    with comm_ledger.ledger() as led:
        model(_rows(ids, pgm, 0, 1), labels=_rows(labels, pgm, 0, 1),
              num_items_in_batch=(labels != -100).sum()).backward()
    out["dtypes"] = {(r.op, r.dtype) for r in led.records}
    out["shard_dtypes"] = {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()}
    out["grads"] = ShardedStateDicts(model.zero3).full_from_shards([p.grad for p in model.zero3.shards])
    return out


def test_bf16_mixed_precision_within_bf16_tolerance():
    want = _reference()
    for got in run_world(_bf16_world, 2, (1, 2, 1, 1), timeout=120):          # every rank
        _check_bf16(got, want)


def _check_bf16(got, want):
    assert got["dtypes"] == {("all_gather", "torch.bfloat16"), ("reduce_scatter", "torch.bfloat16")}
    assert got["shard_dtypes"] == {torch.float32}                # fp32 masters and their grads
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-2)
    ref = LlamaForCausalLM(LlamaConfig(**CFG), None, seed=0)
    ids, labels = _batch(0)
    ref(ids, labels=labels, num_items_in_batch=(labels != -100).sum()).backward()
    for name, p in ref.named_parameters():                       # bf16 keeps 8 bits of mantissa
        assert _rel_err(got["grads"][name], p.grad) < 2e-2, name
    # after 5 AdamW steps at lr 1e-2 (a step moves a weight of std 0.02 by up to 0.01, and Adam's
    # sign of a tiny gradient is what bf16 rounds first) the weights agree to a few percent
    for name, w in want["params"].items():
        assert _rel_err(got["params"][name], w) < 0.1, name


# ------------------------------------------------------------------ memory, prefetching, the ledger
def _schedule_world(prefetch):
    """dp_shard 4, 3 layers: steps 1 and 2 under the ledger (step 1 prefetches from the static order)."""
    pgm = minipar.init(ParallelismConfig(dp_shard_size=4))
    model = LlamaForCausalLM(LlamaConfig(**dict(CFG, num_hidden_layers=3)), pgm, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    fully_shard(model, pgm, prefetch=prefetch)
    z = model.zero3
    opt = build_optimizer(model, lr=1e-2)
    seen = []
    for i, layer in enumerate(model.model.layers):     # run after zero3's own hooks
        layer.register_forward_pre_hook(lambda m, a, i=i: seen.append(("in", i, z.gathered_units())))
        layer.register_forward_hook(lambda m, a, o, i=i: seen.append(("out", i, z.gathered_units())))

    def step(s):
        ids, labels = _batch(s)
        model(_rows(ids, pgm, 0, 1), labels=_rows(labels, pgm, 0, 1),
              num_items_in_batch=(labels != -100).sum()).backward()
        left = z.gathered_units()
        opt.step()
        opt.zero_grad()
        return left

    events = []
    for s in range(2):
        seen.clear()
        z.peak_gathered_bytes = 0
        with comm_ledger.ledger() as led:
            left = step(s)
        events.append([e if isinstance(e, str) else (e.op, e.group, e.bytes, e.wire_bytes)
                       for e in led.events])
    return dict(events=events,
                seen=seen, left=left, peak=z.peak_gathered_bytes, n_params=n_params,
                unit_bytes={u.name: u.layout.padded_numel * 4 for u in z.units},
                shard_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                opt_bytes=sum(t.numel() * t.element_size() for st in opt.state.values()
                              for k, t in st.items() if k != "step"))


@pytest.mark.parametrize("prefetch", [2, 1, 0])
def test_memory_prefetch_and_communication(prefetch):
    N, layers = 4, [f"model.layers.{i}" for i in range(3)]
    for got in run_world(_schedule_world, N, prefetch, timeout=120):          # every rank
        _check_schedule(got, N, layers, prefetch)


def _check_schedule(got, N, layers, prefetch):
    ub = got["unit_bytes"]
    assert list(ub) == ["<root>", "model.embed_tokens", *layers]   # the embedding is a unit of its own
    # outside a unit's forward and backward its gathered parameters are freed
    assert got["left"] == []
    for kind, i, gathered in got["seen"]:
        if kind == "in":
            assert layers[i] in gathered, gathered
            assert set(gathered) <= {"<root>", *layers[i:i + 1 + prefetch]}, gathered
        else:
            assert layers[i] not in gathered, gathered
    # peak parameter bytes: the shards + the root (norm, lm_head) + the embedding or a layer, and
    # `prefetch` layers, never more
    layer = max(ub[n] for n in layers)
    bound = ub["<root>"] + max(ub["model.embed_tokens"], layer) + prefetch * layer
    assert ub["<root>"] + (1 + prefetch) * layer <= got["peak"] <= bound
    # optimizer states (exp_avg, exp_avg_sq) exist for the shards only: 1/N of one process's
    single = 2 * 4 * got["n_params"]
    assert got["opt_bytes"] == 2 * got["shard_bytes"]
    assert single <= got["opt_bytes"] * N <= single + 2 * 4 * N * len(ub)
    padded = sum(ub.values())
    assert 0 <= padded - 4 * got["n_params"] < 4 * N * len(ub)       # theory, up to padding
    for ev in got["events"]:                                       # step 1 (static order), step 2
        # communication: all-gather every unit twice but the root (kept gathered from forward into
        # backward) and the embedding (its backward reads no weights) once, reduce-scatter the
        # gradients once, nothing else
        records = [e for e in ev if not isinstance(e, str)]
        ops = {(op, g) for op, g, _, _ in records}
        assert ops == {("all_gather", "dp_shard_cp"), ("reduce_scatter", "dp_shard_cp")}
        ag = sum(b for op, _, b, _ in records if op == "all_gather")
        rs = sum(b for op, _, b, _ in records if op == "reduce_scatter")
        assert ag == 2 * padded - ub["<root>"] - ub["model.embed_tokens"] and rs == padded
        assert sum(w for op, _, _, w in records if op == "all_gather") == pytest.approx(ag * (N - 1) / N)
        assert sum(w for op, _, _, w in records if op == "reduce_scatter") == pytest.approx(rs * (N - 1) / N)
        assert len(records) == 3 * len(ub) - 2
        assert ev.count("zero3.gather <root>") == ev.count("zero3.gather model.embed_tokens") == 1
        # the order: with prefetch, the next unit's all-gather is issued before this unit's forward
        # ends (and in backward before this unit's reduce-scatter); without, only after. In step 1
        # too: backward prefetches from the static reverse order, before any order was seen
        pos = {}                                                   # first occurrence of each mark
        for k, e in enumerate(ev):
            if isinstance(e, str):
                pos.setdefault(e, k)
        for i in range(2):
            fwd = pos[f"zero3.gather {layers[i + 1]}"] < pos[f"zero3.forward_end {layers[i]}"]
            assert fwd == bool(prefetch)
        gathers = [k for k, e in enumerate(ev) if e == f"zero3.gather {layers[0]}"]
        assert len(gathers) == 2 and (gathers[1] < pos[f"zero3.reduce_scatter {layers[1]}"]) == bool(prefetch)


# ------------------------------------------------------------------ any model: a toy with odd shapes
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.out = nn.Linear(d, 3 * d + 1), nn.Linear(3 * d + 1, d)   # sizes not divisible by 3
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x + self.out(torch.tanh(self.fc(x * self.scale)))


class Toy(nn.Module):
    """Blocks run in the order 2, 0, 1, 0 (block 0 twice; the order is not the registration
    order), block 1 skipped when asked, block 2 under activation checkpointing."""

    def __init__(self, d=6, vocab=11):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, labels, skip=False):
        h = torch.utils.checkpoint.checkpoint(self.blocks[2], self.emb(ids), use_reentrant=False)
        for i in (0, 1, 0):
            if not (skip and i == 1):
                h = self.blocks[i](h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


def _toy_batch(step, rows=6):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (rows, 5), generator=g), torch.randint(0, 11, (rows, 5), generator=g)


def _toy_train(pgm=None, steps=4):
    model = Toy()
    if pgm is not None:
        fully_shard(model, pgm, unit_classes=Block, prefetch=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dp = pgm.dp if pgm is not None else ProcessGroupManager.local().dp
    marks = []
    for step in range(steps):
        ids, labels = _toy_batch(step)
        per = ids.shape[0] // dp.size
        rows = slice(dp.rank * per, (dp.rank + 1) * per)
        if step == 1 and pgm is not None:                # an evaluation pass, skipping a prefetched unit
            with torch.no_grad():
                model(ids[rows], labels[rows], skip=True)
            assert model.zero3.gathered_units() == []
        with comm_ledger.ledger() as led:
            (model(ids[rows], labels[rows], skip=step == 2) / labels.numel()).backward()
        marks.append([e for e in led.events if isinstance(e, str)])
        if step == 0:
            plain = {n: p.grad for n, p in model.named_parameters()}
            grads = _full_grads(model) if pgm is not None else plain
        opt.step()
        opt.zero_grad()
    params = (ShardedStateDicts(model.zero3).full_state_dict() if pgm is not None
              else dict(model.named_parameters()))
    return dict(params={k: v.detach().clone() for k, v in params.items()}, marks=marks, grads=grads)


def test_toy_model_odd_sizes_repeated_skipped_and_reordered_units():
    want = _toy_train()
    results = run_world(lambda: _toy_train(minipar.init(ParallelismConfig(dp_shard_size=3))), 3, timeout=120)
    for got in results:
        for name, w in want["params"].items():
            g = want["grads"][name]
            torch.testing.assert_close(got["grads"][name], g, atol=1e-7, rtol=1e-5, msg=name)
            torch.testing.assert_close(got["params"][name], w, atol=1e-5, rtol=0, msg=name)
    marks = results[0]["marks"]
    # unused in that step: never run, never reduced (a prefetch may still gather it; it is freed)
    assert "zero3.forward blocks.1" not in marks[2] and "zero3.reduce_scatter blocks.1" not in marks[2]
    # prefetching follows the execution order learned in step 0: 2 -> 0 -> 1 -> 0
    step1 = marks[1]
    assert step1.index("zero3.gather blocks.0") < step1.index("zero3.forward_end blocks.2")
    assert step1.index("zero3.gather blocks.1") < step1.index("zero3.forward_end blocks.0")


# ------------------------------------------------------------------ state dicts and shard metadata
def _state_world(shape, directory, full=None, load=False):
    """Shard on `shape`; check the shard metadata; then either load `full` and save a checkpoint
    to `directory` (trainer/checkpoint/save_load.py, the one resharding path), or load that checkpoint."""
    from minipar.trainer.checkpoint import save_load as ckpt
    pgm = minipar.init(ParallelismConfig(*shape))
    model = LlamaForCausalLM(LlamaConfig(**dict(CFG, tie_word_embeddings=True)), pgm, seed=0)
    fully_shard(model, pgm)
    z = model.zero3
    if load:
        ckpt.load_checkpoint(directory, model, None, pgm)         # saved on another layout
        return dict(full=model.full_state_dict())
    if full is not None:
        model.load_full_state_dict(full)                         # through ShardedStateDicts(model.zero3)
    ids, labels = _batch(0)
    model(_rows(ids, pgm, 0, 1), labels=_rows(labels, pgm, 0, 1),
          num_items_in_batch=(labels != -100).sum()).backward()
    # per-element labels, cut into this rank's shard the way the weights are
    tags = lambda f: {s.name: torch.full(s.full_shape, float(f(s))) for u in z.units for s in u.layout.slots}
    sd = ShardedStateDicts(z)
    split = sd.shards_from_full(tags(lambda s: s.tp_split_dim is not None))
    one_d = sd.shards_from_full(tags(lambda s: len(s.local_shape) < 2))
    real = sd.shards_from_full(tags(lambda s: True))
    for p, sp, od, rl in zip(z.shards, split, one_d, real):
        for segs, tag in ((p.tp_split_segments, sp), (p.no_decay_segments, od)):
            mask = torch.zeros(p.numel(), dtype=torch.bool)
            for a, b in segs:
                mask[a:b] = True
            assert torch.equal(mask, tag.bool()), p.zero3_unit
        assert p.zero3_shard and p.grad[rl == 0].eq(0).all() and p.detach()[rl == 0].eq(0).all()  # padding
    out = dict(full=model.full_state_dict())
    if full is not None:
        ckpt.save_checkpoint(directory, model, None, pgm, step=0)   # SHARDED_STATE_DICT: segments
    return out


def test_state_dicts_roundtrip_across_layouts(tmp_path):
    cfg = LlamaConfig(**dict(CFG, tie_word_embeddings=True))
    want = LlamaForCausalLM(cfg, None, seed=0).full_state_dict()
    moved = {n: t + 1 for n, t in want.items()}
    directory = str(tmp_path / "step-0")
    saved = run_world(_state_world, 4, (1, 2, 1, 2), directory, timeout=120)
    for rank in saved:                             # every rank's full_state_dict is the whole model
        for name, w in want.items():
            torch.testing.assert_close(rank["full"][name], w, atol=0, rtol=0)
    # load full tensors on one layout, save its shards, resume them on another
    for got in run_world(_state_world, 4, (1, 2, 1, 2), directory, moved, timeout=120):
        assert all(torch.equal(got["full"][n], moved[n]) for n in want)
    for got in run_world(_state_world, 4, (2, 2, 1, 1), directory, load=True, timeout=120):
        assert all(torch.equal(got["full"][n], moved[n]) for n in want)


def test_bad_input_raises_before_any_collective():
    pgm = ProcessGroupManager.local()
    fresh = lambda: LlamaForCausalLM(LlamaConfig(**CFG), None, seed=0)
    with pytest.raises(ValueError, match="prefetch"):
        fully_shard(fresh(), pgm, prefetch=-1)
    with pytest.raises(ValueError, match="param_dtype"):
        fully_shard(fresh(), pgm, param_dtype=torch.int32)
    model = fully_shard(fresh(), pgm, unit_classes=(LlamaDecoderLayer,))
    with pytest.raises(ValueError, match="already sharded"):
        fully_shard(model, pgm)
    from minipar.data_parallel import replicate
    with pytest.raises(ValueError, match="ZeRO-3"):
        replicate(model, pgm.dp_replicate)
    with pytest.raises(ValueError, match="other model shape"):
        model.load_full_state_dict({n: torch.zeros(3) for n in model.zero3.param_names})
    tied = Toy()
    tied.blocks[1].fc = tied.blocks[0].fc
    with pytest.raises(ValueError, match="shared by units"):
        fully_shard(tied, pgm, unit_classes=Block)
