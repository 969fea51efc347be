"""A small, offline fine-tuning example: a BPE tokenizer with a chat template, and chat data.

    python -m minipar.trainer.data.example_data out/example
      out/example/tokenizer/     tokenizer.json + tokenizer_config.json (AutoTokenizer loads it)
      out/example/chat.jsonl     {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
      out/example/completion.jsonl  {"text": "..."}: the same speeches as plain completion rows
      out/example/preference.jsonl  {"messages": [...], "chosen": {...}, "rejected": {...}}: pairs for
                                 rl: dpo (configs/dpo.yaml), Axolotl's chat_template form

Everything comes from the bundled plays (data/shakespeare.txt): the tokenizer is trained on them
with the `tokenizers` package (byte-level BPE, as Llama 3 and GPT-2 use), and each conversation
is a run of consecutive speeches of one scene, the first speaker's lines as the user turn and the
reply as the assistant turn, some with a system prompt naming who answers. The tests build their
fixtures with these functions, and the README's fine-tune quick start runs this module.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
from typing import Dict, List, Optional, Tuple

from minipar.trainer.config.train_config import REPO_ROOT

PLAYS = os.path.join(REPO_ROOT, "data", "shakespeare.txt")
SPECIAL = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
# Jinja, as HF chat templates are: every turn "<|role|>\n" content eos "\n", after one bos.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
                 "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_SPEAKER = re.compile(r"^[A-Z][A-Z' ,.-]+\.$")


def speeches(path: str = PLAYS) -> List[List[Tuple[str, str]]]:
    """The plays as scenes, each a list of (speaker, speech): a speech is a capitalised speaker line
    ("MACBETH.") followed by its lines up to the next blank line; stage directions are dropped."""
    scenes, scene, lines = [], [], open(path, encoding="utf-8").read().split("\n\n")
    for block in lines:
        rows = [r.strip() for r in block.strip().split("\n") if r.strip()]
        if not rows:
            continue
        if rows[0].startswith("SCENE") or rows[0].startswith("ACT "):
            if scene:
                scenes.append(scene)
            scene = []
            continue
        if len(rows) > 1 and _SPEAKER.match(rows[0]):
            text = " ".join(r for r in rows[1:] if not r.startswith("["))
            if text:
                scene.append((rows[0][:-1].title(), text))
    if scene:
        scenes.append(scene)
    return scenes


def conversations(n: int, seed: int = 0, path: str = PLAYS, max_chars: int = 240) -> List[Dict]:
    """n chat rows: 2 or 4 turns of consecutive speeches of at most max_chars characters each (the
    long monologues are left out, so the rows stay short), a third with a system prompt."""
    rng = random.Random(seed)
    scenes = [s for s in speeches(path) if len(s) >= 4]
    rows = []
    while len(rows) < n:
        scene = rng.choice(scenes)
        turns = rng.choice((2, 4))
        start = rng.randrange(0, len(scene) - turns + 1)
        part = scene[start:start + turns]
        if any(len(text) > max_chars for _, text in part):
            continue
        messages = [dict(role="user" if i % 2 == 0 else "assistant", content=text)
                    for i, (_, text) in enumerate(part)]
        if rng.random() < 1 / 3:
            messages.insert(0, dict(role="system", content=f"You are {part[1][0]}. Answer in verse."))
        rows.append(dict(messages=messages))
    return rows


def preference_pairs(n: int, seed: int = 0, path: str = PLAYS) -> List[Dict]:
    """n preference rows in Axolotl's chat_template form: a conversation up to its last user turn,
    the play's own reply as `chosen` and the reply of another scene as `rejected` (a preference a
    small model can learn: the answer that follows the question)."""
    rng = random.Random(seed + 1)
    chats = [c["messages"] for c in conversations(2 * n, seed + 1, path)]
    rows = []
    for k, messages in enumerate(chats[:n]):
        other = chats[n + k][-1]["content"]
        if other == messages[-1]["content"]:
            continue
        rows.append(dict(messages=messages[:-1],
                         chosen=dict(role="assistant", content=messages[-1]["content"]),
                         rejected=dict(role="assistant", content=other)))
    rng.shuffle(rows)
    return rows


def make_tokenizer(directory: str, vocab_size: int = 2048, path: str = PLAYS,
                   max_chars: Optional[int] = None) -> str:
    """Train a byte-level BPE of `vocab_size` tokens (the special tokens included) on the plays (their
    first max_chars characters, if given), set the chat template, and save it as a transformers
    PreTrainedTokenizerFast directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = open(path, encoding="utf-8").read()[:max_chars]
    tok.train_from_iterator(text.split("\n\n"), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIAL[3:])
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(directory, exist_ok=True)
    fast.save_pretrained(directory)
    return directory


def write_jsonl(path: str, rows: List[Dict]) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)
    return path


def make_example(directory: str, num_conversations: int = 2000, vocab_size: int = 2048, seed: int = 0,
                 tokenizer_chars: Optional[int] = None, num_preference: int = 48) -> Dict:
    """Write tokenizer/, chat.jsonl, completion.jsonl and preference.jsonl under `directory`;
    returns their paths.
    tokenizer_chars trains the tokenizer on the first characters of the plays only (faster)."""
    chats = conversations(num_conversations, seed)
    completions = [dict(text="\n".join(m["content"] for m in c["messages"] if m["role"] != "system"))
                   for c in chats]
    return dict(tokenizer=make_tokenizer(os.path.join(directory, "tokenizer"), vocab_size,
                                         max_chars=tokenizer_chars),
                chat=write_jsonl(os.path.join(directory, "chat.jsonl"), chats),
                completion=write_jsonl(os.path.join(directory, "completion.jsonl"), completions),
                preference=write_jsonl(os.path.join(directory, "preference.jsonl"),
                                       preference_pairs(num_preference, seed)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="where to write tokenizer/, chat.jsonl, completion.jsonl, "
                                          "preference.jsonl")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = make_example(args.directory, args.conversations, args.vocab_size, args.seed)
    for what, path in paths.items():
        print(f"{what:>10}: {path}")


if __name__ == "__main__":
    main()
