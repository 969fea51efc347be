"""minipar's ZeRO-3 against torch's FSDP2, and minipar's DDP against torch's DistributedDataParallel.

    .venv/bin/python benchmarks/bench_zero3.py [--steps 8] [--out benchmarks/results/bench_zero3.md]

Same tiny Llama (minipar's models/llama.py, seed 0), same ranks (forked gloo processes on the CPU,
one torch thread each, via tests/harness.py), same batch per rank, AdamW. Per run and rank:

  step ms        fastest wall time of a training step (forward, backward, optimizer) after warm-up,
                 and the median (the machine is shared: the fastest step is the least disturbed)
  vs torch       that time over torch's for the same layout (FSDP2 for ZeRO-3 runs, DDP for DDP)
  shards         parameter bytes the rank keeps between steps (ZeRO-3: its 1/N shards)
  peak gathered  the most gathered (unsharded) parameter bytes alive at once, sampled at every
                 tensor autograd saves or unpacks (both libraries alike); minipar also counts it
                 exactly at each allocation ("exact")
  grads, optim   gradient bytes held after backward, optimizer-state bytes (exp_avg, exp_avg_sq)
  comm           bytes put into collectives in one step (all-gather output, reduce-scatter input,
                 all-reduce buffer), and the theory: ZeRO-3 2P + G, DDP G (P, G: param/grad bytes)

Both ZeRO-3 runs reshard every unit after forward, the root too (FSDP2's default keeps its root
gathered; here the schedules are made the same so the bytes compare). FSDP2's gathered bytes are read
from its private per-parameter all-gather outputs (torch internals, for measurement only). On the
CPU with gloo nothing overlaps for real (no streams), and 2 cores host up to 4 ranks, so times are
noisy and say more about per-step overheads than about a GPU cluster.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import minipar  # noqa: E402
from minipar import ParallelismConfig, comm  # noqa: E402
from models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from harness import run_world  # noqa: E402

CFG = dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
           num_attention_heads=4, num_key_value_heads=4)
ROWS, SEQ = 2, 128
MB = 2 ** 20


def _local_bytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _fsdp2():
    """(fully_shard, FSDPModule): public in torch.distributed.fsdp from 2.6; 2.4 and 2.5 keep FSDP2
    in torch.distributed._composable.fsdp."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import FSDPModule, fully_shard
    return fully_shard, FSDPModule


def _fsdp2_gathered(model):
    FSDPModule = _fsdp2()[1]
    total = 0
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in (group.fsdp_params if group else []):
            total += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
    return total


class _TorchCommCounter:
    """Counts the bytes FSDP2 hands to torch.distributed (it calls these by module attribute)."""
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


