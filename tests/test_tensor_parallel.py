"""Each tensor-parallel layer equals its single-process twin; the f/g functions do what they say.

Every rank draws the same full tensors from one seed (weight W, bias b, input X, upstream gradient
G), runs the plain twin (nn.Linear, nn.Embedding, F.cross_entropy) itself, then runs the parallel
layer on its shard and checks, in fp32 within 1e-5:

    output         the full output, or this rank's slice of it (column-parallel, sequence shard)
    input grad     the full dX, or this rank's slice (input_is_parallel, sequence shard)
    weight grad    dW.chunk(tp, dim=split_dim)[rank];  bias grad likewise (full for a replicated one)

Convention for upstream gradients: a replicated output gets the full G on every rank (the loss is
computed identically everywhere, as in Megatron); a sharded output gets its slice of G.
The comm ledger shows the decoder's collectives match the count of docs/tensor_parallel.md, with and
without SP.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import run_world

import minipar
from minipar import ParallelismConfig, comm_ledger
from minipar import tensor_parallel as tpl
from minipar.mesh import MeshDim, ProcessGroupManager
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

TOL = dict(atol=1e-5, rtol=1e-5)
B, S, H, OUT, V = 2, 8, 32, 48, 64       # S, OUT, V divisible by 2 and 4


def _close(got, want, what, **tol):
    torch.testing.assert_close(got, want, **(tol or TOL), msg=lambda m: f"{what}: {m}")


def _tp(tp_size):
    return minipar.init(ParallelismConfig(tp_size=tp_size)).tp


def _chunk(t, dim, tp):
    return t.chunk(tp.size, dim=dim)[tp.rank]


# ----------------------------------------------------------------------------- linear layers
def _reference_linear(in_f, out_f, bias, seed):
    g = torch.Generator().manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_f, in_f, generator=g))
        if bias:
            ref.bias.copy_(torch.randn(out_f, generator=g))
    x = torch.randn(B, S, in_f, generator=g, requires_grad=True)
    grad_out = torch.randn(B, S, out_f, generator=g)
    ref(x).backward(grad_out)
    with torch.no_grad():
        y = ref(x)
    return ref, x, y, grad_out


def _load(layer, ref):
    with torch.no_grad():
        layer.weight.copy_(tpl.shard_tensor(ref.weight, layer.weight.tp_split_dim, layer.tp))
        if ref.bias is not None:
            layer.bias.copy_(tpl.shard_tensor(ref.bias, layer.bias.tp_split_dim, layer.tp))


def _check_grads(layer, ref, tag):
    w, b = layer.weight, layer.bias
    _close(w.grad, tpl.shard_tensor(ref.weight.grad, w.tp_split_dim, layer.tp), tag + " dW")
    if ref.bias is not None:
        _close(b.grad, tpl.shard_tensor(ref.bias.grad, b.tp_split_dim, layer.tp), tag + " db")
    # the layout is recorded on the parameter, and gathering the shards gives the full weight back
    _close(tpl.gather_tensor(layer.weight.detach(), layer.weight.tp_split_dim, layer.tp), ref.weight.detach(),
           tag + " gathered W")


def _column(tp, bias, gather_output, sp):
    tag = f"Column(bias={bias}, gather_output={gather_output}, sp={sp})"
    ref, x, y, g = _reference_linear(H, OUT, bias, seed=1)
    layer = tpl.ColumnParallelLinear(H, OUT, tp, bias=bias, gather_output=gather_output, sequence_parallel=sp)
    assert layer.weight.shape == (OUT // tp.size, H) and layer.weight.tp_split_dim == 0
    _load(layer, ref)
    xi = (_chunk(x, 1, tp) if sp else x).detach().clone().requires_grad_()   # SP: input is a sequence shard
    out = layer(xi)
    if gather_output:
        _close(out, y, tag + " out")
        out.backward(g)
    else:
        _close(out, _chunk(y, -1, tp), tag + " out")
        out.backward(_chunk(g, -1, tp).contiguous())
    _close(xi.grad, _chunk(x.grad, 1, tp) if sp else x.grad, tag + " dX")
    _check_grads(layer, ref, tag)


def _row(tp, bias, input_is_parallel, sp):
    tag = f"Row(bias={bias}, input_is_parallel={input_is_parallel}, sp={sp})"
    ref, x, y, g = _reference_linear(OUT, H, bias, seed=2)
    layer = tpl.RowParallelLinear(OUT, H, tp, bias=bias, input_is_parallel=input_is_parallel,
                                  sequence_parallel=sp)
    assert layer.weight.shape == (H, OUT // tp.size) and layer.weight.tp_split_dim == 1
    _load(layer, ref)
    xi = (_chunk(x, -1, tp) if input_is_parallel else x).detach().clone().requires_grad_()
    out = layer(xi)
    if sp:       # the output is this rank's sequence shard (reduce-scatter)
        _close(out, _chunk(y, 1, tp), tag + " out")
        out.backward(_chunk(g, 1, tp).contiguous())
    else:
        _close(out, y, tag + " out")
        out.backward(g)
    _close(xi.grad, _chunk(x.grad, -1, tp) if input_is_parallel else x.grad, tag + " dX")
    _check_grads(layer, ref, tag)


def _embedding(tp, sp):
    tag = f"VocabParallelEmbedding(sp={sp})"
    gen = torch.Generator().manual_seed(3)
    ref = nn.Embedding(V, H)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(V, H, generator=gen))
    ids = torch.randint(0, V, (B, S), generator=gen)
    ids[0, :tp.size] = torch.arange(tp.size) * (V // tp.size)   # first and last id of each shard appear
    ids[1, :tp.size] = (torch.arange(tp.size) + 1) * (V // tp.size) - 1
    g = torch.randn(B, S, H, generator=gen)
    y = ref(ids)
    y.backward(g)
    layer = tpl.VocabParallelEmbedding(V, H, tp, sequence_parallel=sp)
    assert (layer.vocab_start, layer.vocab_end) == (tp.rank * V // tp.size, (tp.rank + 1) * V // tp.size)
    with torch.no_grad():
        layer.weight.copy_(tpl.shard_tensor(ref.weight, 0, tp))
    out = layer(ids)
    if sp:
        _close(out, _chunk(y, 1, tp), tag + " out")
        out.backward(_chunk(g, 1, tp).contiguous())
    else:
        _close(out, y, tag + " out")
        out.backward(g)
    _close(layer.weight.grad, tpl.shard_tensor(ref.weight.grad, 0, tp), tag + " dW")


def _layers(tp_size):
    tp = _tp(tp_size)
    for bias in (False, True):
        for gather_output in (False, True):
            _column(tp, bias, gather_output, sp=False)
        _column(tp, bias, gather_output=False, sp=True)
        for input_is_parallel in (True, False):
            _row(tp, bias, input_is_parallel, sp=False)
        _row(tp, bias, input_is_parallel=True, sp=True)
    for sp in (False, True):
        _embedding(tp, sp)
    # initialisation is layout-independent: the full weight is drawn, then sliced
    col = tpl.ColumnParallelLinear(H, OUT, tp)
    col.reset_parameters(std=0.02, generator=torch.Generator().manual_seed(7))
    full = torch.empty(OUT, H).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(7))
    _close(tpl.gather_tensor(col.weight.detach(), 0, tp), full, "reset_parameters")
    return True


@pytest.mark.parametrize("tp_size", [2, 4])
def test_linear_and_embedding_layers_equal_their_twins(tp_size):
    assert all(run_world(_layers, tp_size, tp_size, timeout=180))


# ------------------------------------------------------------------------- cross-entropy
def _ce_case(tp, logits, labels, reduction, ignore_index=-100, tol=None):
    tag = f"cross_entropy(reduction={reduction}, ignore_index={ignore_index}, dtype={logits.dtype})"
    gen = torch.Generator().manual_seed(11)
    weights = torch.rand(labels.shape, generator=gen)    # a non-uniform upstream gradient for "none"
    full = logits.detach().float().requires_grad_()        # the twin works on the same (rounded) values
    ref = F.cross_entropy(full.view(-1, V), labels.view(-1), ignore_index=ignore_index,
                          reduction=reduction)
    ref = ref.view(labels.shape) if reduction == "none" else ref
    (ref * weights).sum().backward() if reduction == "none" else ref.backward()
    local = _chunk(logits.detach(), -1, tp).clone().requires_grad_()
    loss = tpl.vocab_parallel_cross_entropy(local, labels, tp, ignore_index=ignore_index, reduction=reduction)
    assert loss.shape == ref.shape and torch.isfinite(loss).all(), tag
    _close(loss, ref.detach(), tag + " loss")
    (loss * weights).sum().backward() if reduction == "none" else loss.backward()
    assert local.grad.dtype == logits.dtype and torch.isfinite(local.grad).all(), tag
    _close(local.grad, _chunk(full.grad, -1, tp).to(logits.dtype), tag + " dlogits", **(tol or {}))


def _cross_entropy(tp_size):
    tp = _tp(tp_size)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(B, S, V, generator=gen) * 3
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, :3] = -100
    labels[1, 0] = V - 1                 # last id of the last shard
    for reduction in ("mean", "sum", "none"):
        _ce_case(tp, logits, labels, reduction)
    # a non-default ignore_index that is a real id of some shard
    _ce_case(tp, logits, labels.masked_fill(labels == -100, 5), "mean", ignore_index=5)
    # numerical stability: exp(1e4) is inf in any float type; the shift by the global max must save it
    big = logits * 1e4
    for reduction in ("mean", "none"):
        _ce_case(tp, big, labels, reduction, tol=dict(atol=1e-5, rtol=1e-5))
    # bf16 logits: computed in fp32 internally (so the loss matches fp32 on the same values), grad in bf16
    _ce_case(tp, logits.bfloat16(), labels, "mean", tol=dict(atol=1e-5, rtol=1e-2))
    # three all-reduces' worth of traffic, of (tokens,) numbers only: the full logits never move
    with comm_ledger.ledger() as led:
        tpl.vocab_parallel_cross_entropy(_chunk(logits, -1, tp), labels, tp)
    assert [r.op for r in led.records] == ["all_reduce", "all_reduce"]
    assert [r.numel for r in led.records] == [B * S, 2 * B * S]
    # every token ignored: 0, not nan
    none = tpl.vocab_parallel_cross_entropy(_chunk(logits, -1, tp), torch.full_like(labels, -100), tp)
    assert none.item() == 0.0
    return True


@pytest.mark.parametrize("tp_size", [2, 4])
def test_vocab_parallel_cross_entropy_equals_f_cross_entropy(tp_size):
    assert all(run_world(_cross_entropy, tp_size, tp_size, timeout=180))


def test_cross_entropy_rejects_unknown_reduction():
    tp = ProcessGroupManager.local().tp
    with pytest.raises(ValueError, match="reduction"):
        tpl.vocab_parallel_cross_entropy(torch.randn(4, V), torch.zeros(4, dtype=torch.long), tp,
                                         reduction="avg")


# ------------------------------------------------------------------- the conjugate functions
def _per_rank(tp, shape, seed):
    """The tensor of every rank of the group, known on every rank: xs[r]."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(tp.size)]


