"""The Jinja of each chat template minipar offers by name (chat_templates.py chooses among them).

Each is written here, for the conversations a training row holds (string contents; roles system,
user, assistant, tool), to render the same text as the template of the same name that Axolotl ships
(axolotl/utils/chat_templates/templates/<name>.jinja), which is what `chat_template: <name>` means in
an Axolotl file: tests/data/chat_template_renderings.json holds Axolotl's renderings of hand-written
conversations (with and without a system turn, multi-turn, a generation prompt or not, contents with
leading and trailing spaces and newlines, a tool turn) and tests/test_chat_templates.py renders each
here and asserts equality. What Axolotl's templates do beyond that (list contents with images, tool
calls and tool schemas) is not written; a row cannot carry them (chat_format.py).

How the strings are written: transformers renders a template with trim_blocks and lstrip_blocks, a
raise_exception(message) and a strftime_now(format) function, bos_token / eos_token and the other
special tokens' texts as variables, and add_generation_prompt; so a template is one line of tags
with its literal text in string expressions, and no whitespace outside them is ever emitted. The
turn-by-turn masking (chat_format.py) needs a template that only appends as messages are added:
each template here does, given real_last_index (qwen3, below) and the refusals chat_templates.py
lists. Pure Python: strings only.
"""
from __future__ import annotations


def _lit(text: str) -> str:
    """A Jinja string literal of `text` (Jinja reads backslash escapes as Python does)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _gen(text: str) -> str:
    """The generation prompt: the next assistant turn's header, when add_generation_prompt."""
    return "{% if add_generation_prompt %}{{ " + _lit(text) + " }}{% endif %}"


def _alternate(message: str = "Conversation roles must alternate user/assistant/user/assistant/...") -> str:
    return ("{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("
            + _lit(message) + ") }}{% endif %}")


_AFTER_SYSTEM = ("After the optional system message, conversation roles must alternate "
                 "user/assistant/user/assistant/...")
_ONLY_USER_ASSISTANT = ("Only user and assistant roles are supported, with the exception of an initial "
                        "optional system message!")


def _no_system(name: str, why: str) -> str:
    return ("{% if messages and messages[0]['role'] == 'system' %}{{ raise_exception("
            + _lit(f"{name} has no system turn here: {why}") + ") }}{% endif %}")


_FIRST_SYSTEM = ("{% if messages and messages[0]['role'] == 'system' %}"
                 "{% set system_message = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
                 "{% else %}{% set loop_messages = messages %}{% endif %}")
_TURN = "'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'"
_CHATML = "{% for message in messages %}{{ " + _TURN + " }}{% endfor %}" + _gen("<|im_start|>assistant\n")
# Qwen's tool results: a run of tool messages is one user turn of <tool_response> blocks
_QWEN_TOOL = ("{% elif message['role'] == 'tool' %}"
              "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}"
              "{% endif %}{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
              "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}"
              "{% endif %}")
_QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen3: the assistant turn after the last user query that is the conversation's last message
# (real_last_index, passed by chat_format.py as Axolotl passes it, so a prefix renders its turns as the
# whole conversation does) opens with an empty think block, or its own reasoning; a reasoning
# written in the content (<think>...</think>) is split out and shown only after the last query.
_QWEN3 = (
    "{% if messages and messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content']"
    " + '<|im_end|>\\n' }}{% endif %}"
    "{% set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1, "
    "real_last_index=messages|length - 1) %}"
    "{% if real_last_index is defined and real_last_index is not none %}"
    "{% set ns.real_last_index = real_last_index %}{% endif %}"
    "{% for message in messages[::-1] %}{% set index = (messages|length - 1) - loop.index0 %}"
    "{% if ns.multi_step_tool and message['role'] == 'user' and not (message['content'].startswith("
    "'<tool_response>') and message['content'].endswith('</tool_response>')) %}"
    "{% set ns.multi_step_tool = false %}{% set ns.last_query_index = index %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{ " + _TURN + " }}"
    "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% set reasoning = '' %}{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{% if loop.index0 > ns.last_query_index and (loop.index0 == ns.real_last_index or reasoning) %}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}{% else %}{{ '<|im_start|>assistant\\n' + content }}{% endif %}"
    "{{ '<|im_end|>\\n' }}" + _QWEN_TOOL + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n\\n' }}{% endif %}{% endif %}")

_MISTRAL_SYSTEM_MOVES = ("its template writes a system turn inside the LAST user turn only (and drops it "
                         "when an assistant turn ends the conversation), so turns cannot be located one "
                         "at a time; drop it (drop_system_message: true, what Axolotl renders for a row "
                         "that ends with an assistant turn) or use mistral_v1 / mistral_v7_tekken")
_GEMMA_ROLE = "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
_GEMMA3 = (_FIRST_SYSTEM + "{{ bos_token }}{% for message in loop_messages %}" + _alternate() + _GEMMA_ROLE +
           "{{ '<start_of_turn>' + role + '\\n' }}{% if loop.first and system_message is defined %}"
           "{{ system_message + '\\n\\n' }}{% endif %}{{ message['content'] | trim + '<end_of_turn>\\n' }}"
           "{% endfor %}" + _gen("<start_of_turn>model\n"))

_PHI4_REASONING = (
    "You are Phi, a language model trained by Microsoft to help users. Your role as an assistant involves "
    "thoroughly exploring questions through a systematic thinking process before providing the final "
    "precise and accurate solutions. This requires engaging in a comprehensive cycle of analysis, "
    "summarizing, exploration, reassessment, reflection, backtracing, and iteration to develop "
    "well-considered thinking process. Please structure your response into two main sections: Thought and "
    "Solution using the specified format: <think> {Thought section} </think> {Solution section}. In the "
    "Thought section, detail your reasoning process in steps. Each step should include detailed "
    "considerations such as analysing questions, summarizing relevant findings, brainstorming new ideas, "
    "verifying the accuracy of the current steps, refining any errors, and revisiting previous steps. In "
    "the Solution section, based on various attempts, explorations, and reflections from the Thought "
    "section, systematically present the final solution that you deem correct. The Solution section should "
    "be logical, accurate, and concise and detail necessary steps needed to reach the conclusion. Now, try "
    "to solve the following question through the above guidelines:")
_SMALL3_HEAD = ("You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a French "
                "startup headquartered in Paris.\nYour knowledge base was last updated on 2023-10-01. "
                "The current date is ")
_SMALL3_TAIL = (".\n\nWhen you're not sure about some information, you say that you don't have the "
                "information and don't make up anything.\nIf the user's question is not clear, ambiguous, or "
                "does not provide enough context for you to accurately answer the question, you do not try "
                "to answer it right away and you rather ask the user to clarify their request (e.g. \"What "
                "are some good restaurants around me?\" => \"Where are you?\" or \"When is the next flight "
                "to Tokyo\" => \"Where do you travel from?\")")
_METHARME_SYSTEM = ("Enter RP mode. You shall reply to the user while staying in character. Your responses "
                    "must be detailed, creative, immersive, and drive the scenario forward.")

# Cohere's Command-R and Aya: a system turn when given, then alternating turns, contents stripped
_COHERE = ("{{ bos_token }}" + _FIRST_SYSTEM +
           "{% if system_message is defined %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>' + "
           "system_message + '<|END_OF_TURN_TOKEN|>' }}{% endif %}{% for message in loop_messages %}"
           + _alternate() +
           "{% if message['role'] == 'user' %}{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + "
           "message['content'].strip() + '<|END_OF_TURN_TOKEN|>' }}{% elif message['role'] == 'assistant' %}"
           "{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' + message['content'].strip() + "
           "'<|END_OF_TURN_TOKEN|>' }}{% endif %}{% endfor %}"
           + _gen("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"))

# DeepSeek V3: every system turn joins the system text at the start; tool outputs form one block that
# the next assistant turn closes; a think block in an assistant content is dropped
_DEEPSEEK_V3 = (
    "{% set ns = namespace(is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{% if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{% else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{% endif %}"
    "{% endif %}{% endfor %}{{ bos_token + ns.system_prompt }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.is_tool = false %}"
    "{{ '<｜User｜>' + message['content'] }}{% elif message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}{% if ns.is_tool %}"
    "{{ '<｜tool▁outputs▁end｜>' + content + '<｜end▁of▁sentence｜>' }}{% set ns.is_tool = false %}"
    "{% else %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if not ns.is_tool %}{% set ns.is_output_first = true %}{% endif %}"
    "{% set ns.is_tool = true %}{% if ns.is_output_first %}{{ '<｜tool▁outputs▁begin｜>' }}"
    "{% set ns.is_output_first = false %}{% endif %}"
    "{{ '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}{% endif %}{% endfor %}"
    "{% if ns.is_tool %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{ '<｜Assistant｜>' }}{% endif %}")

# EXAONE 4: [|role|]\n turns; an assistant turn opens with an empty think block; tool results in
# one [|tool|] turn, each JSON-wrapped
_EXAONE4 = (
    "{% for message in messages %}{% set role = message['role'] %}"
    "{% if role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' ~ role) }}"
    "{% elif role == 'assistant' %}{{ '[|assistant|]\\n' }}{% if message['content'] %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].strip() %}{% endif %}"
    "{{ '<think>\\n\\n</think>\\n\\n' + content }}{% endif %}{{ '[|endofturn|]\\n' }}"
    "{% elif role == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '[|tool|]\\n' }}{% endif %}{{ '<tool_result>{\"result\": ' + message['content'] | tojson + "
    "'}</tool_result>' }}{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '[|endofturn|]\\n' }}{% else %}{{ '\\n' }}{% endif %}"
    "{% else %}{{ '[|' + role + '|]\\n' + message['content'] + '[|endofturn|]\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[|assistant|]\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is true %}{{ '<think>\\n' }}"
    "{% else %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}")

# Llama 4: a system header only when the conversation has a system turn (trimmed); tool results
# as ipython turns, JSON-quoted
_LLAMA4 = (
    "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
    "{{ '<|header_start|>system<|header_end|>\\n\\n' + messages[0]['content'] | trim + '<|eot|>' }}"
    "{% set messages = messages[1:] %}{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'tool' %}{{ '<|header_start|>ipython<|header_end|>\\n\\n' + "
    "message['content'] | tojson + '<|eot|>' }}{% else %}{{ '<|header_start|>' + message['role'] + "
    "'<|header_end|>\\n\\n' + message['content'] + '<|eot|>' }}{% endif %}{% endfor %}"
    + _gen("<|header_start|>assistant<|header_end|>\n\n"))

TEMPLATES = {
    "chatml": _CHATML,
    "qwen_25": ("{% if messages and messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + "
                "messages[0]['content'] + '<|im_end|>\\n' }}{% else %}{{ "
                + _lit(f"<|im_start|>system\n{_QWEN_SYSTEM}<|im_end|>\n") + " }}{% endif %}"
                "{% for message in messages %}{% if message['role'] in ['user', 'assistant'] or "
                "(message['role'] == 'system' and not loop.first) %}{{ " + _TURN + " }}" + _QWEN_TOOL +
                "{% endif %}{% endfor %}" + _gen("<|im_start|>assistant\n")),
    "qwen3": _QWEN3,
    "qwen3_5": _QWEN3,          # Axolotl's qwen3_5 renders text turns as its qwen3 does
    "llama3": ("{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
               "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
               "message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               + _gen("<|start_header_id|>assistant<|end_header_id|>\n\n")),
    "llama4": _LLAMA4,
    "mistral_v1": (_FIRST_SYSTEM + "{{ bos_token }}{% for message in loop_messages %}"
                   + _alternate(_AFTER_SYSTEM) + "{% if message['role'] == 'user' %}"
                   "{% if loop.first and system_message is defined %}"
                   "{{ ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
                   "{% else %}{{ ' [INST] ' + message['content'] + ' [/INST]' }}{% endif %}"
                   "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
                   "{% else %}{{ raise_exception(" + _lit(_ONLY_USER_ASSISTANT) + ") }}{% endif %}"
                   "{% endfor %}"),
    "mistral_v2v3": (_no_system("mistral_v2v3", _MISTRAL_SYSTEM_MOVES) + "{{ bos_token }}"
                     "{% for message in messages %}" + _alternate(_AFTER_SYSTEM) +
                     "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + '[/INST]' }}"
                     "{% else %}{{ ' ' + message['content'] | trim + eos_token }}{% endif %}{% endfor %}"),
    "mistral_v3_tekken": (_no_system("mistral_v3_tekken", _MISTRAL_SYSTEM_MOVES) + "{{ bos_token }}"
                          "{% for message in messages %}" + _alternate(_AFTER_SYSTEM) +
                          "{% if message['role'] == 'user' %}{{ '[INST]' + message['content'] + '[/INST]' }}"
                          "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"),
    "mistral_v7_tekken": (
        "{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
        "{% set system_message = messages[0]['content'] %}{% set loop_messages = messages[1:] %}{% else %}"
        "{% set system_message = " + _lit(_SMALL3_HEAD) + " + strftime_now('%Y-%m-%d') + "
        + _lit(_SMALL3_TAIL) + " %}{% set loop_messages = messages %}{% endif %}"
        "{{ '[SYSTEM_PROMPT]' + system_message + '[/SYSTEM_PROMPT]' }}{% for message in loop_messages %}"
        "{% if message['role'] == 'user' %}{{ '[INST]' + message['content'] + '[/INST]' }}"
        "{% elif message['role'] == 'system' %}"
        "{{ '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
        "{% else %}{{ raise_exception('Only user, system and assistant roles are supported!') }}{% endif %}"
        "{% endfor %}"),
    "gemma": (_no_system("gemma", "Gemma 1 and 2 have none; drop it (drop_system_message: true) or use "
                         "gemma3, which joins it to the first user turn")
              + "{{ bos_token }}{% for message in messages %}" + _alternate() + _GEMMA_ROLE +
              "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
              "{% endfor %}" + _gen("<start_of_turn>model\n")),
    "gemma3": _GEMMA3,
    "gemma3n": _GEMMA3,         # Gemma 3n's turns are Gemma 3's (they differ in audio / image parts only)
    "phi_3": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
              "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}{% elif message['role'] == 'user' %}"
              "{{ '<|user|>\\n' + message['content'] + '<|end|>\\n<|assistant|>\\n' }}"
              "{% elif message['role'] == 'assistant' %}{{ message['content'] + '<|end|>\\n' }}{% endif %}"
              "{% endfor %}"),
    "phi_35": ("{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
               "{{ '<|system|>\\n' + message['content'] + '<|end|>\\n' }}"
               "{% elif message['role'] in ['user', 'assistant'] %}"
               "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}{% endif %}"
               "{% endfor %}" + _gen("<|assistant|>\n")),
    "phi_4": ("{% set system_message = " + _lit(_PHI4_REASONING) + " %}"
              "{% if messages and messages[0]['role'] == 'system' %}"
              "{% set system_message = messages[0]['content'] %}"
              "{% set messages = messages[1:] %}{% endif %}"
              "{{ '<|im_start|>system<|im_sep|>' + system_message + '<|im_end|>' }}"
              "{% for message in messages %}"
              "{% if message['role'] in ['user', 'assistant'] %}{{ '<|im_start|>' + message['role'] + "
              "'<|im_sep|>' + message['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
              + _gen("<|im_start|>assistant<|im_sep|>")),
    "cohere": _COHERE,
    "aya": _COHERE,             # Aya's template is Command-R's (its unused default system text aside)
    "deepseek_v2": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                    "{{ '<｜User｜>' + message['content'] }}{% elif message['role'] == 'assistant' %}"
                    "{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
                    "{% elif message['role'] == 'system' %}"
                    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}" + _gen("<｜Assistant｜>")),
    "deepseek_v3": _DEEPSEEK_V3,
    "exaone": ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
               "{{ '[|system|][|endofturn|]\\n' }}{% endif %}"
               "{{ '[|' + message['role'] + '|]' + message['content'] }}"
               "{% if message['role'] == 'user' %}{{ '\\n' }}{% else %}{{ '[|endofturn|]\\n' }}{% endif %}"
               "{% endfor %}" + _gen("[|assistant|]")),
    "exaone4": _EXAONE4,
    "falcon_h1": ("{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
                  "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{% endif %}"
                  "{% for message in messages %}{% if message['role'] != 'system' %}{{ " + _TURN + " }}"
                  "{% endif %}{% endfor %}" + _gen("<|im_start|>assistant\n")),
    "nemotron_h": ("{% for message in messages %}{% if message['role'] == 'system' and loop.first or "
                   "message['role'] in ['user', 'assistant'] %}{{ " + _TURN + " }}"
                   "{% else %}{{ raise_exception('Unexpected role: ' + message['role']) }}{% endif %}"
                   "{% endfor %}" + _gen("<|im_start|>assistant\n")),
    "metharme": ("{{ bos_token }}{% if messages and messages[0]['role'] == 'system' %}"
                 "{% set system_message = messages[0]['content'] %}{% set loop_messages = messages[1:] %}"
                 "{% else %}{% set system_message = " + _lit(_METHARME_SYSTEM) + " %}"
                 "{% set loop_messages = messages %}{% endif %}{{ '<|system|>' + system_message }}"
                 "{% for message in loop_messages %}{% if message['role'] == 'user' %}"
                 "{{ '<|user|>' + message['content'].strip() }}{% elif message['role'] == 'assistant' %}"
                 "{{ '<|model|>' + message['content'].strip() }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|model|>' }}{% else %}{{ eos_token }}{% endif %}"),
    "alpaca": ("{{ bos_token }}{% for message in messages %}"
               "{% if message['role'] == 'system' and loop.first %}{{ message['content'] }}"
               "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] }}"
               "{% elif message['role'] == 'assistant' %}"
               "{{ '### Response:\\n' + message['content'] + eos_token }}{% endif %}"
               "{% if not loop.last %}{{ '\\n\\n' }}{% endif %}{% endfor %}" + _gen("\n\n### Response:\n")),
}
