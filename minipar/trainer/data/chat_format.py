"""Chat rows (type: chat_template, and the legacy sharegpt form) -> ids and trained tokens, with
Axolotl's masking rules (axolotl/prompt_strategies/chat_template.py, ChatTemplateStrategy):

    field_messages: messages             the row's key holding the turns (sharegpt: conversations)
    message_property_mappings:           the message keys read as role and content
      {role: role, content: content}     (sharegpt: {role: from, content: value}; the deprecated
                                         message_field_role / message_field_content say the same)
    roles: {user: [human, user], ...}    source role names -> the template's; the default maps
                                         human -> user, gpt -> assistant, keeps system/user/assistant/tool
    roles_to_train: [assistant]          turns whose content is trained (names mapped through roles)
    train_on_eos: turn                   turn: the eos after each trained turn; all: after every turn;
                                         last: only the last one found; none: no eos trained
    train_on_inputs: false               true trains every turn's content (and eos, as for a trained
                                         turn); the role headers and the template's bos never are

A row's `system` field becomes a system turn first when the conversation does not start with one.

How a turn is found. The conversation is rendered one message longer at a time; the text each
message adds (the template must only append, as chat templates do, or close the conversation with
a text it writes after the last turn only, as Metharme's eos or the <|im_end|> closing a run of Qwen
tool turns; a template that reads real_last_index is told the whole conversation's last index, as
Axolotl tells it, so Qwen3's last-turn think block stays put) is that turn, and its content is located
in it (verbatim, or trimmed where the template trims); a turn the template writes inside the next
one (a system turn joined to the first user turn) is located in the next turn's text. The whole
rendering is tokenized once (a fast tokenizer's character offsets); a token is in a turn's content
when its first character is. The turn's eos is the first eos token at
most 3 tokens after the content's last token (Axolotl's tolerance for template padding). Since
minipar has no eot_tokens key, the end-of-turn token is the eos (Axolotl's default), and train_on_eot,
when set, must equal train_on_eos (Axolotl raises the same conflict).
"""
from __future__ import annotations

import json
from typing import List, Optional, Sequence, Tuple

from minipar.trainer.data.formats import shift_labels

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_ROLES = {"human": "user", "user": "user", "assistant": "assistant", "gpt": "assistant",
                 "system": "system", "tool": "tool"}
TRAIN_ON_EOS = ("turn", "all", "last", "none")
EOS_TOLERANCE = 3


def role_map(roles: Optional[dict]) -> dict:
    """Axolotl's `roles` ({target: [sources]}) as source -> target; the default when not given."""
    if not roles:
        return dict(DEFAULT_ROLES)
    return {s: t for t, sources in roles.items()
            for s in ([sources] if isinstance(sources, str) else sources)}


def conversation(row, spec: dict, where: str) -> List[dict]:
    """The row's turns as {role, content}, mapped by the entry's settings and checked."""
    name = spec["field_messages"]
    if not isinstance(row, dict) or row.get(name) is None:
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where}: the row has no field {name!r} (keys: {keys}); a chat_template row is "
                         f"{{\"{name}\": [{{\"role\": ..., \"content\": ...}}]}} (set field_messages)")
    messages = row[name]
    if isinstance(messages, str):                # Axolotl accepts the turns stored as a JSON string
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: field {name!r} is a string that is not JSON turns") from None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: `{name}` must be a non-empty list of {{role, content}}, "
                         f"got {messages!r:.80}")
    mapping, roles = spec["message_property_mappings"], spec["roles"]
    turns = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get(mapping["role"]) is None or m.get(mapping["content"]) is None:
            hint = ("; these turns use from/value: set message_property_mappings: "
                    "{role: from, content: value}"
                    if isinstance(m, dict) and "from" in m and "value" in m else "")
            raise ValueError(f"{where}: message {j} must be a mapping with `{mapping['role']}` and "
                             f"`{mapping['content']}`, got {m!r:.80}{hint}")
        role, content = roles.get(m[mapping["role"]], m[mapping["role"]]), m[mapping["content"]]
        if role not in ROLES:
            raise ValueError(f"{where}: message {j} has unknown role {role!r}; known roles: {ROLES} "
                             f"(map others with `roles`)")
        if not isinstance(content, str):
            raise ValueError(f"{where}: message {j} content must be a string, got {content!r:.80}")
        turns.append(dict(role=role, content=content))
    system = row.get(spec.get("field_system") or "system")
    if turns[0]["role"] != "system" and isinstance(system, str):
        turns.insert(0, dict(role="system", content=system))
    if spec.get("drop_system_message") and turns[0]["role"] == "system":
        turns = turns[1:]
    return turns


def _render(tokenizer, turns, template, where: str, last: Optional[int] = None) -> str:
    """turns rendered; a template that reads real_last_index (Axolotl's convention, qwen3) is told
    `last`, the index of the whole conversation's last message, so a prefix renders its turns as the
    whole conversation does (Qwen3's think block opens the conversation's last assistant turn only)."""
    text = template if template is not None else getattr(tokenizer, "chat_template", None)
    extra = {"real_last_index": last} if last is not None and text and "real_last_index" in text else {}
    try:
        # (a tokenizer's own template: the one-argument call every tokenizer here answers)
        return (tokenizer.render_chat(turns, template, **extra) if template is not None or extra
                else tokenizer.render_chat(turns))
    except ValueError as err:                    # the template's raise_exception (roles, system turns)
        raise ValueError(f"{where}: {err}") from None


