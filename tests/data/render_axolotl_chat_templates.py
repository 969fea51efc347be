"""Write tests/data/chat_template_renderings.json: what Axolotl's shipped chat templates render for
hand-written conversations, the reference tests/test_chat_templates.py holds minipar's named
templates (minipar/trainer/data/chat_template_table.py) to.

Axolotl's templates are the files axolotl/utils/chat_templates/templates/<name>.jinja of its
repository (src/ in front); `chat_template: <name>` in an Axolotl file means that file. Each is
rendered here as transformers renders a tokenizer's template (its render_jinja_template: a sandboxed
Jinja environment with trim_blocks and lstrip_blocks, raise_exception, strftime_now, tojson), with
the family's bos / eos texts (TOKENS) and add_generation_prompt false and true, on CONVERSATIONS:
single and multi-turn, with and without a system turn, ending with a user turn (a prompt), contents
with leading / trailing spaces and newlines, an empty system turn, a late system turn, think blocks,
tool turns. A template that refuses a conversation (raise_exception) is recorded with its message.
Today's date (mistral_v7_tekken's default system text) is written as <TODAY>.

    python tests/data/render_axolotl_chat_templates.py GIT_DIR [COMMIT] \\
        > tests/data/chat_template_renderings.json

GIT_DIR is a clone (or bare mirror) of github.com/axolotl-ai-cloud/axolotl; COMMIT defaults to HEAD.
Needs transformers (no model, no torch op).
"""
from __future__ import annotations

import datetime
import json
import subprocess
import sys

TEMPLATES_DIR = "src/axolotl/utils/chat_templates/templates/"
TODAY = "<TODAY>"
# each family's bos / eos texts as its tokenizer has them (None: the tokenizer has none)
TOKENS = {
    "alpaca": ("<s>", "</s>"), "chatml": ("<s>", "<|im_end|>"),
    "qwen_25": (None, "<|im_end|>"), "qwen3": (None, "<|im_end|>"), "qwen3_5": (None, "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"), "llama4": ("<|begin_of_text|>", "<|eot|>"),
    "mistral_v1": ("<s>", "</s>"), "mistral_v2v3": ("<s>", "</s>"), "mistral_v3_tekken": ("<s>", "</s>"),
    "mistral_v7_tekken": ("<s>", "</s>"),
    "gemma": ("<bos>", "<eos>"), "gemma3": ("<bos>", "<eos>"), "gemma3n": ("<bos>", "<eos>"),
    "phi_3": ("<s>", "<|endoftext|>"), "phi_35": ("<s>", "<|endoftext|>"),
    "phi_4": ("<|endoftext|>", "<|im_end|>"),
    "cohere": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"), "aya": ("<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
    "deepseek_v2": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek_v3": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "exaone": ("[BOS]", "[|endofturn|]"), "exaone4": ("[BOS]", "[|endofturn|]"),
    "falcon_h1": ("<|begin_of_text|>", "<|im_end|>"), "nemotron_h": ("<s>", "<|im_end|>"),
    "metharme": ("<s>", "</s>"),
}
_S, _U1, _A1 = ("system", "You are terse."), ("user", "Who art thou?"), ("assistant", "A king.")
_U2, _A2 = ("user", "Of what?"), ("assistant", "Of Denmark.")
_SPACES = [("user", " Where is\nthe ghost? \n"), ("assistant", "\n  On the ramparts.  \n"),
           ("user", "\tAnd then?"), ("assistant", "It speaks. ")]
_THINK = ("assistant", "<think>\nI ponder.\n</think>\n\nA king.")
_TOOL = ("tool", '{"weather": "cold"}')
CONVERSATIONS = {name: [dict(role=r, content=c) for r, c in turns] for name, turns in {
    "single": [_U1, _A1], "single_system": [_S, _U1, _A1], "multi": [_U1, _A1, _U2, _A2],
    "multi_system": [_S, _U1, _A1, _U2, _A2], "prompt": [_U1], "prompt_system": [_S, _U1],
    "prompt_multi": [_U1, _A1, _U2], "spaces": _SPACES,
    "spaces_system": [("system", "  Speak plainly.\n")] + _SPACES, "empty_system": [("system", ""), _U1, _A1],
    "system_late": [_U1, _A1, ("system", "Now be kind."), _U2, _A2],
    "think": [_U1, _THINK], "think_multi": [_U1, _THINK, _U2, _A2],
    "tool": [_U1, ("assistant", "Let me look."), _TOOL, _A2],
    "tools2": [_U1, ("assistant", "Looking."), _TOOL, ("tool", "rain"), _A2],
}.items()}
PROMPT_CASES = ("single", "prompt", "prompt_system", "prompt_multi")   # also rendered with the prompt


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True,
                          text=True).stdout


def render(template: str, messages: list, generation_prompt: bool, bos, eos) -> dict:
    """{"text": ...} as transformers renders it, or {"error": the template's message}."""
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template
    tokens = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    try:
        (text,), _ = render_jinja_template([messages], chat_template=template,
                                           add_generation_prompt=generation_prompt, **tokens)
    except TemplateError as err:
        return {"error": str(err)}
    return {"text": text.replace(datetime.date.today().strftime("%Y-%m-%d"), TODAY)}


def main(git_dir: str, commit: str = "HEAD") -> dict:
    commit = _git(git_dir, "rev-parse", commit).strip()
    files = sorted(p for p in _git(git_dir, "ls-tree", "--name-only", commit, TEMPLATES_DIR).split()
                   if p.endswith(".jinja"))
    names = [p[len(TEMPLATES_DIR):-len(".jinja")] for p in files]
    cases = []
    for name in sorted(TOKENS):
        template = _git(git_dir, "show", f"{commit}:{TEMPLATES_DIR}{name}.jinja")
        for conv, messages in CONVERSATIONS.items():
            for prompt in (False, True) if conv in PROMPT_CASES else (False,):
                cases.append(dict(template=name, conversation=conv, add_generation_prompt=prompt,
                                  **render(template, messages, prompt, *TOKENS[name])))
    import transformers
    return {"source": f"github.com/axolotl-ai-cloud/axolotl at {commit}, {TEMPLATES_DIR}<name>.jinja, "
                      f"rendered by transformers {transformers.__version__}'s render_jinja_template "
                      f"(tests/data/render_axolotl_chat_templates.py)",
            "axolotl_names": names, "tokens": TOKENS, "today": TODAY, "conversations": CONVERSATIONS,
            "cases": cases}


if __name__ == "__main__":
    json.dump(main(*sys.argv[1:]), sys.stdout, ensure_ascii=False, indent=1)
    sys.stdout.write("\n")
