"""The published bf16 training runs the planner is held against, as data: each with its source, model,
layout, batch, sequence, hardware and what its trainer states about how it runs the step (the Options
flags the time model prices). benchmarks/plan_vs_published.py sets the planner beside them.

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

from minipar.plan.inputs import Batch, Layout, ModelShape, Options  # noqa: E402
from minipar.plan.pipeline_stage import Pipeline  # noqa: E402

# Llama 3.1 shapes: the Llama 3 paper's Table 3 (and configs/models/*.json for 8B and 70B)
LLAMA = {"8B": ModelShape(128256, 4096, 14336, 32, 32, 8, 128),
         "70B": ModelShape(128256, 8192, 28672, 80, 64, 8, 128),
         "405B": ModelShape(128256, 16384, 53248, 126, 128, 8, 128)}
# torchtitan's Grand Teton H100s: 96 GB HBM2e at 2.4 TB/s, 500 W (the benchmark file's "Hardware"); its
# attention is PyTorch's SDPA, whose flash backend (FlashAttention-2) ran it on H100 at both torch commits
# the files name (2024-12-23, 2025-06-14): cuDNN's faster kernel was opt-in until pytorch/pytorch#162073
# (2025-09). FlashAttention-2 reaches 35 % of H100 peak (Shah et al. 2024, FlashAttention-3, arXiv
# 2407.08608, abstract); pytorch/pytorch#142132 measured SDPA at 329 TFLOP/s on an H100 on the
# 2024-12-04 nightly, where cuDNN's kernel did 631.
GRAND_TETON = dict(gpu_memory_bytes=96e9, hbm_gbps=2400.0, peak_tflops=(835 + 989) / 2,
                   attention_efficiency=0.35)
TITAN = "https://github.com/pytorch/torchtitan/blob/b5bcd76/benchmarks/llama3_h100_202412_torchtitan.md"
ASYNC_TP = "https://github.com/pytorch/torchtitan/blob/b5bcd76/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
MEGATRON = "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a6/images/model_table.png (README)"
LLAMA3 = "https://arxiv.org/abs/2407.21783 (The Llama 3 Herd of Models), Table 4"
GRAND_TETON_NOTE = ("500 W H100s (HBM2e), whose peak the source puts between the NVL's 835 and the SXM's "
                    "989 TFLOP/s without knowing it: planned at the midpoint, 912; the power limit's effect "
                    "on sustained GEMM rates is not stated, and not modelled; attention at 0.35 of peak, "
                    "FlashAttention-2's on H100 (arXiv 2407.08608), the kernel PyTorch's SDPA ran then "
                    "(pytorch/pytorch#142132: 329 TFLOP/s)")
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
    unstated: str = ""                 # the Cluster constant the source leaves unknown (implied())


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
                           cluster=GRAND_TETON, note=f"{SAC}; {GRAND_TETON_NOTE}; {TITAN_MEMORY}",
                           unstated="efficiency"))
    out.append(Run(ASYNC_TP, "Llama 3 70B, FSDP 32 x TP 8, local batch 16, compile, full AC, bf16 vanilla TP",
                   LLAMA["70B"], Layout(1, 32, 1, 8, True), Batch(512, 1, 8192),
                   dataclasses.replace(bf16, gradient_checkpointing=True, **compiled), 597.3,
                   cluster=GRAND_TETON, note=GRAND_TETON_NOTE, unstated="efficiency"))
    out.append(Run(ASYNC_TP, "Llama 3 8B, FSDP 8 x TP 8, local batch 12, compile, per-op SAC, "
                             "bf16 vanilla TP",
                   LLAMA["8B"], Layout(1, 8, 1, 8, True), Batch(96, 1, 8192),
                   dataclasses.replace(sac, **compiled), 4378,
                   cluster=GRAND_TETON, note=f"{SAC}; {GRAND_TETON_NOTE}", unstated="efficiency"))
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
                            "8K tokens too); virtual stages not stated (2 assumed); the attention kernel "
                            "not stated (planned at the default)", explain_memory=True,
                       unstated="attention_efficiency"))
    return out


PICOTRON = "https://github.com/huggingface/picotron/blob/59714b1/README.md"
NOT_COMPARABLE = [(PICOTRON, "LLaMA-2-7B on 64 H100s, 38 % MFU",
                   "the README states no layout, batch, sequence or checkpointing"),
                  (PICOTRON, "SmolLM-1.7B on 8 H100s, nearly 50 % MFU",
                   "the README states no layout, batch, sequence or checkpointing")]
