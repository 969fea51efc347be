"""Generation for a batch of prompts with the KV cache (models/kv_cache.py).

    prompts [[ids], ...]  ->  left-padded (b, s0) + valid (b, s0)       real tokens end together
    prefill   cached_forward(all s0 positions)  -> logits of the last  -> token 1 of every row
    decode    cached_forward(the b new tokens)  -> logits (b, V)       -> token t + 1, once a step
    stop      a row is done at an EOS id or when its text holds a stop string; done rows get the
              pad id (as transformers); the loop ends when every row is done or at max_new_tokens

Left padding makes every row's last prompt token sit at the same column, so one decode step
serves the whole batch; position ids count each row's real tokens (0 at its first), and the cache
hides the padding from attention, so a padded row generates what it would alone.

Layouts: every rank whose model holds every layer (pp 1) runs the same loop on the same prompts.
tp splits the weights and the cache by heads, and gathers the logits over tp. ZeRO-3 (dp_shard_cp,
HSDP) gathers each unit for its part of every step (models/kv_cache.py): the whole model's bytes a
step, as a training forward. A cp rank is a replica here: a step's attention never crosses ranks.
ep: every ep rank routes the same tokens (each sends its own copy to the experts' owners): the
all-to-all runs as in training, and nothing is split that must then be joined; a few prompts cost
ep times the experts' work, which at eval's sizes is nothing. Sequence parallelism cannot split one
token a row: the loop runs inside tpl.sequence_parallel_off, the layers' plain-TP path. pp is
refused (check_layout): a pipeline would leave all but one stage idle at every step.

The ranks must agree: each collective (ZeRO-3's gathers, the all-to-all, tp's) needs every rank to
run the same number of steps, so the same tokens and the same stops. They compute the same logits
(the same weights, gathered or whole, on the same tokens) and so pick the same tokens; as no kernel
is promised to be bitwise deterministic, the choice is also made one: each step's tokens (b ids)
are broadcast from rank 0 over the world, so the stops (EOS, stop strings, every row done) agree
by construction.

use_cache=False recomputes the whole sequence every step (the same code, a fresh cache each step):
the baseline benchmarks/bench_generate.py measures the cache against.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from minipar import comm
from minipar import tensor_parallel as tpl
from models.kv_cache import KVCache, cached_forward

from .sampling import Sampling, next_tokens


@dataclass(frozen=True)
class Generation:
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    eos_token_ids: Sequence[int] = ()
    pad_token_id: int = 0
    stop_strings: Sequence[str] = ()
    use_cache: bool = True


@dataclass
class Generated:
    tokens: List[List[int]]                      # the new tokens of each row (EOS kept, pads dropped)
    texts: Optional[List[str]] = None            # decoded and cut at a stop string, when decode given
    logits: List[torch.Tensor] = field(default_factory=list)    # (b, V) per step, when record_logits


def check_layout(pgm, what: str = "generation") -> None:
    """Refuse, on every rank before any collective, the layouts generation does not run on (pp)."""
    if pgm.pp.size > 1:
        raise ValueError(f"{what} needs ranks that hold every layer, got pp_size {pgm.pp.size}: through a "
                         f"pipeline each step's one token would leave all but one stage idle. Generate on "
                         f"pp_size 1 (any tp, dp_shard, cp, ep), e.g. python -m minipar.generate CKPT --tp 2 "
                         f"on a saved checkpoint (any layout's loads there)")


def left_pad(prompts: List[List[int]], pad_id: int, device=None):
    """(ids (b, s0), valid (b, s0) bool): each prompt right-aligned, padding on the left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token (got an empty prompt)")
    s0 = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), s0), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), s0, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, s0 - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[i, s0 - len(p):] = True
    return ids.to(device), valid.to(device)


def _positions(valid):
    """Each real token's index among its row's real tokens (padding: 0)."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def generate(model, prompts: List[List[int]], g: Generation = Generation(),
             decode: Optional[Callable[[List[int]], str]] = None,
             stream: Optional[Callable[[str], None]] = None, record_logits: bool = False) -> Generated:
    """New tokens for each prompt (lists of token ids). model: a LlamaForCausalLM on any layout with
    pp 1 (every rank calls this with the same prompts: the module docstring). decode: ids -> text,
    needed for stop strings, texts and streaming; stream(piece): called with each new piece of text
    (one prompt)."""
    check_layout(model.pgm)
    g.sampling.check()
    if g.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {g.max_new_tokens}")
    if (g.stop_strings or stream) and decode is None:
        raise ValueError("stop strings and streaming need a tokenizer (decode) to read the text")
    if stream is not None and len(prompts) != 1:
        raise ValueError(f"streaming prints one prompt's text, got {len(prompts)} prompts")
    was_training = model.training
    model.eval()
    device = model.lm_head.weight.device
    ids, valid = left_pad(prompts, g.pad_token_id, device)
    b, s0 = ids.shape
    gen = torch.Generator(device=device).manual_seed(g.sampling.seed) if g.sampling.do_sample else None
    cache = KVCache(model, b, s0 + g.max_new_tokens) if g.use_cache else None
    with tpl.sequence_parallel_off(model):        # one token a row: no sequence to split
        out, logs = _loop(model, g, ids, valid, cache, gen, decode, stream, record_logits)
    model.train(was_training)
    texts = [_cut(decode(o), g.stop_strings) for o in out] if decode is not None else None
    return Generated(out, texts, logs)


def _loop(model, g, ids, valid, cache, gen, decode, stream, record_logits):
    """The steps: prefill, then one token a row a step, to every row done or max_new_tokens."""
    device, (b, _) = ids.device, ids.shape
    eos = torch.tensor(list(g.eos_token_ids), dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    out: List[List[int]] = [[] for _ in range(b)]
    logs, shown = [], ""
    step_ids, step_valid = ids, valid
    for _ in range(g.max_new_tokens):
        if g.use_cache:
            positions = _positions(valid)[:, -step_ids.shape[1]:]
            logits = cached_forward(model, step_ids, positions, step_valid, cache)
        else:                                           # the whole sequence again, a fresh cache
            fresh = KVCache(model, b, ids.shape[1])
            logits = cached_forward(model, ids, _positions(valid), valid, fresh)
        logits = logits[:, -1].float()
        if record_logits:
            logs.append(logits.clone())
        tok = comm.broadcast(next_tokens(logits, g.sampling, gen), model.pgm.world)   # one choice
        tok = torch.where(done, torch.full_like(tok, g.pad_token_id), tok)
        for i, t in enumerate(tok.tolist()):            # one host read a step: the loop must know
            if not done[i]:
                out[i].append(t)
        done = done | (torch.isin(tok, eos) if eos.numel() else torch.zeros_like(done))
        if g.stop_strings:
            texts = [decode(o) for o in out]
            done = done | torch.tensor([any(s in t for s in g.stop_strings) for t in texts], device=device)
        if stream is not None:
            text = decode(out[0])
            stream(text[len(shown):]) if text.startswith(shown) else stream(text)
            shown = text
        step_ids, step_valid = tok[:, None], torch.ones(b, 1, dtype=torch.bool, device=device)
        ids, valid = torch.cat([ids, step_ids], 1), torch.cat([valid, step_valid], 1)
        if bool(done.all()):
            break
    return out, logs


def _cut(text: str, stops: Sequence[str]) -> str:
    """The text up to (not including) its first stop string."""
    ends = [text.index(s) for s in stops if s in text]
    return text[:min(ends)] if ends else text
