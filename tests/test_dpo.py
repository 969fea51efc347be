"""DPO (minipar/dpo/objective.py, minipar/dpo_step.py): ln 2 at step 0 (1 for hinge), the loss and
every gradient of sigmoid (with and without label smoothing), robust, hinge and ipo equal to the
formula computed by a plain fp64 model, and every layout equal to one process, an MoE with ep 2 (its
load-balancing loss in the objective) and robust DPO with label smoothing among them."""
from __future__ import annotations

import math

import pytest
import torch
from harness import run_world

import minipar
from minipar.config import ParallelismConfig
from minipar.recipe import LoRA

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2)
# a Qwen3-MoE of the same size: layer 0 dense, layer 1 4 experts top-2, the aux loss on (its
# coefficient large enough that a lost or doubled term of it shows)
MOE = dict(CFG, model_type="qwen3_moe", decoder_sparse_step=2, num_local_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, router_aux_loss_coef=0.05)
MODELS = {"dense": CFG, "moe": MOE}
P, T = 4, 16            # pairs per global batch, tokens per row


def pairs(step: int):
    """Global pair rows (2P, T) [c0, r0, c1, r1, ...]: a shared prompt (labels -100), then two
    different responses of different lengths, padded (labels -100)."""
    from minipar.dpo_step import pair_rows
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, CFG["vocab_size"], (2, P, T + 1), generator=g)
    ids[1, :, :5] = ids[0, :, :5]                                 # the prompt: 5 tokens, the same
    labels = ids[:, :, 1:].clone()
    labels[:, :, :4] = -100                                       # the prompt's next tokens
    for k in range(P):                                            # the responses end at different places
        labels[0, k, T - k:] = -100
        labels[1, k, T - 2 * k - 1:] = -100
    return pair_rows(ids[0, :, :-1], ids[1, :, :-1]), pair_rows(labels[0], labels[1])


def _prepare(sizes, lora: bool, micro: int = 1, config=None, **kw):
    from minipar.api import prepare
    pgm = minipar.init(ParallelismConfig(**sizes))
    recipe = dict(lora=LoRA(r=4, alpha=8.0)) if lora else {}
    model, opt, step = prepare(dict(config or CFG), pgm, learning_rate=kw.pop("lr", 1e-2),
                               micro_batches=micro, max_grad_norm=kw.pop("clip", 1.0), **recipe, **kw)
    return model, step.step


def _run(sizes, lora, steps, loss_type="sigmoid", micro=1, settings=None, config=None, label_smoothing=0.0):
    """Per step (loss, margins, accuracy, logps/chosen, rewards/chosen, an MoE's aux loss) of a few
    DPO steps on `sizes`."""
    from minipar.dpo_step import DPOStep
    model, step = _prepare(sizes, lora, micro, config, **(settings or {}))
    dpo = DPOStep(step, beta=0.5, loss_type=loss_type, reference="lora" if lora else "precomputed",
                  label_smoothing=label_smoothing)
    # two batches in turn: a pair seen again must have gained (random tokens do not generalise)
    refs = None if lora else [dpo.precompute_reference(*pairs(s)) for s in range(2)]
    out = []
    for s in range(steps):
        r = dpo(*pairs(s % 2), ref_logps=None if lora else refs[s % 2])
        m = r["metrics"]
        out.append([float(r["loss"]), float(m["rewards/margins"]), float(m["rewards/accuracies"]),
                    float(m["logps/chosen"]), float(m["rewards/chosen"]),
                    float(r["moe"].get("moe_aux_loss", 0.0))])
    return out


# ------------------------------------------------------------------ step 0: ln 2
_ONE = {}


def _both(sizes, steps, micro, settings, model="dense"):
    return [_run(sizes, lora, steps, micro=micro, settings=settings, config=MODELS[model])
            for lora in (True, False)]


def one_process(steps, model="dense", micro=1):
    """LoRA's and the full fine-tune's figures on one process, run once per step count, model and
    micro-batch count."""
    if (steps, model, micro) not in _ONE:
        _ONE[steps, model, micro] = run_world(_both, 1, {}, steps, micro, {}, model, timeout=120)[0]
    return _ONE[steps, model, micro]