def _world(kind, n, prefetch, steps):
    shard = kind in ("minipar-zero3", "fsdp2")
    sizes = dict(dp_shard_size=n) if shard else dict(dp_replicate_size=n)
    pgm = minipar.init(ParallelismConfig(**sizes))
    cfg = LlamaConfig(**CFG)
    model = LlamaForCausalLM(cfg, pgm if kind.startswith("minipar") else None, seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    exact = None
    if kind == "minipar-zero3":
        from minipar.zero3 import fully_shard
        fully_shard(model, pgm, prefetch=prefetch)
        probe = model.zero3.gathered_bytes
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        torch_fully_shard = _fsdp2()[0]
        mesh = init_device_mesh("cpu", (n,))
        for layer in model.model.layers:
            torch_fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        torch_fully_shard(model, mesh=mesh, reshard_after_forward=True)
        probe = lambda: _fsdp2_gathered(model)  # noqa: E731
    elif kind == "minipar-ddp":
        from minipar.data_parallel import replicate
        replicate(model, pgm.dp_replicate)
        probe = lambda: 4 * n_params  # noqa: E731
    else:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, process_group=pgm.dp_replicate.group)
        probe = lambda: 4 * n_params  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + pgm.global_rank)
    ids = torch.randint(0, cfg.vocab_size, (ROWS, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (ROWS, SEQ), generator=g)
    peak = [0]

    def sample(t):
        peak[0] = max(peak[0], probe())
        return t

    def step(measure=False):
        with torch.autograd.graph.saved_tensors_hooks(sample, sample) if measure else _null():
            model(ids, labels=labels).backward()
        grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return grads

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if kind == "minipar-zero3":
        model.zero3.peak_gathered_bytes = 0
    with comm.ledger() as led, _TorchCommCounter() as counter:
        grads = step(measure=True)
    if kind == "minipar-zero3":
        exact = model.zero3.peak_gathered_bytes
        sent = {}
        for r in led.records:
            sent[r.op] = sent.get(r.op, 0) + r.bytes
    elif kind == "fsdp2":
        sent = counter.bytes
    else:
        sent = {"all_reduce": _ddp_comm_bytes(kind, cfg, pgm, ids, labels)}
    optim = sum(_local_bytes(t) for st in opt.state.values() for k, t in st.items() if k != "step")
    shards = sum(_local_bytes(p) for p in model.parameters())
    return dict(ms=1e3 * min(times), median_ms=1e3 * statistics.median(times), shards=shards, peak=peak[0],
                exact=exact, grads=grads, optim=optim, sent=sent, n_params=n_params)


def _ddp_comm_bytes(kind, cfg, pgm, ids, labels):
    """One step of a fresh replica with a counting wrapper around the all-reduce."""
    if kind == "minipar-ddp":
        from minipar.data_parallel import replicate
        model = LlamaForCausalLM(cfg, pgm, seed=0)
        replicate(model, pgm.dp_replicate)
        with comm.ledger() as led:
            model(ids, labels=labels).backward()
        return led.total_bytes("all_reduce")
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(LlamaForCausalLM(cfg, None, seed=0), process_group=pgm.dp_replicate.group)
    counted = [0]

    def hook(state, bucket):
        counted[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(state, bucket)
    model.register_comm_hook(pgm.dp_replicate.group, hook)
    model(ids, labels=labels).backward()
    return counted[0]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fmt_mb(x):
    return "-" if x is None else f"{x / MB:.2f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_zero3.md"))
    args = parser.parse_args(argv)
    runs = []
    for n in (2, 4):
        runs += [("fsdp2", n, None), ("minipar-zero3", n, 1), ("minipar-zero3", n, 0)]
    for n in (2, 4):
        runs += [("torch-ddp", n, None), ("minipar-ddp", n, None)]
    results = {}
    for kind, n, prefetch in runs:
        results[(kind, n, prefetch)] = r = run_world(_world, n, kind, n, prefetch, args.steps, timeout=600)[0]
        print(f"  {kind} x{n} prefetch={prefetch}: {r['ms']:.1f} ms/step (median {r['median_ms']:.1f})",
              flush=True)
    header = ("| run | ranks | prefetch | step ms (median) | vs torch | shards MB | peak gathered MB (exact) "
              "| grads MB | optim MB | comm MB/step | theory MB |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for (kind, n, prefetch), r in results.items():
        torch_kind = "fsdp2" if kind in ("fsdp2", "minipar-zero3") else "torch-ddp"
        ratio = r["ms"] / results[(torch_kind, n, None)]["ms"]
        p = 4 * r["n_params"]
        theory = 3 * p if torch_kind == "fsdp2" else p
        sent = ", ".join(f"{op} {b / MB:.2f}" for op, b in sorted(r["sent"].items()))
        peak = _fmt_mb(r["peak"]) + (f" ({_fmt_mb(r['exact'])})" if r["exact"] is not None else "")
        pf = "-" if prefetch is None else prefetch
        lines.append(f"| {kind} | {n} | {pf} | {r['ms']:.1f} ({r['median_ms']:.1f}) | {ratio:.2f} "
                     f"| {_fmt_mb(r['shards'])} | {peak} | {_fmt_mb(r['grads'])} | {_fmt_mb(r['optim'])} "
                     f"| {sent} | {theory / MB:.2f} |")
    n_params = next(iter(results.values()))["n_params"]
    text = "\n".join([
        "# bench_zero3: minipar ZeRO-3 vs torch FSDP2, minipar DDP vs torch DDP", "",
        f"Llama {CFG}, {n_params / 1e6:.2f} M parameters ({4 * n_params / MB:.2f} MB fp32); per rank "
        f"{ROWS} x {SEQ} tokens; AdamW; gloo on CPU, 1 thread per rank, {os.cpu_count()} cores; "
        f"torch {torch.__version__}; step time: the fastest of {args.steps} steps (the median in "
        f"brackets; other jobs share these cores, and the fastest step is the least disturbed).", "",
        *lines, "",
        "comm: bytes handed to collectives per rank and step (all-gather: output, reduce-scatter: input, "
        "all-reduce: buffer); on the wire a ring sends (n-1)/n of that (2 (n-1)/n for all-reduce). "
        "theory: ZeRO-3 2P + G (all-gather before forward and before backward, one reduce-scatter), "
        "DDP G; P = G = 4 bytes x parameters. Differences are padding (minipar pads each unit's flat "
        "buffer to a multiple of n; FSDP2 pads each parameter's dim 0).", ""])
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
