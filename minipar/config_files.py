"""Reading the files a run is configured by, with one-line errors that name the file and the fix.

A parser's own exception is no message for a person. json's is a ValueError that never names the
file ("Expecting value: line 2 column 1 (char 1)": which of base_model's JSON files?); PyYAML's is
no ValueError at all, so it escapes train.py's and `python -m minipar.plan`'s "error: ..." (exit 2)
as a traceback. Here each becomes ONE ValueError line naming the file, with 1-based line and column
as editors count them, and what to do:

    read_yaml(path)            configs/fsdp.yaml, line 2, column 1: not valid YAML: found character
                               '\\t' that cannot start any token (YAML does not allow a tab
                               here: replace it with spaces)
    read_json(path, fix)       base/config.json, line 2, column 1: not valid JSON (Expecting value);
                               <fix, e.g. re-download the model>
    yaml_value(text, key)      a command-line `--key value`: --max_steps '[3': not a YAML value (...)

Used by load_config and run_setup (the YAML config), hf_checkpoint (config.json and the shard
index of base_model, and through it the planner's --model). Pure Python: no torch, no collective.
"""
from __future__ import annotations

import json

import yaml


def _yaml_reason(err: yaml.YAMLError) -> str:
    """The YAML error's problem in one line, plus the fix for the commonest one (a tab)."""
    problem = str(getattr(err, "problem", None) or str(err).splitlines()[0])
    tab = "\t" in problem or "'\\t'" in problem           # PyYAML writes the tab as '\t'
    problem = " ".join(problem.replace("\t", "\\t").split())    # one line; the tab shown as \t
    return problem + (" (YAML does not allow a tab here: replace it with spaces)" if tab else "")


def _yaml_where(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    return f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""


def read_yaml(path: str):
    """The parsed YAML file (None when empty); a syntax error is one ValueError naming file, line, column."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}{_yaml_where(err)}: not valid YAML: {_yaml_reason(err)}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start}); is it a "
                         f"YAML config?") from None


def yaml_value(text: str, key: str):
    """A `--key value` from the command line, parsed as a YAML scalar or list (20, true, null, [a, b])."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"--{key} {text!r}: not a YAML value ({_yaml_reason(err)}); quote it or fix "
                         f"the brackets") from None


def read_json(path: str, fix: str):
    """The parsed JSON file; an invalid one is one ValueError naming the file, the position and `fix`."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {err.lineno}, column {err.colno}: not valid JSON ({err.msg}); "
                         f"{fix}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a UTF-8 text file ({err.reason} at byte {err.start}); {fix}") from None