def test_loss_is_ln2_at_step0_when_reference_is_policy():
    """LoRA (B = 0: the adapters off are the policy) and full (the reference precomputed from the
    starting weights): z = 0 for every pair, so -log sigmoid(0) = ln 2, and every reward is 0."""
    for run in one_process(3):
        loss, margin, acc, logps_c, reward_c, aux = run[0]
        assert loss == pytest.approx(math.log(2), abs=1e-7)
        assert margin == 0.0 and reward_c == 0.0 and acc == 0.0 and aux == 0.0
        assert logps_c < 0


def test_moe_loss_at_step0_is_ln2_plus_the_aux_loss():
    """An MoE's objective is DPO's plus router_aux_loss_coef x its load-balancing loss (TRL's
    aux_loss_enabled): at step 0, ln 2 + 0.05 x the mean aux of the step's micro-batches."""
    for run in one_process(3, "moe", 2):
        loss, margin, acc, logps_c, reward_c, aux = run[0]
        assert aux > 1.0                                      # top-2 of 4: about 2 when balanced
        assert loss == pytest.approx(math.log(2) + MOE["router_aux_loss_coef"] * aux, abs=1e-6)
        assert margin == 0.0 and reward_c == 0.0


# ------------------------------------------------------------------ the other losses at step 0
def _variants_step0():
    """Step 0 (reference = policy, z = 0) of cDPO (sigmoid, eps 0.3), robust (eps 0.2) and hinge."""
    return [_run({}, True, 1, loss_type=t, label_smoothing=eps)[0]
            for t, eps in (("sigmoid", 0.3), ("robust", 0.2), ("hinge", 0.0))]


def test_smoothed_and_hinge_losses_at_step0():
    """z = 0: (1 - eps) ln 2 + eps ln 2 = ln 2 (cDPO), ((1 - eps) - eps) ln 2 / (1 - 2 eps) = ln 2
    (robust), relu(1 - 0) = 1 (hinge)."""
    got = run_world(_variants_step0, 1, timeout=60)[0]
    for (loss, margin, *_), want in zip(got, (math.log(2), math.log(2), 1.0)):
        assert loss == pytest.approx(want, abs=1e-7) and margin == 0.0


# ------------------------------------------------------------------ the formula in fp64
def _plain_loss(pi_c, pi_r, ref_c, ref_r, beta, loss_type, eps):
    """The per-pair losses written out again here (TRL's dpo_loss), in fp64."""
    import torch.nn.functional as F
    z = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    if loss_type == "sigmoid":
        return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    return (z / beta - 1 / (2 * beta)) ** 2


def _formula(loss_type, eps=0.0):
    """minipar's one-process loss and full gradients vs the DPO formula on the same weights in fp64,
    with a reference whose log-probs differ from the policy's (so every term counts)."""
    import torch.nn.functional as F

    from minipar.dpo import PairLoss
    from minipar.dpo_step import DPOStep
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig
    model, step = _prepare({}, False)
    dpo = DPOStep(step, beta=0.5, loss_type=loss_type, reference="precomputed", label_smoothing=eps)
    ids, labels = pairs(0)
    ref = torch.linspace(-5.0, -3.0, 2 * P) if loss_type == "ipo" else torch.linspace(-60.0, -40.0, 2 * P)
    weights = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    micro = dpo.local(ids, labels, ref)
    objective = PairLoss(micro, P, model.pgm, 0.5, loss_type, label_smoothing=eps)
    loss = step.backward(objective, micro)[0]
    grads = {n: p.grad.detach().clone() for n, p in model.model.named_parameters()}
    # the plain reference: the same decoder in fp64, one process, log_softmax and the formula
    plain = LlamaForCausalLM(LlamaConfig.from_dict(dict(CFG)), None).double()
    plain.load_state_dict({n: w.double() for n, w in weights.items()})
    logits = plain(ids)
    mask = labels != -100
    tok = F.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    logps = tok.sum(-1)
    if loss_type == "ipo":
        logps = logps / mask.sum(-1)
    r64 = ref.double()
    losses = _plain_loss(logps[0::2], logps[1::2], r64[0::2], r64[1::2], 0.5, loss_type, eps)
    want = losses.mean()
    want.backward()
    return float(loss), float(want), grads, {n: p.grad for n, p in plain.named_parameters()}


