r"""Score a trained model on a local file: `python -m minipar.evaluate`.

    python -m minipar.evaluate out/example/hf --text data/val.txt --seq-len 256
    python -m minipar.evaluate out/finetune/step-100 --choices mc.jsonl
    torchrun --nproc-per-node 4 -m minipar.evaluate out/finetune/step-100 --choices mc.jsonl --tp 2 --pp 2

MODEL: a minipar checkpoint of any layout or a Hugging Face directory (minipar/trainer/load_model.py),
loaded on the layout the flags give (--tp, --cp, --pp, --ep; dp_shard takes the rest of the world).

  --text FILE      perplexity: a .txt file as one document, or a .jsonl with a "text" field per row
  --choices FILE   multiple choice in lm-evaluation-harness's loglikelihood form: a .jsonl of
                   {"context": str, "choices": [str], "gold": int}; prints acc and acc_norm

The scores are minipar/post/scoring.py's (the training forward's summed log-probabilities).
Prints one JSON line (rank 0); --output FILE writes it too, with every example's log-probabilities.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import minipar
from minipar.cli import fail, positive_ints
from minipar.config import ParallelismConfig
from minipar.post.scoring import Scorer, multiple_choice, perplexity
from minipar.trainer.load_model import load_composed


def read_documents(path: str) -> list:
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line)["text"] for line in f if line.strip()]
        return [f.read()]


def read_choices(path: str) -> list:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in ("context", "choices", "gold") if k not in row]
            if missing or not 0 <= int(row.get("gold", -1)) < len(row.get("choices", [])):
                raise ValueError(f"{path}:{n}: a row needs context, choices (a list) and gold (an index into "
                                 f"choices); missing {missing or 'nothing'}, gold {row.get('gold')!r}")
            rows.append(row)
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Perplexity and multiple-choice accuracy of a minipar checkpoint "
                                            "or a Hugging Face directory on a local file.")
    p.add_argument("model")
    p.add_argument("--text", help="perplexity of this .txt (one document) or .jsonl ('text' per row)")
    p.add_argument("--choices", help="multiple choice: .jsonl of {context, choices, gold}")
    p.add_argument("--seq-len", type=int, default=512, help="tokens predicted per perplexity window")
    p.add_argument("--tokenizer", help="a tokenizer directory (default: the one beside the weights)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    for size in ("tp", "cp", "pp", "ep"):
        p.add_argument(f"--{size}", type=int, default=1, help=f"{size}_size")
    p.add_argument("--output", help="write the result (with every example's log-probabilities) here")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        positive_ints(args, {"seq_len": "tokens", "tp": "ranks", "cp": "ranks", "pp": "stages",
                             "ep": "ranks"})
        if not (args.text or args.choices):
            raise ValueError("nothing to score: give --text FILE (perplexity) and/or --choices FILE")
        docs = read_documents(args.text) if args.text else None
        rows = read_choices(args.choices) if args.choices else None
    except (ValueError, OSError, json.JSONDecodeError) as err:
        return fail(err)
    world = int(os.environ.get("WORLD_SIZE", 1))
    pgm = minipar.init(ParallelismConfig(tp_size=args.tp, cp_size=args.cp, pp_size=args.pp,
                                         ep_size=args.ep).resolve(world))
    pm, step, tokenizer = load_composed(args.model, pgm, args.tokenizer, args.dtype)
    scorer, pad = Scorer(pm, step), getattr(tokenizer, "pad_token_id", 0) or 0
    result = dict(model=args.model)
    if docs is not None:
        result.update(perplexity(scorer, [tokenizer.encode(d) for d in docs], args.seq_len, pad))
    if rows is not None:
        mc = multiple_choice(scorer, tokenizer, rows, pad, getattr(tokenizer, "eos_token_id", None))
        logprobs = mc.pop("logprobs")
        result.update(mc)
    if pgm.global_rank == 0:
        print(json.dumps(result))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(dict(result, logprobs=logprobs) if rows is not None else result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
