"""Chat templates by name, as Axolotl's `chat_template:` key chooses them: Jinja strings written here
from each model family's published turn markup, so a file that says `chat_template: chatml` renders
what a ChatML model was trained on, whatever template (if any) its tokenizer ships.

    chat_template: tokenizer_default             the tokenizer's own template (Axolotl's default)
    chat_template: tokenizer_default_fallback_X  the tokenizer's own, else template X
    chat_template: jinja                         chat_template_jinja: a Jinja string, or a file of one
    chat_template: chatml | llama3 | ...         one of TEMPLATES below

The named template becomes the tokenizer's (tokenizer.chat_template), so the exported tokenizer
carries it and generation renders prompts as training did; a `datasets` entry may name its own
(chat_template / chat_template_jinja on the entry), used for that entry's rows only.

One message at a time, what each template writes (bos/eos are the tokenizer's own texts):

    chatml        <|im_start|>{role}\\n{content}<|im_end|>\\n
    qwen_25       chatml, with Qwen2.5's default system turn when the conversation has none
    llama3        bos once, then <|start_header_id|>{role}<|end_header_id|>\\n\\n{content, trimmed}<|eot_id|>
    mistral_v1    bos, then " [INST] {user} [/INST]" and " {assistant}" eos; a system turn joins the
                  first user turn ("{system}\\n\\n{user}"), as Mistral-7B-Instruct-v0.1's template
    mistral_v2v3  bos, then "[INST] {user}[/INST]" and " {assistant, trimmed}" eos (v0.2 / v0.3)
    mistral_v3_tekken  bos, then "[INST]{user}[/INST]" and "{assistant}" eos (Mistral-Nemo)
    gemma         bos, then <start_of_turn>{user|model}\\n{content, trimmed}<end_of_turn>\\n
    gemma3        gemma, a system turn joining the first user turn ("{system}\\n\\n{user}")
    phi_3         <|{role}|>\\n{content}<|end|>\\n per turn, eos after the last (Phi-3 / 3.5 mini)
    phi_35        the same (Phi-3.5 also skips an empty system turn)
    phi_4         <|im_start|>{role}<|im_sep|>{content}<|im_end|> (microsoft/phi-4)
    alpaca        bos, system text, "### Instruction:\\n{user}", "### Response:\\n{assistant}" eos,
                  turns joined by a blank line (Axolotl's own; no model family ships it)

Mistral v2/v3 and Nemo place a system turn inside the LAST user turn only when it ends the
conversation, so an earlier turn changes as turns are added and a training row cannot be masked
turn by turn (chat_format.py locates turns by rendering one more message at a time): those
templates refuse a system turn, as Axolotl's do; drop it with drop_system_message: true, or use
mistral_v1. Gemma 1/2 have no system turn either. Qwen3's template rewrites earlier assistant
turns (their thinking is dropped once a later user turn comes), so it is not offered by name: a
Qwen3 tokenizer's own template is what chat_template: tokenizer_default uses. Pure Python.
"""
from __future__ import annotations

import os
from typing import List, Optional

DEFAULT, JINJA, FALLBACK = "tokenizer_default", "jinja", "tokenizer_default_fallback_"

_ALTERNATE = ("{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
              "{% endif %}")
_NO_SYSTEM = ("{% if messages and messages[0]['role'] == 'system' %}{{ raise_exception('NAME has no system "
              "turn: drop it (drop_system_message: true) or use a template with one') }}{% endif %}")
_SYSTEM_FIRST = ("{% if messages and messages[0]['role'] == 'system' %}"
                 "{% set system_message = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
                 "{% else %}{% set loop_messages = messages %}{% endif %}")
_QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

_GEN = "{% if add_generation_prompt %}{{ 'TEXT' }}{% endif %}"   # the next assistant header
_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
           "'<|im_end|>\\n' }}{% endfor %}" + _GEN.replace("TEXT", "<|im_start|>assistant\\n"))
_GEMMA_TURN = "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
_PHI3_END = "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"

