"""pydantic's ValidationError as this project's errors: one line per problem, all of a file in one.

pydantic checks every key of a mapping against the schema (schema.py) and reports each failure as a
record, {"type": "int_type", "loc": ("model", "hidden_size"), "input": 2.5}, worded for a Python
caller ("Input should be a valid integer"). problems_of() words it for a YAML writer:

    int_type, bool_type, ...   config key 'model.hidden_size' must be an integer, got 2.5
    the input None             config key 'max_steps' cannot be null
    greater_than, ...          learning_rate must be > 0, got -1.0  (min_lr_ratio must lie in [0, 1];
                               the field's description after the rule)
    literal_error              ddp must be naive or bucketed, got 'fast'
    value_error                the validator's own sentence (schema.supported(), LlamaConfig's)
    extra_forbidden            an unknown key, for one_error's head

A key written with its Axolotl alias is named with both: dpo_beta (rl_beta) must be > 0. one_error()
joins everything a file got wrong into the ONE error train.py prints as one line (exit 2): the
unknown keys, each with the nearest valid name ("Did you mean 'learning_rate'?"), then every wrong
value, then the valid keys. The hint is drawn from the schema's fields and aliases and Axolotl's
honoured keys first (a typo most likely means a key that does something: flash_attn ->
flash_attention, not flash_attn_d512), then from Axolotl's noted and refused keys (wandb_wach ->
wandb_watch); the valid keys listed are the first kind.
"""
from __future__ import annotations

import difflib
import re
from typing import Dict, List, Sequence, Tuple

from pydantic import ValidationError

# how alike a key and a valid key must be for a "did you mean" (difflib's ratio; its default 0.6
# offered seed for deepspeed and learning_rate for pretraining_dataset: a hint that misleads is worse
# than none; keys of other tools have their own explanation, axolotl_table_run.RUNTIME)
HINT_CUTOFF = 0.75
EXPECTED = {"int": "an integer", "float": "a number (e.g. 3e-4)", "finite": "a finite number",
            "bool": "true or false", "string": "a string", "list": "a list", "dict": "a mapping"}
PLURAL = {"an integer": "integers", "a string": "strings", "a number (e.g. 3e-4)": "numbers",
          "true or false": "booleans", "a mapping": "mappings"}
BOUNDS = {"gt": (">", "("), "ge": (">=", "["), "lt": ("<", ")"), "le": ("<=", "]")}


def names(model) -> List[str]:
    """A model's keys as a YAML file may write them: its fields and their aliases."""
    out = []
    for name, f in model.model_fields.items():
        out += [name] + ([f.validation_alias] if isinstance(f.validation_alias, str) else [])
    return out


def _at(data, loc) -> Tuple[tuple, object]:
    """The key path of an error's location (the part of it that names mapping keys) and its value."""
    path, value = (), data
    for part in loc:
        if not (isinstance(value, dict) and part in value):
            break
        path, value = path + (part,), value[part]
    return path, value


def _fmt(bound) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def _range(name: str, field, value) -> str:
    """greater_than & co: the field's bounds (one, or an interval) and its description."""
    bounds = {k: getattr(m, k) for m in field.metadata for k in BOUNDS if hasattr(m, k)}
    low = [k for k in ("gt", "ge") if k in bounds]
    high = [k for k in ("lt", "le") if k in bounds]
    if low and high:
        rule = (f"must lie in {BOUNDS[low[0]][1]}{_fmt(bounds[low[0]])}, "
                f"{_fmt(bounds[high[0]])}{BOUNDS[high[0]][1]}")
    else:
        k = (low or high)[0]
        rule = f"must be {BOUNDS[k][0]} {_fmt(bounds[k])}"
    why = f" ({field.description})" if field.description else ""
    if isinstance(value, int) and not isinstance(value, bool) and "float" in str(field.annotation):
        value = float(value)              # a number key's value as it is used
    return f"{name} {rule}{why}, got {value}"


