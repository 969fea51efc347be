"""LoRA on a mixture of experts, as Axolotl and PEFT run it: lora_target_linear on a model whose every
layer is MoE adapts the attention's projections and leaves the experts and routers frozen.

PEFT's all-linear (what Axolotl's lora_target_linear amounts to: find_all_linear_names) adapts the
nn.Linear modules it finds; transformers 5 stacks a Mixtral's or Qwen3-MoE's experts in 3-D
parameters and routes with a bare weight, so on those models it adapts q, k, v and o_proj only, as
minipar does (models/moe.py stacks them too). A dense layer among MoE layers (Qwen3-MoE's
mlp_only_layers) keeps its gate/up/down_proj targets. Naming a projection no layer has is refused
with the lora_target_modules to write. Held here: the targets and the refusal (no ranks); PEFT's own
choice on transformers' Mixtral; a run on dp_shard 2 x ep 2 like one process with the experts
unchanged and the run's log saying they stay frozen; the adapter directory PEFT loads around the
transformers base with the run's logits.
"""
import json
import os

import pytest
import torch
import transformers
from harness import run_world

from minipar.lora import check_targets
from minipar.trainer.config.train_config import load_config
from minipar.trainer.data.tokenizer import save_byte_tokenizer
from minipar.trainer.run_setup import setup_run
from minipar.trainer.trainer import Trainer
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = os.path.join(ROOT, "configs", "moe.yaml")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
SHAPE = dict(model_type="mixtral", vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
LORA = ["--adapter", "lora", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_linear", "true",
        "--learning_rate", "1e-2"]


def test_target_linear_on_moe_adapts_the_attention_and_refuses_what_no_layer_has():
    mixtral = LlamaConfig(**SHAPE)
    assert LlamaForCausalLM.lora_targets_of(mixtral) == tuple(ATTENTION)
    declared = LlamaForCausalLM.lora_target_modules
    assert check_targets(None, True, ATTENTION, declared) == ATTENTION
    assert check_targets(["o_proj", "q_proj"], False, ATTENTION, declared) == ["q_proj", "o_proj"]
    with pytest.raises(ValueError, match=r"lora_target_modules \['gate_proj', 'down_proj'\]: no layer of "
                                         r"this model has them .* write lora_target_modules: "
                                         r"\[q_proj, k_proj, v_proj, o_proj\]"):
        check_targets(["q_proj", "gate_proj", "down_proj"], False, ATTENTION, declared)
    # a dense layer among the MoE ones keeps the MLP's targets (Qwen3-MoE's mlp_only_layers)
    mixed = LlamaConfig(**dict(SHAPE, model_type="qwen3_moe", moe_intermediate_size=24, mlp_only_layers=[0]))
    assert LlamaForCausalLM.lora_targets_of(mixed) == declared
    # the config: accepted with lora_target_linear, refused in the one message with a projection it lacks
    assert load_config(MOE, LORA).lora_target_linear
    with pytest.raises(ValueError, match=r"write lora_target_modules: \[q_proj, k_proj, v_proj, o_proj\]"):
        load_config(MOE, LORA[:6] + ["--lora_target_modules", "[q_proj, up_proj]"])


def _peft_all_linear():
    import peft
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{k: v for k, v in SHAPE.items()
                                                                      if k != "model_type"}))
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules="all-linear"))
    return sorted(model.peft_config["default"].target_modules)


def test_peft_all_linear_on_transformers_mixtral_is_the_attention():
    """What minipar's lora_target_linear adapts is what PEFT's all-linear adapts on the same family."""
    assert run_world(_peft_all_linear, 1, timeout=120)[0] == sorted(ATTENTION)


def _ids():
    # made when a test needs them: a torch op in the test process before the ranks fork can hang them
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))


def _write_base(directory):
    from minipar.trainer.data.make_example import write_checkpoint
    torch.set_num_threads(1)
    write_checkpoint(directory, LlamaConfig(**SHAPE, router_aux_loss_coef=0.1), dtype=torch.float32)
    save_byte_tokenizer(directory)                 # base_model is also the tokenizer: bytes


