"""Write tests/data/axolotl_schema_keys.txt: every top-level key of Axolotl's config schema.

Axolotl validates a YAML file with one pydantic model, AxolotlInputConfig (in its repository's
axolotl/utils/schemas/config.py), which inherits a model per group of keys (ModelInputConfig,
LoraConfig, HyperparametersConfig, WandbConfig, ...; validation mixins add none). A top-level key is
a field of that model or of any class it inherits, written by its name or by its alias
(`Field(alias="model_type")`, `validation_alias=AliasChoices(...)`): Axolotl sets
populate_by_name, so both spellings are read.

This reads the schema's source with `ast`, without importing Axolotl (whose imports need torch,
accelerate, transformers): every class of the schema package is indexed by name, the bases of
AxolotlInputConfig are followed recursively, and each annotated assignment of a class body
(`name: type = ...`) is a field, unless it is `model_config`, a ClassVar or private (`_name`).

    python tests/data/extract_axolotl_keys.py GIT_DIR [COMMIT] > tests/data/axolotl_schema_keys.txt

GIT_DIR is a clone (or bare mirror) of github.com/axolotl-ai-cloud/axolotl; COMMIT defaults to
HEAD. The output is sorted, one key per line, after a header naming the commit.
"""
from __future__ import annotations

import ast
import subprocess
import sys

SCHEMAS = "src/axolotl/utils/schemas/"
ROOT_CLASS = "AxolotlInputConfig"


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True,
                          text=True).stdout


def _classes(git_dir: str, commit: str) -> dict:
    """{class name: ast.ClassDef} of every module of the schema package at `commit`."""
    out = {}
    for path in _git(git_dir, "ls-tree", "-r", "--name-only", commit, SCHEMAS).split():
        if path.endswith(".py"):
            tree = ast.parse(_git(git_dir, "show", f"{commit}:{path}"))
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    assert node.name not in out, f"two classes named {node.name}"
                    out[node.name] = node
    return out


def _aliases(value) -> list:
    """The alias strings of a `Field(...)` call: alias=, validation_alias= (a string or AliasChoices)."""
    if not (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Field"):
        return []
    out = []
    for kw in value.keywords:
        if kw.arg in ("alias", "validation_alias"):
            consts = [kw.value] if isinstance(kw.value, ast.Constant) else \
                kw.value.args if isinstance(kw.value, ast.Call) else []
            out += [c.value for c in consts if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return out


def _fields(node: ast.ClassDef) -> list:
    out = []
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        name = stmt.target.id
        if name == "model_config" or name.startswith("_") or "ClassVar" in ast.unparse(stmt.annotation):
            continue
        out += [name] + _aliases(stmt.value)
    return out


def schema_keys(git_dir: str, commit: str = "HEAD") -> list:
    """The sorted top-level keys of AxolotlInputConfig and every class it inherits."""
    classes = _classes(git_dir, commit)
    seen, keys, todo = set(), set(), [ROOT_CLASS]
    while todo:
        name = todo.pop()
        if name in seen or name not in classes:       # BaseModel and other outside classes: no keys
            continue
        seen.add(name)
        keys.update(_fields(classes[name]))
        todo += [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
    return sorted(keys)


def main(argv) -> int:
    git_dir, commit = argv[0], argv[1] if len(argv) > 1 else "HEAD"
    sha, date = _git(git_dir, "log", "-1", "--format=%H %cs", commit).split()
    keys = schema_keys(git_dir, sha)
    print(f"# The top-level keys of Axolotl's config schema: the pydantic fields (and their aliases) of\n"
          f"# AxolotlInputConfig and every class it inherits, in axolotl/utils/schemas/*.py of\n"
          f"# github.com/axolotl-ai-cloud/axolotl at commit {sha} ({date}):\n"
          f"# {len(keys)} keys, extracted by tests/data/extract_axolotl_keys.py (with ast, no import).\n"
          f"# Each has a status in minipar (tests/test_axolotl_keys.py checks): a TrainConfig field or\n"
          f"# alias, a key keys.translate folds (fsdp_config), or a row of the table of\n"
          f"# minipar/trainer/config/axolotl_keys.py (honoured, noted or refused).")
    print("\n".join(keys))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
