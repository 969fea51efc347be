"""Chat templates by name, as Axolotl's `chat_template:` key chooses them, so that a file saying
`chat_template: chatml` renders its rows as Axolotl renders them, whatever template (if any) the
tokenizer ships:

    chat_template: tokenizer_default             the tokenizer's own template (Axolotl's default)
    chat_template: tokenizer_default_fallback_X  the tokenizer's own, else template X
    chat_template: jinja                         chat_template_jinja: a Jinja string, or a file of one
    chat_template: chatml | llama3 | ...         one of TEMPLATES (their Jinja: chat_template_table.py)

The named template becomes the tokenizer's (tokenizer.chat_template), so the exported tokenizer
carries it and generation renders prompts as training did; a `datasets` entry may name its own
(chat_template / chat_template_jinja on the entry), used for that entry's rows only.

Each name renders what Axolotl's template of that name renders (proven on stored renderings,
tests/test_chat_templates.py); one message at a time (bos/eos are the tokenizer's own texts):

    chatml        <|im_start|>{role}\\n{content}<|im_end|>\\n
    qwen_25       chatml; Qwen2.5's default system turn when there is none; tool turns as a user
                  turn of <tool_response> blocks
    qwen3, qwen3_5  chatml, no default system turn; the last assistant turn opens with an empty
                  <think> block (or the reasoning its content holds); tool turns as qwen_25
    llama3        bos once, <|start_header_id|>{role}<|end_header_id|>\\n\\n{content, trimmed}<|eot_id|>
                  (Llama 3.0's; 3.1+'s own adds a dated system header: tokenizer_default)
    llama4        bos, <|header_start|>{role}<|header_end|>\\n\\n{content}<|eot|> (system trimmed)
    mistral_v1    bos, " [INST] {user} [/INST]", " {assistant}" eos; a system turn joins the first
                  user turn ("{system}\\n\\n{user}")
    mistral_v2v3  bos, "[INST] {user}[/INST]", " {assistant, trimmed}" eos (v0.2 / v0.3)
    mistral_v3_tekken  bos, "[INST]{user}[/INST]", "{assistant}" eos (Mistral-Nemo)
    mistral_v7_tekken  bos, [SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT] (Mistral Small 3's default,
                  dated today, when there is none), "[INST]{user}[/INST]", "{assistant}" eos
    gemma         bos, <start_of_turn>{user|model}\\n{content, trimmed}<end_of_turn>\\n
    gemma3, gemma3n  gemma, a system turn joining the first user turn ("{system}\\n\\n{user}")
    phi_3         bos, <|system|>\\n{s}<|end|>\\n, <|user|>\\n{u}<|end|>\\n<|assistant|>\\n, {a}<|end|>\\n
    phi_35        <|{role}|>\\n{content}<|end|>\\n, an empty system turn skipped; no eos
    phi_4         <|im_start|>{role}<|im_sep|>{content}<|im_end|>, Phi-4-reasoning's system text by default
    cohere, aya   bos, <|START_OF_TURN_TOKEN|><|{SYSTEM|USER|CHATBOT}_TOKEN|>{content, stripped}
                  <|END_OF_TURN_TOKEN|>
    deepseek_v2   bos, {system}\\n\\n, <｜User｜>{user}, <｜Assistant｜>{assistant} eos
    deepseek_v3   bos, the system turns joined, <｜User｜>{user}, <｜Assistant｜>{assistant} eos (a
                  think block dropped), tool outputs in one <｜tool▁outputs▁begin｜> block
    exaone        [|system|][|endofturn|]\\n when there is no system turn, [|{role}|]{content}, then
                  \\n after a user turn, [|endofturn|]\\n after others
    exaone4       [|{role}|]\\n{content}[|endofturn|]\\n, an assistant turn after an empty <think> block
    falcon_h1     bos, chatml
    nemotron_h    chatml; an optional first system turn, then user and assistant turns only
    metharme      bos, <|system|>{system, or the RP default}, <|user|>{u, stripped},
                  <|model|>{a, stripped}, eos after the last turn
    alpaca        bos, system text, "### Instruction:\\n{user}", "### Response:\\n{assistant}" eos,
                  turns joined by a blank line (Axolotl's own; no model family ships it)

Where Axolotl's template (so minipar's) differs from the family's own tokenizer template, the
family's is chat_template: tokenizer_default: phi_3 is Phi-3-mini's first template (bos, the
assistant header written after each user turn, no eos); Phi-3.5's own adds eos after the last turn,
Axolotl's phi_35 does not; phi_4 is Phi-4-reasoning's (its long system text when a row has none),
not microsoft/phi-4's; deepseek_v2 is DeepSeek-V2.5's markup, not DeepSeek-V2-Chat's "User:".

Deliberate differences from Axolotl: mistral_v2v3 and mistral_v3_tekken refuse a system turn. Their
template writes it inside the LAST user turn only, and only when that turn ends the conversation
(a row ending with an assistant turn loses it silently), so an earlier turn changes as turns are
added and a row cannot be masked turn by turn (chat_format.py renders one more message at a time);
drop_system_message: true gives Axolotl's rendering of such a row. gemma's refusal of a system turn
names the fix where Axolotl says "System role not supported". Rows a template renders but cannot be
masked turn by turn are refused by chat_format.py, naming the row: a template that drops a role's
turns (phi_3, phi_35, phi_4, metharme: tool turns), a tool content that exaone4 and llama4 write
JSON-quoted (when it holds quotes), a later system turn deepseek_v3 moves to the start, a think
block in an earlier qwen3 assistant turn (dropped once a later user turn comes).

Not offered (NOT_OFFERED, each refused with why and the alternative): Axolotl's vision templates
(llama3_2_vision, llava, qwen2_vl, pixtral), gemma4 / gemma4_unified, command_a (and its _rag and
_tool_use forms) and jamba, whose templates render tool, document or media sections a row here
cannot hold. Pure Python.
"""
from __future__ import annotations

