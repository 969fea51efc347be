"""Axolotl's text formats -> token ids and which of them are trained (chat rows: chat_format.py).

Each format gives the ids x_0 .. x_{n-1} of one example and a flag per token, trained or not, as
Axolotl's prompt strategies build them (axolotl/prompt_strategies/ and Axolotl's prompt_tokenizers module):

    completion    {field: "..."}      x = [bos] text [eos], every token trained
    pretrain      {text_column: ...}  the same (pretraining_dataset's rows); a long document is cut
                                      into sequence_len pieces even without packing, as Axolotl
                                      windows it (without its tokenizer's 256-token overlap)
    alpaca        {instruction, input, output}
                  x = [bos] prompt response [eos], the prompt and the response tokenized apart (as
                  Axolotl does), the prompt Axolotl's AlpacaPrompter text:
                    "Below is an instruction that describes a task, paired with an input that provides
                     further context. Write a response that appropriately completes the request.\\n\\n"
                    "### Instruction:\\n{instruction}\\n\\n### Input:\\n{input}\\n\\n### Response:\\n"
                  (without an input: "Below is an instruction that describes a task. Write a response
                  that appropriately completes the request.\\n\\n### Instruction:\\n{instruction}\\n\\n
                  ### Response:\\n"); trained: the response and its eos, or everything with
                  train_on_inputs. alpaca:chat, alpaca:chatml and alpaca:phi pick Axolotl's other styles
    input_output  {segments: [{text, label: true|false}, ...]}
                  x = the segments' tokens, no bos or eos added; a segment's tokens are trained when
                  its label is true (or train_on_inputs)

Labels are shifted by one, as the model expects: label[t] = x[t+1] when x[t+1] is trained, else -100,
and the last label is -100. Axolotl writes labels unshifted (the Hugging Face model shifts them), so
its labels[1:] + [-100] are these. A row without a field the format needs raises a ValueError naming
the file, the row and the field.
"""
from __future__ import annotations

from typing import List, Tuple

from minipar.batch_split import IGNORE_INDEX

ALPACA_SYSTEM = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.")
ALPACA_SYSTEM_NO_INPUT = ("Below is an instruction that describes a task. Write a response that "
                          "appropriately completes the request.")
# prompt style -> (system format, turn format, turn format without input): axolotl/prompters.py
ALPACA_STYLES = {
    "instruct": ("{system}\n\n", "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                 "### Instruction:\n{instruction}\n\n### Response:\n"),
    "chat": ("SYSTEM: {system}\n", "USER: {instruction}\n{input}\nASSISTANT:",
             "USER: {instruction}\nASSISTANT:"),
    "chatml": ("<|im_start|>system\n{system}<|im_end|>\n",
               "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"),
    "phi": ("<|system|>\n{system}<|end|>\n", "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
            "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"),
}


def shift_labels(ids: List[int], trained: List[bool]) -> List[int]:
    """labels[t] = ids[t+1] where that token is trained, else -100; the last label is -100."""
    return [ids[t + 1] if trained[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)] + [IGNORE_INDEX]


def _field(row, name: str, where: str, fmt: str, optional: bool = False):
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a {fmt} row is a JSON object, got {type(row).__name__} {row!r:.80}")
    if name not in row or (row[name] is None and not optional):
        if optional:
            return None
        raise ValueError(f"{where}: the row has no field {name!r} (keys: {sorted(row)}); "
                         f"a {fmt} row needs it")
    return row[name]


def _bos(tokenizer) -> List[int]:
    return [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]


def _eos(tokenizer) -> List[int]:
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def completion_example(text, tokenizer, where: str) -> Tuple[List[int], List[int]]:
    if not isinstance(text, str) or not text:
        raise ValueError(f"{where}: the text must be a non-empty string, got {text!r}")
    ids = _bos(tokenizer) + tokenizer.encode(text) + _eos(tokenizer)
    return ids, shift_labels(ids, [True] * len(ids))


def completion_row(row, field: str, tokenizer, where: str) -> Tuple[List[int], List[int]]:
    if isinstance(row, str):                     # a .txt paragraph
        return completion_example(row, tokenizer, where)
    if not isinstance(row, dict) or field not in row:
        raise ValueError(f"{where}: the row has no field {field!r} (keys: "
                         f"{sorted(row) if isinstance(row, dict) else type(row).__name__}); set "
                         f"`field` in this dataset entry")
    return completion_example(row[field], tokenizer, where)


def alpaca_prompt(instruction: str, inp: str, style: str = "instruct") -> str:
    system_format, turn, turn_no_input = ALPACA_STYLES[style]
    if inp:
        return system_format.format(system=ALPACA_SYSTEM) + turn.format(instruction=instruction, input=inp)
    return system_format.format(system=ALPACA_SYSTEM_NO_INPUT) + turn_no_input.format(instruction=instruction)


def alpaca_row(row, tokenizer, train_on_inputs: bool, where: str,
               style: str = "instruct") -> Tuple[List[int], List[int]]:
    instruction = _field(row, "instruction", where, "alpaca")
    inp = _field(row, "input", where, "alpaca", optional=True) or ""
    output = _field(row, "output", where, "alpaca")
    for name, value in (("instruction", instruction), ("input", inp), ("output", output)):
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {name!r} must be a string, got {value!r:.80}")
    prompt = _bos(tokenizer) + tokenizer.encode(alpaca_prompt(instruction, inp, style))
    response = tokenizer.encode(output) + _eos(tokenizer) if output else []   # Axolotl: no text, no eos
    ids = prompt + response
    trained = [train_on_inputs] * len(prompt) + [True] * len(response)
    return ids, shift_labels(ids, trained)


def input_output_row(row, tokenizer, train_on_inputs: bool, where: str) -> Tuple[List[int], List[int]]:
    segments = _field(row, "segments", where, "input_output")
    if not isinstance(segments, list) or not segments:
        raise ValueError(f"{where}: `segments` must be a non-empty list of {{text, label}}, "
                         f"got {segments!r:.80}")
    ids, trained = [], []
    for j, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("text"), str) \
                or not isinstance(seg.get("label"), bool):
            raise ValueError(f"{where}: segment {j} must be {{text: str, label: true|false}}, "
                             f"got {seg!r:.80}")
        piece = tokenizer.encode(seg["text"])
        ids += piece
        trained += [seg["label"] or train_on_inputs] * len(piece)
    if not ids:
        raise ValueError(f"{where}: the segments hold no text")
    return ids, shift_labels(ids, trained)
