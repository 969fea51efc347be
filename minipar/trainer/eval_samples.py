"""A few greedy generations at each evaluation (`eval_prompts`), to read beside val_loss and its
perplexity: what the model says, step by step, in metrics.jsonl and TensorBoard (eval/generations).

    eval_prompts: ["Once upon a time", "The capital of France is"]

Each prompt is encoded as the run encodes text (its bos first, when the tokenizer has one) and
continued greedily for EVAL_NEW_TOKENS tokens or to EOS with the KV cache (minipar/post/
generation.py). Generation runs on layouts whose ranks hold a whole model or its tp slices: one
process, tp, dp_replicate (each replica generates the same). Elsewhere (ZeRO-3 shards, cp, pp,
sequence parallelism, ep) the run notes once why there are none and trains on: an evaluation never
fails a run. Every rank calls generate (tp's collectives); rank 0 logs.
"""
from __future__ import annotations

from typing import List, Optional

from minipar.post.generation import Generation, generate

EVAL_NEW_TOKENS = 32


def why_not(pgm) -> Optional[str]:
    """None when this layout can generate, else the reason (the note the run prints once)."""
    c = pgm.config
    dims = dict(dp_shard_cp=pgm.dp_shard_cp.size, pp=pgm.pp.size, cp=pgm.cp.size, ep=pgm.ep.size)
    parts = [f"{name} {size}" for name, size in dims.items() if size > 1]
    if c.sequence_parallel:
        parts.append("sequence_parallel")
    if parts:
        return (f"eval_prompts: no generations on this layout ({', '.join(parts)}); they run on one "
                f"process, tp or dp_replicate; use python -m minipar.generate on a saved checkpoint")
    return None


def eval_generations(model, tokenizer, prompts: List[str]) -> List[dict]:
    """[{prompt, completion}] for each prompt: greedy, EVAL_NEW_TOKENS new tokens at most."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = [([bos] if bos is not None else []) + tokenizer.encode(p) for p in prompts]
    eos = getattr(tokenizer, "eos_token_id", None)
    g = Generation(max_new_tokens=EVAL_NEW_TOKENS, eos_token_ids=[eos] if eos is not None else [],
                   pad_token_id=getattr(tokenizer, "pad_token_id", 0) or 0)
    out = generate(model, ids, g, decode=tokenizer.decode)
    return [dict(prompt=p, completion=t) for p, t in zip(prompts, out.texts)]
