"""Data-parallel variants: minipar ZeRO-3 vs torch FSDP2 (fully_shard, its defaults), minipar DDP vs
torch DistributedDataParallel, and gradient accumulation with and without a reduce-scatter per
micro-batch. Each function here runs on every rank of a fresh world (common.run_variant).

Same Llama (minipar's models/llama.py, seed 0; torch's wrappers get the single-process build of
it), same batch per rank, fp32, AdamW; a step = forward + backward + optimizer step + zero_grad.

    torch FSDP2       fully_shard(layer) for every decoder layer, then fully_shard(model): FSDP2's
                      defaults (reshard_after_forward=True; the root, holding embedding, norm and
                      lm_head, is kept gathered from forward into backward, FSDP2's root rule)
    minipar ZeRO-3    fully_shard(model, pgm, prefetch=1): embedding and each layer a unit, the
                      root (norm, lm_head) kept gathered from forward into backward
    ... accumulation  2 micro-batches of rows/2 each; "no-sync": FSDP2's
                      set_requires_gradient_sync(False) / minipar's zero3.no_sync() on the first

Bytes per step are what each library hands to its collectives (all-gather output, reduce-scatter
input, all-reduce buffer): minipar's ledger; torch's counted by wrapping torch.distributed's
functions FSDP2 calls (DDP's C++ reducer is counted with a comm hook on a second replica). Gathered
parameter bytes are sampled alike for both libraries at every tensor autograd saves or unpacks
(FSDP2: its per-parameter all-gather outputs, torch internals read for measurement only); minipar
also counts them exactly at each gather.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from common import local_bytes, timed_world

ZERO3 = ["torch FSDP2", "minipar ZeRO-3"]
ACCUM = ["torch FSDP2 accum no-sync", "minipar ZeRO-3 accum no-sync", "minipar ZeRO-3 accum sync-each"]
DDP = ["torch DDP", "minipar DDP"]


def _fsdp2():
    """(fully_shard, FSDPModule): public in torch.distributed.fsdp from 2.6; 2.4 and 2.5 keep FSDP2
    in torch.distributed._composable.fsdp."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard
    return fully_shard, FSDPModule


def _fsdp2_gathered(model) -> int:
    FSDPModule = _fsdp2()[1]
    total = 0
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in (group.fsdp_params if group else []):
            total += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
    return total


class TorchCommCounter:
    """Counts the bytes torch code hands to torch.distributed (FSDP2 calls these by module attribute)."""
    NAMES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_reduce")

    def __enter__(self):
        self.bytes, self.saved = {}, {}
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapped(*args, _fn=fn, _name=name, **kw):
                if _name.startswith("reduce_scatter"):       # the input is what is reduced
                    t = args[1] if len(args) > 1 else kw.get("input", kw.get("input_tensor"))
                else:                                        # all-gather output, all-reduce buffer
                    t = args[0] if args else kw.get("output", kw.get("output_tensor", kw.get("tensor")))
                op = _name.split("_single")[0].split("_into")[0].replace("_tensor", "")
                self.bytes[op] = self.bytes.get(op, 0) + t.numel() * t.element_size()
                return _fn(*args, **kw)
            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _batch(cfg, size, rank):
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(0, cfg.vocab_size, (size.rows, size.seq), generator=g)
    return ids, torch.randint(0, cfg.vocab_size, (size.rows, size.seq), generator=g)