FORMULAS = (("sigmoid", 0.0), ("sigmoid", 0.1), ("robust", 0.2), ("hinge", 0.0), ("ipo", 0.0))


def test_loss_and_gradients_equal_the_formula_in_fp64():
    """sigmoid (eps 0: DPO, 0.1: cDPO), robust (eps 0.2), hinge, and ipo (log-probs averaged over
    each response's tokens, as TRL's ipo)."""
    for got in run_world(_formulas, 1, timeout=60)[0]:
        _check_formula(*got)


def _formulas():
    return [_formula(t, eps) for t, eps in FORMULAS]


def _check_formula(loss, want, grads, want_grads):
    assert loss == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name].double(), g, rtol=1e-4, atol=1e-7, msg=name)
        assert g.abs().max() > 0, name


# ------------------------------------------------------------------ every layout = one process
LAYOUTS = {             # name: (sizes, micro-batches, settings, ranks[, model])
    "dp_shard2": (dict(dp_shard_size=2), 1, {}, 2),
    "tp2_sp": (dict(tp_size=2, sequence_parallel=True), 1, {}, 2),
    "cp2": (dict(cp_size=2), 1, {}, 2),
    "pp2": (dict(pp_size=2), 2, dict(pipeline_schedule="1f1b"), 2),
    # the default suite's two worlds: every dimension above, two at a time
    "dp_shard2_tp2_sp": (dict(dp_shard_size=2, tp_size=2, sequence_parallel=True), 1, {}, 4),
    "pp2_cp2": (dict(pp_size=2, cp_size=2), 2, dict(pipeline_schedule="1f1b"), 4),
    # an MoE, its experts split over ep 2 (borrowed from dp_shard 2, their ZeRO-3 group edp 1)
    "moe_dp_shard2_ep2": (dict(dp_shard_size=2, ep_size=2), 1, {}, 2, "moe"),
    # ep 2 over dp_shard x cp: the aux loss's counts summed over cp, each row whole
    "moe_dp_shard2_cp2_ep2": (dict(dp_shard_size=2, cp_size=2, ep_size=2), 1, {}, 4, "moe"),
}


def _check_layout(name, steps):
    """The figures of every rank equal one process's. The aux loss is not linear in the tokens (it
    is computed per micro-batch, models/moe_aux.py), so the one-process twin of an MoE runs the same
    dp x M micro-batches one after the other, as the trainer's micro-batches keep their rows."""
    sizes, micro, settings, ranks, *model = LAYOUTS[name]
    model = model[0] if model else "dense"
    dp = sizes.get("dp_shard_size", 1) * sizes.get("dp_replicate_size", 1)
    one = one_process(steps, model, dp * micro if model == "moe" else 1)
    many = run_world(_both, ranks, sizes, steps, micro, settings, model, timeout=240)
    assert all(r == many[0] for r in many)                        # every rank reads the same figures
    for mine, ref in zip(many[0], one):                           # LoRA, then full
        assert torch.tensor(mine).double() == pytest.approx(torch.tensor(ref).double(), abs=1e-4, rel=1e-4)
    for run in one:                                               # and it learns
        assert run[-1][0] < run[0][0]


@pytest.mark.parametrize("name", ["dp_shard2_tp2_sp", "pp2_cp2", "moe_dp_shard2_ep2"])
def test_layouts_equal_one_process(name):
    _check_layout(name, 3)


def _robust(sizes, steps):
    return _run(sizes, True, steps, loss_type="robust", label_smoothing=0.2)