def _kept(prev: str, cur: str) -> Optional[int]:
    """How much of the last rendering the next one keeps: all of it (a template that only appends),
    or all but a closing text that the template writes after the last turn only (Metharme's eos when
    no generation prompt follows): the shortest common tail whose removal leaves a prefix of `cur`.
    None: the template rewrites an earlier turn."""
    if cur.startswith(prev):
        return len(prev)
    n = 0
    while n < min(len(prev), len(cur)) and prev[-1 - n] == cur[-1 - n]:
        n += 1
    return next((len(prev) - k for k in range(1, n + 1) if cur.startswith(prev[:-k])), None)


def _find(text: str, content: str, start: int) -> Tuple[int, int]:
    """(a, b) of `content` in text[start:], verbatim or as the template's `trim` leaves it; (-1, -1)."""
    for c in (content, content.strip()):
        pos = text.find(c, start) if c else start
        if pos >= 0:
            return pos, pos + len(c)
    return -1, -1


def content_spans(turns, tokenizer, where: str, template: Optional[str] = None
                  ) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and each turn's content as a character span of it. A turn's
    content is looked for in the text its message adds; a turn the template writes later (a system
    turn that Mistral v1 and Gemma 3 put inside the first user turn) is looked for, in order, in
    the next text added."""
    prev, spans, waiting = "", [None] * len(turns), []
    for j in range(len(turns)):
        cur = _render(tokenizer, turns[: j + 1], template, where, len(turns) - 1)
        keep = _kept(prev, cur)
        if keep is None or any(s is not None and s[1] > keep for s in spans):
            raise ValueError(f"{where}: the chat template rewrites earlier turns when a message is added, so "
                             f"the turns cannot be located; use a template that only appends")
        pos, waiting = keep, waiting + [j]
        for k in list(waiting):
            a, b = _find(cur, turns[k]["content"], pos)
            if a < 0:
                break                            # looked for again in the next message's text
            spans[k], pos = (a, b), b
            waiting.remove(k)
        prev = cur
    if waiting:
        raise ValueError(f"{where}: the chat template does not render message {waiting[0]}'s content "
                         f"verbatim")
    return prev, spans


def chat_example(messages, tokenizer, train_on_inputs: bool, where: str,
                 roles_to_train: Sequence[str] = ("assistant",),
                 train_on_eos: str = "turn", template: Optional[str] = None) -> Tuple[List[int], List[int]]:
    """ids and shifted labels of a conversation of {role, content} turns (already mapped), rendered
    with `template` (a Jinja string; None: the tokenizer's own, chat_templates.py)."""
    spec = dict(field_messages="messages", message_property_mappings=dict(role="role", content="content"),
                roles=role_map(None))
    turns = conversation({"messages": messages}, spec, where)
    text, spans = content_spans(turns, tokenizer, where, template)
    ids, offsets = tokenizer.encode_with_offsets(text)
    trained = [False] * len(ids)
    eos_id, last_eos = getattr(tokenizer, "eos_token_id", None), -1
    for turn, (a, b) in zip(turns, spans):
        train = train_on_inputs or turn["role"] in roles_to_train
        if (not train and train_on_eos != "all") or a == b:
            continue
        inside = [t for t, (s, _) in enumerate(offsets) if a <= s < b]
        if not inside:
            continue
        if train:
            for t in inside:
                trained[t] = True
        end = inside[-1] + 1
        k = next((t for t in range(end, len(ids)) if ids[t] == eos_id), -1) if eos_id is not None else -1
        if k != -1 and k - end <= EOS_TOLERANCE:
            last_eos = k
            if train_on_eos == "all" or (train_on_eos == "turn" and train):
                trained[k] = True
    if train_on_eos == "last" and last_eos != -1:
        trained[last_eos] = True
    return ids, shift_labels(ids, trained)


def chat_row(row, spec: dict, tokenizer, train_on_inputs: bool, where: str) -> Tuple[List[int], List[int]]:
    turns = conversation(row, spec, where)
    return chat_example(turns, tokenizer, train_on_inputs, where, spec["roles_to_train"],
                        spec["train_on_eos"], spec.get("template"))


# ------------------------------------------------------------------ for preference.py (DPO rows)
def _check_messages(messages, where: str) -> None:
    spec = dict(field_messages="messages", message_property_mappings=dict(role="role", content="content"),
                roles=role_map(None))
    conversation({"messages": messages}, spec, where)


def chat_spans(messages, tokenizer, where: str) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns, each from its
    content's start to after the turn's eos text (or the turn's end)."""
    text, spans = content_spans(messages, tokenizer, where)
    out, eos = [], getattr(tokenizer, "eos_token", None)
    ends = [len(_render(tokenizer, messages[: j + 1], None, where, len(messages) - 1))
            for j in range(len(messages))]
    for m, (a, b), end in zip(messages, spans, ends):
        if m["role"] == "assistant":
            k = text.find(eos, b, end) if eos else -1
            out.append((a, k + len(eos) if k >= 0 else end))
    return text, out