def dp_world(variant, size, steps):
    """One variant of ZERO3, ACCUM or DDP on this rank (world = dp_shard or dp_replicate ranks)."""
    import minipar
    from minipar import ParallelismConfig, comm_ledger
    from models.llama import LlamaForCausalLM
    n = dist.get_world_size()
    mine = variant.startswith("minipar")
    micro = 2 if "accum" in variant else 1
    no_sync = "no-sync" in variant
    state = {}

    def build():
        sharded = "DDP" not in variant
        sizes = dict(dp_shard_size=n) if sharded else dict(dp_replicate_size=n)
        pgm = minipar.init(ParallelismConfig(**sizes))
        cfg = size.llama()
        model = LlamaForCausalLM(cfg, pgm if mine else None, seed=0)
        probe = lambda: 0  # noqa: E731
        if variant.startswith("minipar ZeRO-3"):
            from minipar.zero3 import fully_shard
            fully_shard(model, pgm, prefetch=1)
            probe = model.zero3.gathered_bytes
        elif variant.startswith("torch FSDP2"):
            from torch.distributed.device_mesh import init_device_mesh
            torch_fully_shard = _fsdp2()[0]
            mesh = init_device_mesh("cpu", (n,))
            for layer in model.model.layers:
                torch_fully_shard(layer, mesh=mesh)
            torch_fully_shard(model, mesh=mesh)
            probe = lambda: _fsdp2_gathered(model)  # noqa: E731
        elif variant == "minipar DDP":
            from minipar.data_parallel import replicate
            replicate(model, pgm.dp_replicate)
        else:
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model, process_group=pgm.dp_replicate.group)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids, labels = _batch(cfg, size, pgm.global_rank)
        state.update(model=model, opt=opt, probe=probe, held=0, pgm=pgm, cfg=cfg, ids=ids, labels=labels)

        def sync_ctx(last):
            if last or not no_sync:
                return contextlib.nullcontext()
            if mine:
                return model.zero3.no_sync()
            return _fsdp2_no_sync(model)

        def step():
            rows = size.rows // micro
            for m in range(micro):
                with sync_ctx(m == micro - 1):
                    model(ids[m * rows:(m + 1) * rows], labels=labels[m * rows:(m + 1) * rows]).backward()
                if mine and m == 0 and micro > 1:
                    state["held"] = model.zero3.accumulated_grad_bytes()
            opt.step()
            opt.zero_grad(set_to_none=True)
        state["step"] = step
        return step, extras

    def extras():
        model, step, probe = state["model"], state["step"], state["probe"]
        out = dict(n_params=sum(p.numel() for p in _plain(model).parameters()) if not mine else None)
        if mine and hasattr(model, "zero3"):
            out["gathered_exact"] = model.zero3.peak_gathered_bytes
        peak = [0]

        def sample(t):
            peak[0] = max(peak[0], probe())
            return t
        with comm_ledger.ledger() as led, TorchCommCounter() as counter, \
                torch.autograd.graph.saved_tensors_hooks(sample, sample):
            step()
        out["gathered_sampled"] = peak[0]
        out["comm"] = {r: b for r, b in _sum_ops(led.records).items()} if mine else dict(counter.bytes)
        if variant == "torch DDP":
            out["comm"] = {"all_reduce": _torch_ddp_bytes(state)}
        out["held_unsharded_grads"] = state["held"]
        out["state_bytes"] = sum(local_bytes(p) for p in model.parameters())
        return out

    return timed_world(build, steps)


def _fsdp2_no_sync(model):
    @contextlib.contextmanager
    def ctx():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return ctx()


def _plain(model):
    return getattr(model, "module", model)


def _sum_ops(records):
    out = {}
    for r in records:
        out[r.op] = out.get(r.op, 0) + r.bytes
    return out


def _torch_ddp_bytes(state):
    """One step of a second DDP replica whose comm hook counts the all-reduced bucket bytes."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    from models.llama import LlamaForCausalLM
    pgm = state["pgm"]
    model = DistributedDataParallel(LlamaForCausalLM(state["cfg"], None, seed=0),
                                    process_group=pgm.dp_replicate.group)
    counted = [0]

    def hook(st, bucket):
        counted[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(st, bucket)
    model.register_comm_hook(pgm.dp_replicate.group, hook)
    model(state["ids"], labels=state["labels"]).backward()
    return counted[0]