def test_robust_smoothed_layout_equals_one_process():
    """The robust loss with eps 0.2 (LoRA's reference) on dp_shard 2 x tp 2 + SP equals one process."""
    one = run_world(_robust, 1, {}, 3, timeout=120)[0]
    many = run_world(_robust, 4, LAYOUTS["dp_shard2_tp2_sp"][0], 3, timeout=240)
    assert all(r == many[0] for r in many)
    assert one[0][0] == pytest.approx(math.log(2), abs=1e-7) and one[-1][0] < one[0][0]
    assert torch.tensor(many[0]).double() == pytest.approx(torch.tensor(one).double(), abs=1e-4, rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp_shard2", "tp2_sp", "cp2", "pp2", "moe_dp_shard2_ep2",
                                  "moe_dp_shard2_cp2_ep2"])
def test_layouts_equal_one_process_20_steps(name):
    _check_layout(name, 20)


# ------------------------------------------------------------------ the frozen copy = precomputed
def _frozen(sizes, steps, model="dense", dtype="float32"):
    """(precomputed's figures, the frozen copy's, what the copy is) over `steps` steps on `sizes`:
    two policies from the same seed, one per reference."""
    from minipar.api import model_config
    from minipar.dpo_reference import frozen_copy
    from minipar.dpo_step import DPOStep
    config = MODELS[model]
    want = _run(sizes, False, steps, settings=dict(dtype=dtype), config=config)
    policy, step = _prepare(sizes, False, 1, config, dtype=dtype)
    ref = frozen_copy(policy, model_config(dict(config))[0])
    before = [p.detach().clone() for p in ref.model.parameters()]
    dpo = DPOStep(step, beta=0.5, reference="frozen", ref_model=ref)
    got = []
    for s in range(steps):
        r = dpo(*pairs(s % 2))
        m = r["metrics"]
        got.append([float(r["loss"]), float(m["rewards/margins"]), float(m["rewards/accuracies"]),
                    float(m["logps/chosen"]), float(m["rewards/chosen"]),
                    float(r["moe"].get("moe_aux_loss", 0.0))])
    params = list(ref.model.parameters())
    held = dict(sharded=ref.sharded, trainable=any(p.requires_grad or p.grad is not None for p in params),
                unchanged=all(torch.equal(a, b) for a, b in zip(before, params)),
                dtypes={str(p.dtype) for p in params}, grad_sync=ref.grad_sync is not None)
    return want, got, held


FROZEN = {              # name: (sizes, ranks, model, dtype, the copy ZeRO-3 sharded)
    "one_process": ({}, 1, "dense", "float32", False),
    "dp_shard2": (dict(dp_shard_size=2), 2, "dense", "float32", True),
    "dp_shard2_ep2_bf16": (dict(dp_shard_size=2, ep_size=2), 2, "moe", "bfloat16", True),
    # slow: the copy cut like the policy on every other dimension
    "pp2": (dict(pp_size=2), 2, "dense", "float32", False),
    "tp2_sp": (dict(tp_size=2, sequence_parallel=True), 2, "dense", "float32", False),
    "cp2": (dict(cp_size=2), 2, "dense", "float32", True),
    "dp_replicate2": (dict(dp_replicate_size=2), 2, "dense", "float32", False),
}


@pytest.mark.parametrize("name", ["one_process", "dp_shard2", "dp_shard2_ep2_bf16",
                                  *[pytest.param(n, marks=pytest.mark.slow)
                                    for n in ("pp2", "tp2_sp", "cp2", "dp_replicate2")]])
def test_frozen_copy_equals_the_precomputed_reference(name):
    """Both references are the starting weights' log-probs: the same losses and metrics over 3 steps.
    The copy is ZeRO-3 sharded where the policy is (bf16 shards under bf16: the numbers its gathers
    make anyway), holds no gradient and no DDP, and never changes."""
    sizes, ranks, model, dtype, sharded = FROZEN[name]
    outs = run_world(_frozen, ranks, sizes, 3, model, dtype, timeout=120)
    for want, got, held in outs:
        assert torch.tensor(got).double() == pytest.approx(torch.tensor(want).double(), abs=1e-6, rel=1e-6)
        assert held["sharded"] == sharded and not held["trainable"] and held["unchanged"]
        assert not held["grad_sync"]
        assert held["dtypes"] == ({"torch.bfloat16"} if dtype == "bfloat16" else {"torch.float32"})
    assert outs[0][0][-1][0] < outs[0][0][0][0]                # it learns


