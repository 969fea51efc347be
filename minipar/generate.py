r"""Generate text from a trained model: `python -m minipar.generate`.

    python -m minipar.generate out/example/hf --prompt "Hello" --max-new-tokens 40
    python -m minipar.generate out/finetune/step-100 --chat --prompt "What is 2+2?" --do-sample \
        --temperature 0.7 --top-p 0.9 --seed 1 --stop "</s>"
    torchrun --nproc-per-node 2 -m minipar.generate out/finetune/step-100 --prompts-file prompts.txt
    torchrun --nproc-per-node 4 -m minipar.generate out/moe/step-100 --prompt "Hi" --tp 2 --ep 2

MODEL is a minipar checkpoint of any layout (a step-N directory) or a Hugging Face directory (Llama,
Qwen3, Mixtral, Qwen3-MoE): minipar/trainer/load_model.py. --chat renders each prompt as a user turn
through the tokenizer's chat template (with the generation prompt). One prompt streams its text to
the terminal as it is generated; several (--prompt repeated, or --prompts-file: one per line, or a
.jsonl with a "prompt" field) run as one left-padded batch and print at the end. Under torchrun every
rank is a tp rank by default (the weights and the KV cache split by heads); with --tp N below the
world, dp_shard takes the rest and the model is composed as training composes it
(minipar/trainer/load_model.py's load_composed: ZeRO-3 shards over dp_shard, gathered unit by unit
at each step; --ep N splits an MoE's experts over ep ranks of dp_shard). Every rank generates the
same prompts; rank 0 prints. The loop and the cache: minipar/post/generation.py, models/kv_cache.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import minipar
from minipar.cli import fail, positive_ints, within
from minipar.config import ParallelismConfig
from minipar.post.generation import Generation, generate
from minipar.post.sampling import Sampling
from minipar.trainer.load_model import load_composed, load_model


def read_prompts(path: str) -> list:
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line)["prompt"] for line in f if line.strip()]
        return [line.rstrip("\n") for line in f if line.strip()]


def encode_prompt(tokenizer, text: str, chat: bool) -> list:
    """The prompt's ids: the chat template's user turn plus the assistant's opening, or the text."""
    if not chat:
        ids = tokenizer.encode(text)
        bos = getattr(tokenizer, "bos_token_id", None)
        return ([bos] if bos is not None else []) + ids
    tok = getattr(tokenizer, "tok", None)
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template; this model's has none "
                         "(leave --chat off, or give --tokenizer DIR)")
    return list(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False))


def eos_ids(model, tokenizer) -> list:
    ids = [model.config.eos_token_id, getattr(tokenizer, "eos_token_id", None)]
    flat = [i for x in ids for i in (x if isinstance(x, list) else [x]) if i is not None]
    return sorted(set(flat))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Generate text from a minipar checkpoint or a Hugging Face "
                                            "directory.")
    p.add_argument("model", help="a step-N checkpoint directory or a Hugging Face model directory")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", help="prompts, one per line (or .jsonl with a 'prompt' field)")
    p.add_argument("--chat", action="store_true", help="render each prompt with the chat template")
    p.add_argument("--tokenizer", help="a tokenizer directory (default: the one beside the weights)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--tp", type=int, help="tp_size (default: every rank, 1 with --ep); dp_shard takes the "
                                          "rest, the weights ZeRO-3 sharded over it")
    p.add_argument("--ep", type=int, default=1, help="ep_size: an MoE's experts split over ep ranks of "
                                                     "dp_shard")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        positive_ints(args, {"max_new_tokens": "tokens to generate", "tp": "ranks", "ep": "ranks"})
        within(args, {"temperature": (lambda t: t > 0, "> 0"), "top_p": (lambda p: 0 < p <= 1, "in (0, 1]")})
        prompts = args.prompt + (read_prompts(args.prompts_file) if args.prompts_file else [])
        if not prompts:
            raise ValueError("no prompt: give --prompt TEXT (repeatable) or --prompts-file FILE")
        world = int(os.environ.get("WORLD_SIZE", 1))
        tp = args.tp or (world if args.ep == 1 else 1)
        layout = ParallelismConfig(tp_size=tp, ep_size=args.ep).resolve(world)   # dp_shard: the rest
    except (ValueError, OSError) as err:
        return fail(err)
    pgm = minipar.init(layout)
    try:
        if pgm.dp_shard_cp.size > 1:     # the training composition: ZeRO-3 over dp_shard (and ep)
            parallel, _, tokenizer = load_composed(args.model, pgm, args.tokenizer)   # (no LoRA dir)
            model = parallel.model
        else:
            model, tokenizer = load_model(args.model, pgm, args.tokenizer)
    except ValueError as err:            # the same on every rank: what the files are, the flags
        return fail(err)
    ids = [encode_prompt(tokenizer, p, args.chat) for p in prompts]
    g = Generation(max_new_tokens=args.max_new_tokens, eos_token_ids=eos_ids(model, tokenizer),
                   pad_token_id=getattr(tokenizer, "pad_token_id", 0) or 0, stop_strings=tuple(args.stop),
                   use_cache=not args.no_cache,
                   sampling=Sampling(args.do_sample, args.temperature, args.top_k, args.top_p, args.seed))
    main_rank = pgm.global_rank == 0
    stream = (lambda piece: print(piece, end="", flush=True)) if len(ids) == 1 and main_rank else None
    out = generate(model, ids, g, decode=tokenizer.decode, stream=stream)
    if main_rank:
        if stream is not None:
            print()
        else:
            for prompt, text in zip(prompts, out.texts):
                print(json.dumps({"prompt": prompt, "completion": text}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
