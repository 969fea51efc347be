"""After the fine-tune: generation with the KV cache and scoring, on the trained model. The files in
reading order (the cache itself, the one model-level piece, is models/kv_cache.py):

    sampling.py      the next token from the logits: greedy, temperature, top-k, top-p, a seeded draw
                     (transformers' warpers, in its order)
    generation.py    a batch of prompts, left-padded, through the KV cache: prefill, one token a step,
                     EOS and stop strings, streaming; every layout with pp 1 (tp, SP, ZeRO-3, cp, ep)
    scoring.py       summed log-probabilities through the training composition's forward on any
                     layout: lm-evaluation-harness's loglikelihood (acc, acc_norm), perplexity

The programs around them: `python -m minipar.generate` (minipar/generate.py) and
`python -m minipar.evaluate` (minipar/evaluate.py); docs/post_training.md.
"""
from .generation import Generated, Generation, check_layout, generate, left_pad
from .sampling import Sampling, next_tokens, warp
from .scoring import Scorer, multiple_choice, perplexity, split_request

__all__ = ["Generated", "Generation", "check_layout", "generate", "left_pad", "Sampling", "next_tokens",
           "warp", "Scorer", "multiple_choice", "perplexity", "split_request"]