def _conjugates(tp_size):
    tp = _tp(tp_size)
    r, n = tp.rank, tp.size
    own = lambda ts: ts[r]                                        # noqa: E731
    total = lambda ts: torch.stack(ts).sum(0)                     # noqa: E731
    cat = lambda d: lambda ts: torch.cat(ts, d)                   # noqa: E731
    mine = lambda d, of=own: lambda ts: of(ts).chunk(n, dim=d)[r]  # noqa: E731
    AR, AG, RS = "all_reduce", "all_gather", "reduce_scatter"
    # name, function, forward and backward by definition (from every rank's x or upstream grad),
    # the collectives forward, backward
    cases = [
        ("f", lambda x: tpl.copy_to_tp_region(x, tp), own, total, [], [AR]),
        ("g", lambda x: tpl.reduce_from_tp_region(x, tp), total, own, [AR], []),
        ("gather(-1)", lambda x: tpl.gather_from_tp_region(x, tp, dim=-1), cat(-1), mine(-1), [AG], []),
        ("scatter(-1)", lambda x: tpl.scatter_to_tp_region(x, tp, dim=-1), mine(-1), cat(-1), [], [AG]),
        ("SP f", lambda x: tpl.gather_from_sequence_parallel_region(x, tp), cat(1), mine(1, total),
         [AG], [RS]),
        ("SP g", lambda x: tpl.reduce_scatter_to_sequence_parallel_region(x, tp), mine(1, total), cat(1),
         [RS], [AG]),
        ("enter, no SP", lambda x: tpl.enter_tp_region(x, tp, False), own, total, [], [AR]),
        ("enter, SP", lambda x: tpl.enter_tp_region(x, tp, True), cat(1), mine(1, total), [AG], [RS]),
        ("SP weight", lambda x: tpl.sequence_parallel_weight(x, tp, True), own, total, [], [AR]),
        ("weight, no SP", lambda x: tpl.sequence_parallel_weight(x, tp, False), own, own, [], []),
    ]
    for seed, (name, fn, want_fwd, want_bwd, ops_fwd, ops_bwd) in enumerate(cases):
        xs = _per_rank(tp, (B, S, H), seed)
        x = xs[r].clone().requires_grad_()
        with comm_ledger.ledger() as fwd:
            y = fn(x)
        _close(y, want_fwd(xs), name + " forward")
        assert torch.equal(x.detach(), xs[r]), name + " changed its input"
        gs = _per_rank(tp, tuple(y.shape), seed + 100)            # every rank's upstream gradient
        with comm_ledger.ledger() as bwd:
            y.backward(gs[r])
        _close(x.grad, want_bwd(gs), name + " backward")
        assert [e.op for e in fwd.records] == ops_fwd, (name, fwd.records)
        assert [e.op for e in bwd.records] == ops_bwd, (name, bwd.records)

    # g must not reduce its input in place: exp() keeps its result for its own backward
    a = torch.randn(H, requires_grad=True)
    tpl.reduce_from_tp_region(a.exp(), tp).sum().backward()
    _close(a.grad, a.detach().exp(), "d exp(a) through g")
    # f must not reduce in place a gradient buffer that autograd shares with a sibling branch
    x, v = torch.randn(H, requires_grad=True), torch.randn(H, requires_grad=True)
    (tpl.copy_to_tp_region(x, tp) + v * 1.0).backward(torch.arange(float(H)))
    _close(v.grad, torch.arange(float(H)), "sibling of f")
    _close(x.grad, n * torch.arange(float(H)), "through f")

    # shard_tensor / gather_tensor are inverse; the layout is full.chunk(tp, dim)[rank]
    full = torch.arange(4.0 * n * 6).view(4 * n, 6)
    assert torch.equal(tpl.shard_tensor(full, 0, tp), full[4 * r: 4 * (r + 1)])
    assert torch.equal(tpl.gather_tensor(tpl.shard_tensor(full, 0, tp), 0, tp), full)
    assert tpl.shard_tensor(full, None, tp) is full
    return True