def _refusals():
    from minipar.api import model_config
    from minipar.compose import build
    from minipar.dpo_reference import frozen_copy
    from minipar.dpo_step import DPOStep
    from minipar.recipe import Recipe
    out, config = [], model_config(dict(CFG))[0]
    lora_model, lora_step = _prepare({}, True)
    full_model, full_step = _prepare({}, False)
    copy = frozen_copy(full_model, config)
    for make in (lambda: DPOStep(full_step, reference="frozen"),
                 lambda: DPOStep(lora_step, reference="frozen", ref_model=copy),
                 lambda: DPOStep(full_step, reference="precomputed", ref_model=copy),
                 lambda: build(config, full_model.pgm, Recipe(lora=LoRA()), frozen=True),
                 lambda: DPOStep(full_step, loss_type="robust", reference="precomputed", label_smoothing=0.5),
                 lambda: DPOStep(full_step, loss_type="ipo", reference="precomputed", label_smoothing=0.1)):
        try:
            make()
            out.append(None)
        except ValueError as err:
            out.append(str(err))
    return out


def test_a_reference_the_model_cannot_hold_or_a_bad_smoothing_is_refused():
    got = run_world(_refusals, 1, timeout=60)[0]
    assert "'frozen' needs ref_model=frozen_copy(policy" in got[0]
    assert "'frozen' with LoRA: the base with the adapters off is that copy" in got[1]
    assert "'precomputed' takes no ref_model" in got[2]
    assert "a frozen copy takes no LoRA adapters" in got[3]
    assert "dpo_label_smoothing must be in [0, 0.5)" in got[4] and "got 0.5" in got[4]
    assert "dpo_label_smoothing 0.1 with dpo_loss_type ipo: the ipo loss takes no label smoothing" in got[5]


# ------------------------------------------------------------------ preference rows
class _CharTokenizer:
    """One token per character (ids 3..), a chat template of tagged turns ending in eos '$'."""
    bos_token_id, eos_token_id, eos_token = 1, 2, "$"

    def encode(self, text):
        return [3 + ord(c) % 60 for c in text]

    def encode_with_offsets(self, text):
        return self.encode(text), [(i, i + 1) for i in range(len(text))]

    def render_chat(self, messages):
        return "".join(f"<{m['role'][0]}>{m['content']}$" for m in messages)


def test_preference_rows_chat_and_plain_forms(tmp_path):
    import json

    from minipar.trainer.data.preference import load_pairs
    path = tmp_path / "prefs.jsonl"
    rows = [dict(messages=[dict(role="user", content="hi"), dict(role="assistant", content="yo"),
                           dict(role="user", content="and?")],
                 chosen=dict(role="assistant", content="good"),
                 rejected=dict(role="assistant", content="bad")),
            dict(prompt="ab", chosen="cd", rejected="efg"),
            dict(prompt="ab", chosen="same", rejected="same")]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    ci, cl, ri, rl, notes = load_pairs(str(path), _CharTokenizer(), 40)
    assert ci.shape == (2, 40) and "1 row(s) with chosen == rejected" in notes[0]
    # the chat row: trained on "good$" only (not the earlier assistant turn "yo$")
    text = "<u>hi$<a>yo$<u>and?$<a>good$"
    trained = [text[t + 1] for t in range(len(text) - 1) if cl[0, t] != -100]
    assert "".join(trained) == "good$"
    assert int((rl[0] != -100).sum()) == len("bad$")
    # the plain row: bos ab | cd eos: the labels of c, d and eos
    assert int((cl[1] != -100).sum()) == 3 and int((rl[1] != -100).sum()) == 4
    path.write_text(json.dumps(dict(prompt="ab", chosen="x")))
    with pytest.raises(ValueError, match=r"prefs.jsonl:1: a preference row needs `rejected`"):
        load_pairs(str(path), _CharTokenizer(), 40)
    path.write_text(json.dumps(dict(prompt="a" * 50, chosen="x", rejected="y")))
    with pytest.raises(ValueError, match="the prompt is 51 tokens, sequence_len 40"):
        load_pairs(str(path), _CharTokenizer(), 40)