import os
from typing import List, Optional

from minipar.trainer.data.chat_template_table import TEMPLATES

DEFAULT, JINJA, FALLBACK = "tokenizer_default", "jinja", "tokenizer_default_fallback_"
_INSTEAD = ("use chat_template: tokenizer_default (the model's own template, from its tokenizer_config.json) "
            "or chat_template: jinja with chat_template_jinja (a Jinja string or file)")
_VISION = "a vision-language template (image parts in the turns); minipar trains text decoders"
NOT_OFFERED = {     # Axolotl's names not written here: why
    "llama3_2_vision": _VISION, "llava": _VISION, "qwen2_vl": _VISION, "pixtral": _VISION,
    "gemma4": "Gemma 4's template (thinking channels, tool and media parts) is not written here",
    "gemma4_unified": "Gemma 4's template (thinking channels, tool and media parts) is not written here",
    "command_a": "Command A's template (a preamble with tool and document sections) is not written here",
    "command_a_rag": "Command A's RAG template (document sections) is not written here",
    "command_a_tool_use": "Command A's tool-use template (tool sections) is not written here",
    "jamba": "Jamba's template (documents, tool definitions, output modes) is not written here",
}


def choices() -> List[str]:
    return [DEFAULT, f"{FALLBACK}<name>", JINJA, *TEMPLATES]


def choice_problem(choice: Optional[str], jinja: Optional[str],
                   where: str = "chat_template") -> Optional[str]:
    """What is wrong with a chat_template / chat_template_jinja pair (None: nothing), before any file
    or tokenizer is read: an unknown name, jinja without its template, a template without jinja."""
    if choice is None:
        return None if jinja is None else (f"{where}_jinja is set but {where} is not: add {where}: jinja")
    if not isinstance(choice, str):
        return f"{where} must be a template name, got {choice!r}"
    name = choice[len(FALLBACK):] if choice.startswith(FALLBACK) else choice
    if choice == JINJA:
        if not jinja or not isinstance(jinja, str):
            return f"{where}: jinja needs {where}_jinja (a Jinja template, or the path of a file holding one)"
    elif jinja is not None:
        return f"{where}_jinja is set but {where} is {choice!r}: set {where}: jinja, or remove {where}_jinja"
    elif name in NOT_OFFERED:      # a fallback to one is refused only if needed (resolve)
        return None if choice != name else _not_offered(name, where)
    elif name != DEFAULT and name not in TEMPLATES:
        return (f"{where}: {choice} is not available here; the templates known by name: "
                f"{', '.join(TEMPLATES)}; or tokenizer_default (the tokenizer's own), "
                f"tokenizer_default_fallback_<name>, or jinja with {where}_jinja")
    return None


def _not_offered(name: str, where: str = "chat_template") -> str:
    return f"{where}: {name} is not available here: {NOT_OFFERED[name]}; {_INSTEAD}"


def jinja_text(jinja: str) -> str:
    """chat_template_jinja as Axolotl reads it: a file's contents when it names a file, else itself."""
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    return jinja


def resolve(choice: Optional[str], jinja: Optional[str], own: Optional[str], where: str) -> Optional[str]:
    """The template text a choice means for a tokenizer whose own template is `own` (None: it has
    none); None when the choice leaves the tokenizer's own (None or tokenizer_default). A
    tokenizer_default without a template, or a fallback to a template not offered here that the
    tokenizer's lack of one needs, is a ValueError naming `where` and the fix."""
    problem = choice_problem(choice, jinja)
    if problem:
        raise ValueError(f"{where}: {problem}")
    if choice is None:
        return None
    if choice == JINJA:
        return jinja_text(jinja)
    if choice.startswith(FALLBACK):
        name = choice[len(FALLBACK):]
        if not own and name in NOT_OFFERED:
            raise ValueError(f"{where}: the tokenizer has no chat template to use before {choice}'s "
                             f"fallback, and {_not_offered(name)}")
        return own if own else TEMPLATES[name]
    if choice == DEFAULT:
        if not own:
            raise ValueError(f"{where}: chat_template tokenizer_default, but the tokenizer has no chat "
                             f"template; name one (chat_template: chatml, ...: {', '.join(TEMPLATES)}), or "
                             f"tokenizer_default_fallback_chatml")
        return own
    return TEMPLATES[choice]
