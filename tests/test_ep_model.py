"""An MoE decoder with its experts split over ep and ZeRO-3-sharded over edp (minipar/expert_parallel/
sharding.py, minipar/zero3/) against one process, in fp64: the loss with the aux loss in it, every
full gradient (experts, router, attention, embeddings), the dropped-token count under a capacity
factor, and the full state dict. One micro-batch per dp rank; the one-process twin runs the same
micro-batches one after the other, each weighted 1/dp in the aux loss, as the trainer does."""
import pytest
import torch
from harness import run_world

import minipar
from minipar import ParallelismConfig, comm, comm_ledger
from minipar.training.data.batches import local_batch
from minipar.zero3 import fully_shard
from models.llama import LlamaForCausalLM
from models.llama_config import LlamaConfig

B, T = 4, 16


def _config(capacity=None, top_k=2):
    return LlamaConfig(model_type="mixtral", vocab_size=256, hidden_size=32, intermediate_size=24,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       num_local_experts=4, num_experts_per_tok=top_k, router_aux_loss_coef=0.05,
                       moe_capacity_factor=capacity, max_position_embeddings=64)


def _batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (B, T), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _model(config, pgm, sharded):
    model = LlamaForCausalLM(config, pgm, seed=5).double()
    with torch.no_grad():                     # a router far from uniform: routing is uneven
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(40)
                if config.num_experts_per_tok == 1:
                    # top-1 over logits (a, -a, 0, 0): every token goes to expert 0 or 1, so the ep
                    # rank holding experts 2 and 3 receives no token at all, in every layer
                    p[1], p[2:] = -p[0], 0.0
    return fully_shard(model, pgm) if sharded else model


def _step(model, pgm, ids, labels):
    """This rank's micro-batch: (loss with the aux loss, dropped copies)."""
    batch = local_batch(ids, labels, pgm)
    loss = model(batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                 num_items_in_batch=labels.numel(), aux_weight=1.0 / pgm.dp.size)
    loss.backward()
    return loss.detach(), model.moe_metrics["dropped"]


def _case(sizes, capacity, top_k=2):
    pgm = minipar.init(ParallelismConfig(**sizes))
    config, (ids, labels) = _config(capacity, top_k), _batch()
    model = _model(config, pgm, sharded=pgm.dp_shard_cp.size > 1)
    with comm_ledger.ledger() as led:
        loss, dropped = _step(model, pgm, ids, labels)
    # per MoE layer: the counts once, the tokens four times (dispatch, combine, and their backwards)
    layers = config.num_hidden_layers
    assert (led.count("all_to_all", "ep"), led.count("all_to_all_uneven", "ep")) == (layers, 4 * layers)
    dropped = torch.tensor([float(dropped)], dtype=torch.float64)
    comm.all_reduce(loss, pgm.dp_cp)
    if pgm.cp.size == 1:        # under cp the caps are a rank's own tokens' (models/moe.py)
        comm.all_reduce(dropped, pgm.dp)
    grads = model.zero3.full_from_shards([s.grad for s in model.zero3.shards])
    weights = model.full_state_dict()
    # one process, the dp ranks' micro-batches in turn, each 1/dp of the aux loss
    ref, ref_loss, ref_dropped = _model(config, None, sharded=False), 0.0, 0
    for r in range(pgm.dp.size):
        rows = slice(r * B // pgm.dp.size, (r + 1) * B // pgm.dp.size)
        part = ref(ids[rows], labels=labels[rows], num_items_in_batch=labels.numel(),
                   aux_weight=1.0 / pgm.dp.size)
        part.backward()
        ref_loss, ref_dropped = ref_loss + part.item(), ref_dropped + ref.moe_metrics["dropped"]
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    errors = [n for n in ref_grads if not torch.allclose(grads[n], ref_grads[n], rtol=1e-9, atol=1e-12)]
    assert set(grads) == set(ref_grads)
    assert all(torch.equal(weights[n], p.detach()) for n, p in ref.named_parameters())
    if top_k == 1:                            # experts 2 and 3 saw nothing: their gradient is zero
        assert all(not g[2:].any() and g[:2].any() for n, g in ref_grads.items() if ".experts." in n)
    return loss.item(), ref_loss, dropped.item(), ref_dropped, errors


LAYOUTS = [
    pytest.param(2, dict(dp_shard_size=2, ep_size=2), None, id="shard2-ep2"),
    pytest.param(2, dict(dp_shard_size=2, ep_size=2), 1.0, id="shard2-ep2-capacity"),
    pytest.param(2, dict(dp_shard_size=2, ep_size=2), "top1", id="shard2-ep2-a-rank-gets-no-token"),
    pytest.param(4, dict(dp_shard_size=4, ep_size=4), None, id="shard4-ep4", marks=pytest.mark.slow),
    pytest.param(4, dict(dp_shard_size=4, ep_size=2), None, id="shard4-ep2", marks=pytest.mark.slow),
    pytest.param(4, dict(dp_shard_size=2, tp_size=2, ep_size=2), None, id="shard2-tp2-ep2",
                 marks=pytest.mark.slow),
    pytest.param(4, dict(dp_replicate_size=2, dp_shard_size=2, ep_size=2), 1.0, id="hsdp-ep2",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world,sizes,capacity", LAYOUTS)
def test_gradients_equal_one_process_fp64(world, sizes, capacity):
    top_k = 1 if capacity == "top1" else 2
    capacity = None if capacity == "top1" else capacity
    for loss, ref_loss, dropped, ref_dropped, errors in run_world(_case, world, sizes, capacity, top_k,
                                                                  timeout=240):
        assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), (loss, ref_loss)
        assert not errors, f"gradients differ from one process: {errors}"
        assert dropped == ref_dropped and (capacity is None) == (dropped == 0), (dropped, ref_dropped)
