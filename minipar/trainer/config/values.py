"""A config value checked against its key's type, and a mapping of keys applied onto dataclasses.

train_config.py holds the keys (TrainConfig and its nested FSDPConfig and LlamaConfig, each field
with a type and a default); this file is what makes a YAML mapping safe to apply onto them:

    _apply(cfg, {"max_steps": 20, "model": {"hidden_size": 64}, "lerning_rate": 1e-3})
        max_steps           checked as int, set
        model.hidden_size   a nested dataclass (one level): applied with the prefix "model."
        lerning_rate        unknown: collected, and ONE ValueError names every unknown key with its
                            nearest valid one ("Did you mean 'learning_rate'?"), then the valid keys

    _coerce(key, value, type)   Optional[...] takes null; float takes 3e-4 and 1E-3 as people write
                                them (PyYAML leaves an exponent without a dot a string, so floats
                                parse strings themselves) and refuses inf/nan; int refuses 2.5 and
                                true; bool takes only true/false; List[int] checks every item

Pure Python on one process: a bad config fails on every rank alike, before any collective.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from typing import List, Optional, Union

# how alike a key and a valid key must be for a "did you mean" (difflib's ratio; its default 0.6
# offered seed for deepspeed and learning_rate for pretraining_dataset: a hint that misleads is worse
# than none; keys of other tools have their own explanation, axolotl_keys.FOREIGN)
HINT_CUTOFF = 0.75


def _valid_keys(cls) -> List[str]:
    return [f.name for f in dataclasses.fields(cls)]


def unknown_keys_error(unknown: List[tuple]) -> ValueError:
    """One error for every unknown key: [(key, valid keys of its mapping, prefix)] -> ValueError
    naming each with its nearest valid key, then the valid keys."""
    parts, valid_lists = [], {}
    for key, valid, prefix in unknown:
        near = difflib.get_close_matches(key, valid, n=1, cutoff=HINT_CUTOFF)
        hint = f" Did you mean '{prefix}{near[0]}'?" if near else ""
        parts.append((f"'{prefix}{key}'", hint))
        valid_lists[prefix] = valid
    lists = "; ".join(f"Valid keys{' of ' + p[:-1] if p else ''}: {', '.join(dict.fromkeys(v))}"
                      for p, v in valid_lists.items())
    if len(parts) == 1:
        return ValueError(f"unknown config key {parts[0][0]}.{parts[0][1]} {lists}")
    listed = ", ".join(f"{name}{' (' + hint.strip() + ')' if hint else ''}" for name, hint in parts)
    return ValueError(f"{len(parts)} unknown config keys: {listed}. {lists}")


def _field_types(cls) -> dict:
    return typing.get_type_hints(cls)


def _parse_float(key: str, value) -> float:
    """A float as people write it: 3e-4, 1E-3, 2.5, 3 (YAML gives '3e-4' as a string)."""
    if isinstance(value, bool):
        raise ValueError(f"config key '{key}' must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            raise ValueError(f"config key '{key}' must be a number (e.g. 3e-4), got {value!r}") from None
    else:
        raise ValueError(f"config key '{key}' must be a number (e.g. 3e-4), got {value!r}")
    if not math.isfinite(out):
        raise ValueError(f"config key '{key}' must be a finite number, got {value!r}")
    return out


def _coerce(key: str, value, typ):
    """Check a value against the key's annotated type. Optional keys take null; floats take ints
    and the strings YAML leaves unparsed (3e-4); ints and bools are strict."""
    args = typing.get_args(typ)
    optional = typing.get_origin(typ) is Union and type(None) in args
    if value is None:
        if optional:
            return None
        raise ValueError(f"config key '{key}' cannot be null")
    if optional:
        rest = [a for a in args if a is not type(None)]
        typ = rest[0] if len(rest) == 1 else Union[tuple(rest)]
    if typ is float:
        return _parse_float(key, value)
    if typ is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key '{key}' must be true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config key '{key}' must be an integer, got {value!r}")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise ValueError(f"config key '{key}' must be a string, got {value!r}")
        return value
    if typing.get_origin(typ) in (list, List):
        item = (typing.get_args(typ) or (object,))[0]
        if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
            raise ValueError(f"config key '{key}' must be a list of {getattr(item, '__name__', item)}s, "
                             f"got {value!r}")
        return value
    return value                              # unions (bf16: true/false/auto) are checked where used


def _apply(obj, updates: dict, prefix: str = "", unknown: Optional[list] = None,
           problems: Optional[list] = None):
    """Set the keys of `updates` on the dataclass `obj`; unknown keys are appended to `unknown`
    (raised at once when it is None), values of the wrong type to `problems` (raised at once when
    it is None)."""
    collect = [] if unknown is None else unknown
    valid, types = _valid_keys(type(obj)), _field_types(type(obj))
    for key, value in updates.items():
        if key not in valid:
            collect.append((key, valid, prefix))
            continue
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and not prefix:   # fsdp, model: one level of nesting
            if not isinstance(value, dict):
                err = ValueError(f"config key '{key}' must be a mapping of "
                                 f"{', '.join(_valid_keys(type(current)))}")
                if problems is None:
                    raise err
                problems.append(err)
                continue
            _apply(current, value, prefix=key + ".", unknown=collect, problems=problems)
        else:
            try:
                setattr(obj, key, _coerce(prefix + key, value, types[key]))
            except ValueError as err:
                if problems is None:
                    raise
                problems.append(err)
    if unknown is None and collect:
        raise unknown_keys_error(collect)