def _run(argv):
    torch.set_num_threads(1)
    trainer = Trainer(setup_run(argv))
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    history = trainer.train()
    same = all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    trained = sorted({n.split(".")[-3] for n, p in trainer.model.named_parameters() if p.requires_grad})
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(_ids())
    return dict(curve=[(r["loss"], r["grad_norm"]) for r in history], base_unchanged=same and bool(frozen),
                trained=trained, logits=logits)


def _argv(base, out, *extra):
    return [os.path.join(ROOT, "configs", "finetune_moe.yaml"), "--base_model", str(base), "--output_dir",
            str(out), "--datasets", "[]", "--sample_packing", "false", "--val_set_size", "0", "--dataset",
            os.path.join(ROOT, "data", "shakespeare.txt"), "--sequence_len", "16", "--global_batch_size", "4",
            "--micro_batch_size", "2",        # the same micro-batches on both layouts (models/moe_aux.py)
            "--peak_tflops", "1", "--loss_curve", "false",   # no peak measured, no PNG: unread here
            "--max_steps", "3", "--warmup_steps", "1", "--eval_steps", "0", "--progress_bar", "false",
            "--save_final_checkpoint", "false", "--context_parallel_size", "1", "--tensor_parallel_size", "1",
            *LORA, "--merge_lora", "false", *extra]


def test_lora_target_linear_on_moe_trains_like_one_process_and_peft_loads_it(tmp_path, capfd):
    """A Hub-layout Mixtral as base_model, lora_target_linear: dp_shard 2 x ep 2 follows one process,
    the experts (the whole base) stay bit-identical, the log says they are frozen, and the adapter
    directory (attention targets only) loads in PEFT around transformers' Mixtral with the run's
    logits."""
    import peft
    base = tmp_path / "base"
    run_world(_write_base, 1, str(base), timeout=120)
    one = run_world(_run, 1, _argv(base, tmp_path / "one", "--dp_shard_size", "1", "--expert_parallel_size",
                                   "1"), timeout=300)[0]
    log = capfd.readouterr().out
    assert "the experts and routers of the 2 mixture-of-experts layers frozen too" in log, log[-2000:]
    assert one["trained"] == sorted(ATTENTION) and one["base_unchanged"]
    out = tmp_path / "ep"
    for got in run_world(_run, 2, _argv(base, out, "--dp_shard_size", "2", "--expert_parallel_size", "2"),
                         timeout=300):
        for (a, ga), (b, gb) in zip(one["curve"], got["curve"]):
            assert abs(a - b) <= 1e-4 * abs(a) and abs(ga - gb) <= 1e-4 * abs(ga) + 1e-7, (one, got)
        assert got["base_unchanged"] and got["trained"] == sorted(ATTENTION) and len(got["curve"]) == 3
        torch.testing.assert_close(got["logits"], one["logits"], atol=1e-5, rtol=1e-5)
    config = json.load(open(out / "adapter_config.json"))
    assert sorted(config["target_modules"]) == sorted(ATTENTION)
    hf = transformers.MixtralForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(hf, str(out)).eval()
        torch.testing.assert_close(adapted(input_ids=_ids()).logits, one["logits"], atol=1e-5, rtol=1e-5)


def test_planner_counts_lora_on_moe_exactly(tmp_path):
    """The plan of such a run (minipar/trainer/prediction.py reads the same targets): state, gathered
    bytes and the ledger exactly on dp_shard 2 x tp 2 + SP x ep 2 with checkpointing (no gradient of
    the frozen routers and experts summed over tp, none reduce-scattered over edp)."""
    from test_plan import _argv as plan_argv
    from test_plan import _measure_all
    from test_plan_moe import _check
    argv = plan_argv("moe.yaml", tmp_path / "plan", "--micro_batch_size", "1", *LORA[:8],
                     "--tensor_parallel_size", "2", "--dp_shard_size", "2", "--sequence_parallel", "true",
                     "--gradient_checkpointing", "true")
    per_rank = run_world(_measure_all, 4, [argv], False, timeout=300)   # no activations measured:
    _check([r[0] for r in per_rank], check_activations=False)    # LoRA's activations: a full run's (model.py)
