"""One CUDA device: training throughput, MFU and peak memory of a ~1 B-parameter Llama in bf16.

    python benchmarks/bench_gpu.py                       Llama-3.2-1B shape, bf16, NCCL world of 1
    python benchmarks/bench_gpu.py --device cpu --tiny   the same code path on the CPU (gloo): the test

What runs: minipar.init() (NCCL when CUDA is there: a real world of one, checked with one
all-reduce), the reference decoder (models/llama.py) with fp32 master weights under bf16 autocast
(the trainer's single-device path), minipar's AdamW, `--steps` timed steps after `--warmup`.
Then the fused path of ring attention's block kernel (minipar/context_parallel/document_attention.py,
which block_attention.py's reference math checks: flash or efficient attention on CUDA, the flash
CPU kernel on the CPU) on one causal square block of the model's attention shape, checked against
an fp32 SDPA and timed forward + backward.

    tokens/s   micro_batch x seq / step time
    MFU        model FLOPs per second / peak FLOP/s (--peak-tflops; default the device's dense bf16
               peak from minipar/gpus.py, 989 where it has none and on the CPU)
    model FLOPs per step = (6 N + 12 L d T) x tokens            (PaLM, Chowdhery et al. 2022, app. B)
               N = parameters that multiply activations (all but the input embedding's lookup; a tied
               lm_head counted once), L layers, d = heads x head_dim, T sequence length; 12 L d T
               counts the attention scores and their product with V (forward 4 L d T, backward
               twice that) over the full T x T square, as PaLM does (a causal kernel skips half)
    peak memory torch.cuda.max_memory_allocated (CPU: peak resident set over the start)

Next to the measured peak it prints the planner's estimate for the same run (`python -m minipar.plan
--model config.json --world 1 --gpus-per-node 1` with this micro-batch, sequence, bf16, checkpointing,
and `--gpu` where the device has a preset in minipar/gpus.py), else the measured value only, with a
note. Results: --out (default
benchmarks/results/bench_gpu.json on CUDA; a CPU run writes only where --out says).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SHAPES = {   # Llama-3.2-1B (1.24 B parameters, tied embeddings), and a tiny twin for the CPU test
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def model_flops_per_token(cfg, n_params: int, seq: int) -> float:
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    d = cfg.num_attention_heads * cfg.head_dim
    return 6 * (n_params - embed) + 12 * cfg.num_hidden_layers * d * seq


def planner_estimate(cfg, mb: int, seq: int, checkpointing: bool, device_name: str = None):
    """(the planner's JSON for this very run, or None; the command, or why not): the same shape,
    micro-batch, sequence, dtype and checkpointing, on the device's data sheet (minipar/gpus.py)
    where it has a preset."""
    import importlib.util
    if importlib.util.find_spec("minipar.plan") is None:
        return None, "minipar.plan is not in this checkout (issue 14 item 5): measured memory only"
    from minipar.gpus import preset_for_device
    gpu = preset_for_device(device_name) if device_name else None
    flags = ["--world", "1", "--gpus-per-node", "1", "--seq-len", str(seq), "--global-batch-size", str(mb),
             "--micro-batch-size", str(mb), "--dtype", "bfloat16"] \
        + (["--gradient-checkpointing"] if checkpointing else []) + (["--gpu", gpu] if gpu else []) \
        + ["--json"]
    from minipar.plan.__main__ import main as plan_main
    out, err = io.StringIO(), io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(cfg.to_hf_dict(), f)
        # the command's own main, in this process (a second interpreter would import torch again)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = plan_main(["--model", path] + flags)
            except SystemExit as e:           # argparse's refusal of a flag
                code = e.code
    shown = "python -m minipar.plan --model config.json " + " ".join(flags)
    if code != 0:
        return None, f"minipar.plan failed ({shown}): {err.getvalue().strip()[-300:]}"
    try:
        return json.loads(out.getvalue()), shown
    except json.JSONDecodeError:
        return None, f"minipar.plan printed no JSON: {out.getvalue()[:200]!r}"


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory(device, rss0):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    from common import peak_rss
    return peak_rss() - rss0


def attention_check(cfg, batch, seq, device, dtype, iters=3):
    """The fused block kernel on one causal square block against fp32 SDPA: error and time."""
    from minipar.context_parallel.document_attention import block_backward, block_forward
    from minipar.context_parallel.fused_attention import default_scale
    g = torch.Generator(device="cpu").manual_seed(0)
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v, dout = (torch.randn(batch, h, seq, hd, generator=g).to(device, dtype)
                     for h in (hq, hkv, hkv, hq))
    scale = default_scale(hd, None)
    times = []
    for _ in range(iters + 1):
        _sync(device)
        t0 = time.perf_counter()
        out, lse, ctx = block_forward(q, k, v, True, scale, impl="fused")
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, True, scale, ctx)
        _sync(device)
        times.append(time.perf_counter() - t0)
    x = [t.float().requires_grad_() for t in (q, k, v)]         # the reference in fp32
    ref = torch.nn.functional.scaled_dot_product_attention(
        x[0], x[1].repeat_interleave(hq // hkv, 1), x[2].repeat_interleave(hq // hkv, 1), is_causal=True)
    ref.backward(dout.float())
    err = max((a.float() - b.float()).abs().max().item()
              for a, b in ((out, ref), (dq, x[0].grad), (dk, x[1].grad)))
    return dict(kernel=ctx[0], ms=1e3 * min(times[1:]), max_abs_err_vs_sdpa=err)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="the tiny shape (the test), instead of --size")
    p.add_argument("--size", default="1b", choices=list(SHAPES))
    p.add_argument("--micro-batch", type=int, default=None, help="default 4 (tiny: 2)")
    p.add_argument("--seq", type=int, default=None, help="default 2048 (tiny: 64)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; tiny 2)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak bf16 dense TFLOP/s of the device (default: its data sheet's, minipar/gpus.py; "
                        "989 where it is not there, and on the CPU)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tiny = args.tiny or args.size == "tiny"
    mb, seq, steps = args.micro_batch or (2 if tiny else 4), args.seq or (64 if tiny else 2048), \
        args.steps or (2 if tiny else 10)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; use --device cpu --tiny for the CPU path")
    if args.device == "cpu":      # gloo and CPU tensors even on a GPU machine: hide the devices before
        os.environ["CUDA_VISIBLE_DEVICES"] = ""           # anything asks CUDA (minipar.init picks by it)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch.distributed as dist
    from common import reset_peak_rss

    import minipar
    from minipar.optim import build_optimizer
    from models.llama import LlamaForCausalLM
    from models.llama_config import LlamaConfig

    rss0 = reset_peak_rss()
    pgm = minipar.init()
    device = minipar.default_device()
    backend = dist.get_backend()
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)                                # a real call on the backend (world of one)
    cfg = LlamaConfig(**SHAPES["tiny" if tiny else args.size], max_position_embeddings=max(seq, 128))
    model = LlamaForCausalLM(cfg, pgm, seed=0).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (mb, seq), generator=g).to(device)
    times, losses = [], []
    for i in range(args.warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    step_s = sorted(times)[len(times) // 2]
    tokens = mb * seq
    flops = model_flops_per_token(cfg, n_params, seq) * tokens
    peak = _peak_memory(device, rss0)
    if args.peak_tflops is None:
        from minipar.gpus import gpu_peak_tflops
        args.peak_tflops = (gpu_peak_tflops(torch.cuda.get_device_name(device)) if device.type == "cuda"
                            else None) or 989.0
    result = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  backend=backend, torch=torch.__version__, shape="tiny" if tiny else args.size,
                  n_params=n_params, micro_batch=mb, seq=seq, dtype="bf16 autocast, fp32 master weights",
                  gradient_checkpointing=args.gradient_checkpointing, steps=steps,
                  step_ms=1e3 * step_s, tokens_per_s=tokens / step_s, model_tflops_per_step=flops / 1e12,
                  mfu=flops / step_s / (args.peak_tflops * 1e12), peak_tflops=args.peak_tflops,
                  peak_memory_bytes=peak, losses=losses,
                  attention=attention_check(cfg, mb, seq, device, torch.bfloat16))
    result["planner"], result["planner_note"] = planner_estimate(
        cfg, mb, seq, args.gradient_checkpointing, result["device"] if device.type == "cuda" else None)
    print(f"{result['device']} ({backend}), {n_params / 1e9:.3f} B parameters, {mb} x {seq} tokens, bf16: "
          f"{result['step_ms']:.0f} ms/step, {result['tokens_per_s']:.0f} tokens/s, "
          f"MFU {100 * result['mfu']:.1f} % "
          f"(of {args.peak_tflops:.0f} TFLOP/s)")
    print(f"peak memory {peak / 2 ** 30:.2f} GiB measured; planner: "
          + (json.dumps(result["planner"])[:400] if result["planner"] is not None
             else result["planner_note"]))
    a = result["attention"]
    print(f"fused block attention ({a['kernel']}): {a['ms']:.2f} ms forward+backward of one "
          f"{mb}x{cfg.num_attention_heads}x{seq}x{cfg.head_dim} block, "
          f"max |error| vs SDPA {a['max_abs_err_vs_sdpa']:.2e}")
    out = args.out or (os.path.join(ROOT, "benchmarks", "results", "bench_gpu.json")
                       if device.type == "cuda" else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(status="measured",
                           command="python benchmarks/bench_gpu.py " + " ".join(argv or sys.argv[1:]),
                           result=result), f, indent=1)
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
