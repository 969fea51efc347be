"""The planner beside published bf16 training runs: how far its tokens/s per GPU and memory are.

    python benchmarks/plan_vs_published.py     writes benchmarks/results/plan_vs_published.md

Each row is a run someone published with its model, GPUs, layout, batch, sequence and activation
checkpointing; the planner (minipar/plan, default constants: estimate.py's Cluster) is given that
layout and the hardware the source names, and its tokens/s per GPU and memory per GPU are set beside
the published ones. A row passes when the prediction is within 25 % (tokens/s) and 20 % (memory, where
published) of the published figure; a row the planner cannot express says why. Nothing is tuned per
row: the same constants price every run. What differs per row is what its source STATES about the
hardware (torchtitan's 500 W HBM2e H100s) and about how its trainer runs the step, each an Options
flag the time model prices (minipar/plan/time_model.py, overlap.py): fused kernels (torch.compile,
Megatron's Transformer Engine), torchtitan's per-op selective AC, Megatron's distributed optimizer
and --tp-comm-overlap, FSDP gathering once per step under pp and the Llama 3 paper's all-gather CP.
Where a source is silent (AC, micro-batch, schedule), the row says what was assumed.

Published throughput is tokens/s per GPU. Where a source gives TFLOP/s per GPU instead, it is turned
into tokens/s with the source's own FLOP count per token (named in the row): Megatron-LM's is
Narayanan et al. 2021 (arXiv 2104.04473, eq. 3), 72 L h^2 (1 + s / (6 h) + V / (12 h L)) per token,
attention counted whole; the Llama 3 paper defines its MFU by Chowdhery et al. 2023 (PaLM, appendix
B): 6 x (non-embedding params) + 12 L H D s per token, attention counted whole, as torchtitan does.

Sources (each row names its own):
    torchtitan  https://github.com/pytorch/torchtitan/blob/b5bcd76/benchmarks/llama3_h100_202412_torchtitan.md
                https://github.com/pytorch/torchtitan/blob/b5bcd76/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md
                (sequence 8192 and the AC mode: torchtitan's train_configs/llama3_{8b,70b}.toml at the
                commits those files name, 9dec370 and 820504e)
    Megatron    the README of github.com/NVIDIA/Megatron-LM, "Performance Benchmarking",
                images/model_table.png
                (GPT models, vocabulary 131,072, sequence 4,096)
    Llama 3     Grattafiori et al. 2024, "The Llama 3 Herd of Models" (arXiv 2407.21783), Table 4
    picotron    the README of github.com/huggingface/picotron
"""
from __future__ import annotations

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from minipar.plan import activation_bytes as pa  # noqa: E402
from minipar.plan.estimate import Cluster, plan  # noqa: E402
from minipar.plan.inputs import DTYPE_BYTES, Batch, Layout, ModelShape, Options  # noqa: E402
from minipar.plan.pipeline import plan_pipeline  # noqa: E402
from minipar.plan.pipeline_stage import Pipeline  # noqa: E402

OUT = os.path.join(ROOT, "benchmarks", "results", "plan_vs_published.md")
TOKENS_WITHIN, MEMORY_WITHIN = 0.25, 0.20
GiB = 2 ** 30

# Llama 3.1 shapes: the Llama 3 paper's Table 3 (and configs/models/*.json for 8B and 70B)
LLAMA = {"8B": ModelShape(128256, 4096, 14336, 32, 32, 8, 128),
         "70B": ModelShape(128256, 8192, 28672, 80, 64, 8, 128),
         "405B": ModelShape(128256, 16384, 53248, 126, 128, 8, 128)}
# torchtitan's Grand Teton H100s: 96 GB HBM2e at 2.4 TB/s, 500 W (the benchmark file's "Hardware")
GRAND_TETON = dict(gpu_memory_bytes=96e9, hbm_gbps=2400.0, peak_tflops=(835 + 989) / 2)
TITAN = "https://github.com/pytorch/torchtitan/blob/b5bcd76/benchmarks/llama3_h100_202412_torchtitan.md"
ASYNC_TP = "https://github.com/pytorch/torchtitan/blob/b5bcd76/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
MEGATRON = "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a6/images/model_table.png (README)"
LLAMA3 = "https://arxiv.org/abs/2407.21783 (The Llama 3 Herd of Models), Table 4"
GRAND_TETON_NOTE = ("500 W H100s (HBM2e), whose peak the source puts between the NVL's 835 and the SXM's "
                    "989 TFLOP/s without knowing it: planned at the midpoint, 912; the power limit's effect "
                    "on sustained GEMM rates is not stated, and not modelled")