@pytest.mark.parametrize("tp_size", [2, 4])
def test_conjugate_functions_match_their_definitions(tp_size):
    assert all(run_world(_conjugates, tp_size, tp_size, timeout=180))


def test_size_one_group_is_the_identity_and_silent():
    tp = ProcessGroupManager.local().tp
    x = torch.randn(B, S, H)
    with comm_ledger.ledger() as led:
        for fn in (tpl.copy_to_tp_region, tpl.reduce_from_tp_region, tpl.gather_from_tp_region,
                   tpl.scatter_to_tp_region, tpl.gather_from_sequence_parallel_region,
                   tpl.reduce_scatter_to_sequence_parallel_region):
            assert fn(x, tp) is x
    assert led.count() == 0


def test_not_divisible_by_tp_raises_before_any_collective():
    tp = MeshDim("tp", [0, 1, 2, 3], 0, None)   # no process group: any collective would crash, not raise
    with pytest.raises(ValueError, match=r"out_features=30 is not divisible by tp_size=4"):
        tpl.ColumnParallelLinear(16, 30, tp)
    with pytest.raises(ValueError, match=r"in_features=30 is not divisible by tp_size=4"):
        tpl.RowParallelLinear(30, 16, tp)
    with pytest.raises(ValueError, match=r"vocab_size\)=250 is not divisible by tp_size=4"):
        tpl.VocabParallelEmbedding(250, 16, tp)
    with pytest.raises(ValueError, match="cannot split dim 0 of size 6 over tp_size=4"):
        tpl.shard_tensor(torch.zeros(6, 2), 0, tp)