def _line(name: str, field, errors: list, value) -> str:
    """One line for the records of one key (several: a union's members, or a list's items)."""
    kind, ctx = errors[0]["type"], errors[0].get("ctx", {})
    why = f" ({field.description})" if field is not None and field.description else ""
    if value is None:
        return f"config key '{name}' cannot be null"
    if kind == "value_error":
        return str(ctx["error"])
    if field is not None and kind.split("_")[0] in ("greater", "less"):
        return _range(name, field, errors[0]["input"])
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", ctx["expected"])
        rule = " or ".join(options) if len(options) == 2 else "one of " + ", ".join(options)
        return f"{name} must be {rule}{why}, got {value!r}"
    wanted = list(dict.fromkeys(EXPECTED.get(e["type"].split("_")[0], e["msg"].lower()) for e in errors))
    if len(wanted) > 1 and why:           # a union (true, false or auto): its description says it
        return f"config key '{name}' must be {field.description}, got {value!r}"
    if isinstance(errors[0]["loc"][-1], int):     # an item of a list
        return f"config key '{name}' must be a list of {PLURAL.get(wanted[0], 'values')}, got {value!r}"
    return f"config key '{name}' must be {' or '.join(wanted)}, got {value!r}"


def problems_of(error: ValidationError, data: dict, sections: Dict[str, type], renamed: Dict[str, str],
                extra_names: Sequence[str] = (),
                hint_names: Sequence[str] = ()) -> Tuple[List[tuple], List[str]]:
    """(unknown keys as (key, valid keys, prefix, hint-only keys), one line per wrong key) of a
    ValidationError of `data`. sections: the model of each mapping ("" the top, "model", "fsdp");
    renamed: field -> the alias a source wrote; extra_names: more valid top-level names; hint_names:
    top-level names offered as a hint only when no valid name is close (not listed)."""
    unknown, grouped = [], {}
    for e in error.errors():
        path, value = _at(data, e["loc"])
        if e["type"] in ("extra_forbidden", "invalid_key"):      # invalid_key: a key that is no string
            prefix = ".".join(path[:-1])
            valid = names(sections[prefix]) + (list(extra_names) if not prefix else [])
            unknown.append((str(path[-1]), valid, prefix + "." if prefix else "",
                            list(hint_names) if not prefix else []))
        else:
            grouped.setdefault(path, []).append(e)
    lines = []
    for path, errors in grouped.items():
        model = sections.get("" if len(path) == 1 else path[0], sections[""])
        field = model.model_fields.get(path[-1]) if path else None
        name = ".".join(map(str, path)) + (f" ({renamed[path[0]]})" if len(path) == 1 and path[0] in renamed
                                           else "")
        value = _at(data, path)[1]
        if len(path) == 1 and path[0] in sections and not isinstance(value, dict):
            lines.append(f"config key '{name}' must be a mapping of {', '.join(names(sections[path[0]]))}")
        else:
            lines.append(_line(name, field, errors, value))
    return unknown, lines


def one_error(unknown: List[tuple], problems: Sequence[Exception]) -> None:
    """Raise everything a config got wrong as ONE error: the unknown keys (with the nearest valid
    one), then every wrong value, then the valid keys. An unknown key is (key, valid keys, prefix)
    or (key, valid keys, prefix, hint-only keys). A single problem keeps its own type
    (FileNotFoundError for a missing file). Nothing to raise: returns."""
    if not unknown:
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise ValueError(f"{len(problems)} config values are wrong: " + "; ".join(map(str, problems)))
        return
    parts, valid_lists = [], {}
    for key, valid, prefix, *hint_only in unknown:
        near = difflib.get_close_matches(key, valid, n=1, cutoff=HINT_CUTOFF) or \
            difflib.get_close_matches(key, hint_only[0] if hint_only else [], n=1, cutoff=HINT_CUTOFF)
        parts.append((f"'{prefix}{key}'", f"Did you mean '{prefix}{near[0]}'?" if near else ""))
        valid_lists[prefix] = valid
    lists = "; ".join(f"Valid keys{' of ' + p[:-1] if p else ''}: {', '.join(dict.fromkeys(v))}"
                      for p, v in valid_lists.items())
    if len(parts) == 1:
        head = f"unknown config key {parts[0][0]}.{' ' + parts[0][1] if parts[0][1] else ''}"
    else:
        head = f"{len(parts)} unknown config keys: " + ", ".join(
            f"{name}{f' ({hint})' if hint else ''}" for name, hint in parts) + "."
    if problems:
        are = "s are" if len(problems) > 1 else " is"
        head += f" And {len(problems)} config value{are} wrong: " + "; ".join(map(str, problems)) + "."
    raise ValueError(f"{head} {lists}")