SAC = "torchtitan's per-op SAC (every second matmul recomputed: k, o, up)"
# torchtitan logs `memory: {max_reserved_gib}` (torchtitan/metrics.py: reserved_bytes.all.peak)
TITAN_MEMORY = ("the published memory is torchtitan's logged peak of memory RESERVED by the CUDA caching "
                "allocator (torchtitan/metrics.py, reserved_bytes.all.peak: freed blocks it keeps cached, "
                "and fragmentation), where the planner counts the peak of live tensors (allocated): the "
                "planned figure sits below it by the allocator's slack, which the source does not state")


def gpt(h: int, heads: int, layers: int, tp: int) -> ModelShape:
    """Megatron's GPT (4h GELU MLP, multi-head attention, vocabulary 131,072) as the planner's Llama
    shape: a SwiGLU of intermediate 8h/3 (rounded to a multiple of tp) has the GELU MLP's 8 h^2
    parameters and FLOPs (within 0.01 %)."""
    f = round(8 * h / 3 / tp) * tp
    return ModelShape(131072, h, f, layers, heads, heads, h // heads)


def megatron_flops_per_token(h: int, layers: int, s: int = 4096, vocab: int = 131072) -> float:
    return 72 * layers * h * h * (1 + s / (6 * h) + vocab / (12 * h * layers))


def llama_flops_per_token(m: ModelShape, s: int) -> float:
    return 6 * (m.num_params() - m.vocab_size * m.hidden_size) \
        + 12 * m.num_hidden_layers * m.num_attention_heads * m.head_dim * s


@dataclasses.dataclass
class Run:
    source: str
    what: str                          # the row's name, as the source labels it
    model: ModelShape
    layout: Layout
    batch: Batch
    opts: Options
    tokens_per_gpu: float              # published, or derived from published TFLOP/s (see `derived`)
    memory_gib: float = None           # published peak memory per GPU, where stated
    pipe: Pipeline = None
    cluster: dict = dataclasses.field(default_factory=dict)
    derived: str = ""                  # how tokens_per_gpu came from the published figure
    note: str = ""                     # what the planner does not model about this run
    explain_memory: bool = False       # the row says what its planned memory counts (memory_counted)


def runs():
    """The published rows, as data (the module docstring names the sources)."""
    out = []
    bf16 = Options(dtype="bfloat16")
    sac = dataclasses.replace(bf16, gradient_checkpointing="selective", selective_ac_option="op",
                              sac_every_other_matmul=True)
    compiled = dict(fused_kernels=True)
    for world, table, eager, compile_ in ((8, "Table 1", (5762, 82.4), (6667, 77.0)),
                                          (128, "Table 3", (5605, 67.0), (6514, 62.0))):
        for how, (tps, mem), opts in (("eager", eager, sac), ("torch.compile", compile_,
                                                             dataclasses.replace(sac, **compiled))):
            out.append(Run(TITAN, f"{table}: Llama 3.1 8B, FSDP {world}, local batch 2, {how}, selective AC",
                           LLAMA["8B"], Layout(1, world), Batch(2 * world, 2, 8192), opts, tps, mem,
                           cluster=GRAND_TETON, note=f"{SAC}; {GRAND_TETON_NOTE}; {TITAN_MEMORY}"))
    out.append(Run(ASYNC_TP, "Llama 3 70B, FSDP 32 x TP 8, local batch 16, compile, full AC, bf16 vanilla TP",
                   LLAMA["70B"], Layout(1, 32, 1, 8, True), Batch(512, 1, 8192),
                   dataclasses.replace(bf16, gradient_checkpointing=True, **compiled), 597.3,
                   cluster=GRAND_TETON, note=GRAND_TETON_NOTE))
    out.append(Run(ASYNC_TP, "Llama 3 8B, FSDP 8 x TP 8, local batch 12, compile, per-op SAC, "
                             "bf16 vanilla TP",
                   LLAMA["8B"], Layout(1, 8, 1, 8, True), Batch(96, 1, 8192),
                   dataclasses.replace(sac, **compiled), 4378,
                   cluster=GRAND_TETON, note=f"{SAC}; {GRAND_TETON_NOTE}"))
    megatron = lambda tp: dataclasses.replace(bf16, fused_kernels=True, distributed_optimizer=True,
                                              tp_comm_overlap=tp > 1)
    for size, heads, h, L, tp, pp, gpus, gbs, tflops in (
            ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8), ("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
            ("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1), ("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
            ("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7), ("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
            ("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
            ("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
            ("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9)):
        fpt = megatron_flops_per_token(h, L)
        out.append(Run(MEGATRON, f"GPT {size}, TP {tp} x PP {pp} x DP 48, batch {gbs}", gpt(h, heads, L, tp),
                       Layout(48, 1, 1, tp, tp > 1), Batch(gbs, 1, 4096), megatron(tp), tflops * 1e12 / fpt,
                       pipe=Pipeline(pp, "1f1b") if pp > 1 else None,
                       derived=f"{tflops} TFLOP/s / {fpt / 1e9:.1f} GFLOP per token",
                       note="the README's --overlap-grad-reduce / --overlap-param-gather (the "
                            "distributed optimizer), --tp-comm-overlap and Megatron's default Transformer "
                            "Engine kernels: planned with distributed_optimizer, tp_comm_overlap and "
                            "fused_kernels; AC, micro-batch and schedule not stated (none, 1 and 1F1B "
                            "assumed); the GELU MLP as a SwiGLU of the same parameters; without AC the "
                            "314B and 462B stages need more than the 80 GB they ran on, so those runs "
                            "recomputed something the README does not say"))
    m405 = LLAMA["405B"]
    for gpus, cp, seq, tflops in ((8192, 1, 8192, 430), (16384, 1, 8192, 400), (16384, 16, 131072, 380)):
        dp = gpus // (8 * cp * 16)
        fpt = llama_flops_per_token(m405, seq)
        out.append(Run(LLAMA3, f"Llama 3 405B, TP 8 x CP {cp} x PP 16 x DP {dp}, seq {seq}, 16M tokens",
                       m405, Layout(1, dp, cp, 8, True), Batch(2 ** 24 // seq, 1, seq),
                       dataclasses.replace(bf16, reshard_after_forward=False, gather_once_per_step=True,
                                           cp_all_gather_kv=cp > 1),
                       tflops * 1e12 / fpt,
                       pipe=Pipeline(16, "interleaved_1f1b", 2),
                       derived=f"{tflops} TFLOP/s / {fpt / 1e12:.2f} TFLOP per token",
                       note="FSDP without resharding after the forward, so each layer gathered once per "
                            "step (gather_once_per_step)" + ("; CP by all-gathered K/V, exposed "
                                                             "(cp_all_gather_kv)" if cp > 1 else "")
                            + "; no AC (the paper trains 8K sequences without it; at 131K each rank holds "
                            "8K tokens too); virtual stages not stated (2 assumed)", explain_memory=True))
    return out


PICOTRON = "https://github.com/huggingface/picotron/blob/59714b1/README.md"
NOT_COMPARABLE = [(PICOTRON, "LLaMA-2-7B on 64 H100s, 38 % MFU",
                   "the README states no layout, batch, sequence or checkpointing"),
                  (PICOTRON, "SmolLM-1.7B on 8 H100s, nearly 50 % MFU",
                   "the README states no layout, batch, sequence or checkpointing")]


def predict(run: Run) -> dict:
    cluster = dataclasses.replace(Cluster(), **run.cluster)
    if run.pipe is None:
        return plan(run.model, run.layout, run.batch, run.opts, cluster)
    return plan_pipeline(run.model, run.layout, run.pipe, run.batch, run.opts, cluster)


def memory_counted(run: Run, p: dict) -> str:
    """What a row's planned memory is made of, from the plan itself: the worst stage's activations in
    flight, a decoder layer's share by part (activation_bytes.py's count of minipar's eager code), and
    the s x s attention scores that count leaves out (SDPA's flash kernel keeps none)."""
    m, act = p["memory"], pa.activations(run.model, run.layout, run.batch, run.opts)
    kept = m["activations"]["as_configured"]
    stage = p["stages"][p["worst_stage"]]
    layers = sum(len(c) for c in stage["layers"])
    parts = {k: v / GiB for k, v in act["per_layer_parts"].items()}
    lay, b = run.layout, run.batch.micro(run.layout)
    scores = b * run.model.num_attention_heads // lay.tp * run.batch.sequence_len // lay.cp \
        * run.batch.sequence_len * DTYPE_BYTES[run.opts.dtype] / GiB
    kv = ("q, the K/V heads, the output and its copy (CP)" if lay.cp > 1 else
          "q, k and v repeated to the query heads, the output")
    return (f"memory counts minipar's eager activations, the run's is not published (it had 80 GB): stage "
            f"{stage['rank']} keeps {kept / GiB:.0f} GiB in flight at its peak ({m['peak_phase']}), "
            f"{kept / m['activations']['per_micro']:.1f} micro-batches of its {layers} layers at "
            f"{act['per_layer'] / GiB:.2f} GiB a layer: the two RMSNorms {parts['norms']:.2f} (mostly the "
            f"all-gathered input of the column-parallel matmuls, which minipar's SP keeps whole; each also "
            f"an fp32 copy of its input and its normalised x), SwiGLU {parts['mlp']:.2f} (gate, silu(gate), "
            f"up, their product), attention {parts['attention']:.2f} ({kv}, the fp32 log-sum-exp: flash "
            f"SDPA keeps no s x s scores, which would be {scores:.1f} GiB a layer more); the rest, "
            f"{(m['total'] - kept) / GiB:.0f} GiB, is the "
            f"state, the stage's gathered layers and no_sync's fp32 accumulators. Megatron-LM-style SP "
            f"keeps the sharded input and all-gathers it again in backward (Korthikanti et al. 2022) and "
            f"fused norm and SwiGLU kernels keep less; the planner does not model that, nor the paper's "
            f"pipeline memory changes")


def row(run: Run) -> tuple:
    p = predict(run)
    tps = p["time"]["tokens_per_s"] / p["world"]
    ratio = tps / run.tokens_per_gpu
    mem = p["memory"]["total"] / GiB
    mem_cell = f"{mem:.1f} / {run.memory_gib} ({mem / run.memory_gib:.2f}x)" if run.memory_gib else \
        f"{mem:.1f} / not published"
    ok = abs(ratio - 1) <= TOKENS_WITHIN and \
        (not run.memory_gib or abs(mem / run.memory_gib - 1) <= MEMORY_WITHIN)
    return ok, (f"| {run.what} | {p['world']} | {tps:,.0f} / {run.tokens_per_gpu:,.0f} ({ratio:.2f}x) | "
                f"{mem_cell} | {100 * p['time']['mfu_full_attention']:.1f} % | {'yes' if ok else 'no'} | "
                f"{run.source}{'; ' + run.derived if run.derived else ''} | {run.note}"
                f"{'; ' + memory_counted(run, p) if run.explain_memory else ''} |")


def compile_saving(rows) -> list:
    """torchtitan's eager and torch.compile rows of one table: the step each spends, planned and
    published, so that the fused-kernel model's saving is read beside the published one."""
    out = []
    for eager in (r for r in rows if r.what.endswith("eager, selective AC")):
        comp = next(r for r in rows if r.what == eager.what.replace("eager", "torch.compile"))
        tokens = eager.batch.global_batch_size * eager.batch.sequence_len / eager.layout.world
        plan_s = [predict(r)["time"]["step_s"] for r in (eager, comp)]
        pub_s = [tokens / r.tokens_per_gpu for r in (eager, comp)]
        out.append(f"{eager.what.split(',')[0]} ({eager.layout.world} GPUs), eager -> torch.compile, "
                   f"seconds a step: planned {plan_s[0]:.2f} -> {plan_s[1]:.2f} "
                   f"(saves {plan_s[0] - plan_s[1]:.2f}), "
                   f"published {pub_s[0]:.2f} -> {pub_s[1]:.2f} (saves {pub_s[0] - pub_s[1]:.2f}).")
    return out


def main(out: str = OUT):
    c = Cluster()
    lines = ["# The planner beside published runs", "",
             "Generated by `python benchmarks/plan_vs_published.py` (the planner's default constants: "
             f"{c.peak_tflops:.0f} TFLOP/s, GEMMs at {c.efficiency}, attention at {c.attention_efficiency}, "
             f"HBM {c.hbm_gbps:.0f} GB/s, NVLink {c.intra_gbps:.0f} GB/s, "
             f"IB {c.inter_gbps:.0f} GB/s per GPU, "
             f"latency {c.intra_latency_us}/{c.inter_latency_us} us per hop; torchtitan's 96 GB HBM2e "
             f"500 W H100s with 2,400 GB/s and {GRAND_TETON['peak_tflops']:.0f} TFLOP/s, the midpoint of "
             "the range its source gives). How each run executes its step is the row's own (last column: "
             "the Options flags set from what the source states). Each cell is predicted / published; "
             "a row passes within "
             f"{100 * TOKENS_WITHIN:.0f} % on tokens/s per GPU and {100 * MEMORY_WITHIN:.0f} % on memory. "
             "MFU counts attention whole (torchtitan's and Megatron-LM's convention).", "",
             "| run | GPUs | tokens/s per GPU | memory GiB per GPU | planner MFU | within | source | "
             "how it is planned; what is not modelled |", "|---|---|---|---|---|---|---|---|"]
    passed = 0
    rows = runs()
    for run in rows:
        ok, text = row(run)
        passed += ok
        lines.append(text)
    for source, what, why in NOT_COMPARABLE:
        lines.append(f"| {what} | | cannot be compared | | | n/a | {source} | {why} |")
    lines += ["", f"{passed} of {len(rows)} comparable rows within the bounds.", ""] + compile_saving(rows)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