# ---------------------------------------------------------------- the decoder's communication
DEC = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)


def _decoder_ledger(tp_size, sp):
    pgm = minipar.init(ParallelismConfig(tp_size=tp_size, sequence_parallel=sp))
    cfg = LlamaConfig(**DEC)
    model = LlamaForCausalLM(cfg, pgm, seed=0)
    b, s = 2, 16
    ids = torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(0))
    with comm_ledger.ledger() as led:
        loss = model(ids, labels=ids)
        comm_ledger.mark("backward")
        loss.backward()
    cut = led.events.index("backward")
    fwd = comm_ledger.Ledger(led.events[:cut])
    bwd = comm_ledger.Ledger(led.events[cut + 1:])
    summary = lambda l: sorted((r.op, r.group, r.numel) for r in l.records)   # noqa: E731
    return summary(fwd), summary(bwd), fwd.wire_bytes(), bwd.wire_bytes()


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_decoder_collectives_match_the_count(tp_size, sp):
    L, bsh, tokens, h = DEC["num_hidden_layers"], 2 * 16 * DEC["hidden_size"], 2 * 16, DEC["hidden_size"]
    ledgers = run_world(_decoder_ledger, tp_size, tp_size, sp, timeout=180)
    assert all(led == ledgers[0] for led in ledgers), "every tp rank runs the same collectives"
    fwd, bwd, fwd_wire, bwd_wire = ledgers[0]
    loss_ops = [("all_reduce", "tp", tokens), ("all_reduce", "tp", 2 * tokens)]   # max; sum exp + target
    if not sp:
        # forward: the embedding's g + 2 g per block (o_proj, down_proj); backward: 2 f per block
        # (before q/k/v and gate/up) + the lm_head's f. Nothing else: no gathers, no norm traffic.
        want_fwd = sorted([("all_reduce", "tp", bsh)] * (2 * L + 1) + loss_ops)
        want_bwd = [("all_reduce", "tp", bsh)] * (2 * L + 1)
    else:
        # each activation all-reduce becomes a reduce-scatter + an all-gather of the same full size;
        # backward swaps them, and the norm weights (seeing a sequence shard) are summed over tp
        act = [("all_gather", "tp", bsh)] * (2 * L + 1) + [("reduce_scatter", "tp", bsh)] * (2 * L + 1)
        want_fwd = sorted(act + loss_ops)
        want_bwd = sorted(act + [("all_reduce", "tp", h)] * (2 * L + 1))
    assert fwd == want_fwd
    assert bwd == want_bwd
    # on the wire (ring): an all-reduce sends 2(n-1)/n of its buffer, a reduce-scatter or an
    # all-gather (n-1)/n, so with or without SP the activations cost (4L + 2) x N*h*4 x (n-1)/n
    ar = 2 * (tp_size - 1) / tp_size
    act_wire = (2 * L + 1) * bsh * 4 * ar
    assert fwd_wire == pytest.approx(act_wire + 3 * tokens * 4 * ar)
    assert bwd_wire == pytest.approx(act_wire + sp * (2 * L + 1) * h * 4 * ar)