TEMPLATES = {
    "chatml": _CHATML,
    "qwen_25": ("{% if not messages or messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\\n" + _QWEN_SYSTEM + "<|im_end|>\\n' }}{% endif %}" + _CHATML),
    "llama3": ("{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
               "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
               "message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               + _GEN.replace("TEXT", "<|start_header_id|>assistant<|end_header_id|>\\n\\n")),
    "mistral_v1": (_SYSTEM_FIRST + "{{ bos_token }}{% for message in loop_messages %}" + _ALTERNATE +
                   "{% if message['role'] == 'user' %}{% if loop.first and system_message is defined %}"
                   "{{ ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
                   "{% else %}{{ ' [INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
                   "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"),
    "mistral_v2v3": (_NO_SYSTEM.replace("NAME", "mistral_v2v3") + "{{ bos_token }}"
                     "{% for message in messages %}" + _ALTERNATE +
                     "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + '[/INST]' }}"
                     "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}"),
    "mistral_v3_tekken": (_NO_SYSTEM.replace("NAME", "mistral_v3_tekken") + "{{ bos_token }}"
                          "{% for message in messages %}" + _ALTERNATE +
                          "{% if message['role'] == 'user' %}{{ '[INST]' + message['content'] + '[/INST]' }}"
                          "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"),
    "gemma": (_NO_SYSTEM.replace("NAME", "gemma") + "{{ bos_token }}{% for message in messages %}"
              + _ALTERNATE + _GEMMA_TURN +
              "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
              "{% endfor %}" + _GEN.replace("TEXT", "<start_of_turn>model\\n")),
    "gemma3": (_SYSTEM_FIRST + "{{ bos_token }}{% for message in loop_messages %}" + _ALTERNATE
               + _GEMMA_TURN +
               "{{ '<start_of_turn>' + role + '\\n' }}{% if loop.first and system_message is defined %}"
               "{{ system_message + '\\n\\n' }}{% endif %}"
               "{{ message['content'] | trim + '<end_of_turn>\\n' }}"
               "{% endfor %}" + _GEN.replace("TEXT", "<start_of_turn>model\\n")),
    "phi_3": ("{% for message in messages %}{% if message['role'] in ['system', 'user', 'assistant'] %}"
              "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}"
              "{% endfor %}" + _PHI3_END),
    "phi_35": ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
               "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
               "{% elif message['role'] in ['user', 'assistant'] %}"
               "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}"
               "{% endfor %}" + _PHI3_END),
    "phi_4": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '<|im_sep|>' + "
              "message['content'] + '<|im_end|>' }}{% endfor %}"
              + _GEN.replace("TEXT", "<|im_start|>assistant<|im_sep|>")),
    "alpaca": ("{{ bos_token }}{% for message in messages %}"
               "{% if message['role'] == 'system' and loop.first %}{{ message['content'] }}"
               "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] }}"
               "{% elif message['role'] == 'assistant' %}"
               "{{ '### Response:\\n' + message['content'] + eos_token }}{% endif %}"
               "{% if not loop.last %}{{ '\\n\\n' }}{% endif %}{% endfor %}"
               + _GEN.replace("TEXT", "\\n\\n### Response:\\n")),
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
    elif name != DEFAULT and name not in TEMPLATES:
        return (f"{where}: {choice} is not available here; the templates known by name: "
                f"{', '.join(TEMPLATES)}; or tokenizer_default (the tokenizer's own), "
                f"tokenizer_default_fallback_<name>, or jinja with {where}_jinja")
    return None


def jinja_text(jinja: str) -> str:
    """chat_template_jinja as Axolotl reads it: a file's contents when it names a file, else itself."""
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    return jinja


def resolve(choice: Optional[str], jinja: Optional[str], own: Optional[str], where: str) -> Optional[str]:
    """The template text a choice means for a tokenizer whose own template is `own` (None: it has
    none); None when the choice leaves the tokenizer's own (None or tokenizer_default). A
    tokenizer_default without a template is a ValueError naming `where` and the fix."""
    problem = choice_problem(choice, jinja)
    if problem:
        raise ValueError(f"{where}: {problem}")
    if choice is None:
        return None
    if choice == JINJA:
        return jinja_text(jinja)
    if choice.startswith(FALLBACK):
        return own if own else TEMPLATES[choice[len(FALLBACK):]]
    if choice == DEFAULT:
        if not own:
            raise ValueError(f"{where}: chat_template tokenizer_default, but the tokenizer has no chat "
                             f"template; name one (chat_template: chatml, ...: {', '.join(TEMPLATES)}), or "
                             f"tokenizer_default_fallback_chatml")
        return own
    return TEMPLATES[choice]
