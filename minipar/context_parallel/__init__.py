"""Context parallelism: the sequence split over cp ranks, attention as ring attention, Ulysses or both.

    ring_attention.py   the ring schedule, the forward merge and hand-written backward; the block
                        kernel is handed in
    block_kernel.py     that kernel, the caller's choice (BlockKernel): plain, or cut by packed
                        documents (host boundaries, or device ids that travel with K/V)
    ulysses.py          DeepSpeed-Ulysses: all-to-alls from the sequence split to a head split and
                        back (sequence_to_heads, heads_to_sequence), attention of the whole
                        sequence per head; USP: Ulysses inside groups of u ranks, the ring across
                        (ulysses_attention, check_ulysses: the head counts that split)
    layouts.py          zigzag or contiguous: the sequence split the data, RoPE and the ring share
                        (zigzag_shard, zigzag_unshard, zigzag_positions)
    documents.py        packed documents as boundaries on the host: each block classified once per
                        micro-batch (empty, plain, cut into per-document segments) (Documents)
    document_attention.py  a block by its class: skipped, whole, one dense call per document, or
                        one varlen flash call on CUDA (block_forward, block_backward)
    kernel_choice.py    which kernel runs and why (choose_kernel, attention_backend), which failures
                        may fall back, the once-per-run report (AttentionLog)
    block_attention.py  the reference math of one query block against one key/value block: out,
                        log-sum-exp, and the six-step flash-attention backward (the unit of work
                        the ring repeats), with causal and document masks
    fused_attention.py  a dense block on torch's fused kernels (their aten schemas checked before
                        use) or the reference math
    window_attention.py a sliding window (or soft-capped logits) across cp ranks: K/V all-gathered,
                        one mask of the true positions (window_attention; Mistral's, Phi-3's,
                        Qwen2's, Gemma's windows; Gemma 2's capped layers)
    masked_attention.py attention under one dense boolean mask: SDPA, or explicit scores when the
                        logits are soft-capped (masked_attention; Gemma 2)

    from minipar.context_parallel import BlockKernel, ring_attention, ulysses_attention, zigzag_shard
    out = ring_attention(q, k, v, pgm.cp, BlockKernel(impl="auto", documents=docs), layout="zigzag")
"""
from .block_kernel import BlockKernel
from .documents import Documents
from .kernel_choice import AttentionLog, KernelChoice, choose_kernel
from .layouts import sequence_positions, shard_sequence, zigzag_positions, zigzag_shard, zigzag_unshard
from .ring_attention import RingKnobs, ring_attention, ring_schedule, schedule_score_elements
from .ulysses import check_ulysses, heads_to_sequence, ring_order, sequence_to_heads, ulysses_attention

__all__ = ["BlockKernel", "Documents", "AttentionLog", "KernelChoice", "choose_kernel",
           "RingKnobs", "ring_attention", "ring_schedule", "schedule_score_elements", "sequence_positions",
           "shard_sequence", "zigzag_positions",
           "zigzag_shard", "zigzag_unshard",
           "ulysses_attention", "check_ulysses", "sequence_to_heads", "heads_to_sequence", "ring_order"]
