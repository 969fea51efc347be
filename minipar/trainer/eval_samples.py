"""A few greedy generations at each evaluation (`eval_prompts`), to read beside val_loss and its
perplexity: what the model says, step by step, in metrics.jsonl and TensorBoard (eval/generations).

    eval_prompts: ["Once upon a time", "The capital of France is"]

Each prompt is encoded as the run encodes text (its bos first, when the tokenizer has one) and
continued greedily for EVAL_NEW_TOKENS tokens or to EOS with the KV cache (minipar/post/
generation.py). Every rank generates the same prompts, the same tokens (its logits, the choice
broadcast from rank 0), so the collectives of the layout match step for step: tp's, ZeRO-3's
gathers of each unit over dp_shard (HSDP too), ep's all-to-all; cp ranks run as replicas and
sequence parallelism its plain-TP path for the few steps. Rank 0 logs. Generation leaves training
as it was: no gradient, ZeRO-3's learned prefetch orders untouched, nothing left gathered.
Under pp (a stage holds some of the layers) there are none: the run notes once why, and what to
do instead, and trains on; an evaluation never fails a run.
"""
from __future__ import annotations

from typing import List, Optional

from minipar.post.generation import Generation, check_layout, generate

EVAL_NEW_TOKENS = 32


def why_not(pgm) -> Optional[str]:
    """None when this layout can generate, else the reason (the note the run prints once)."""
    try:
        check_layout(pgm, "eval_prompts")
    except ValueError as err:
        return f"eval_prompts: no generations on this layout, training goes on. {err}"
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
