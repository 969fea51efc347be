"""The project's import graph, read with `ast` (nothing is imported): which module imports which,
from where in the file, and what each module defines. tests/test_imports.py holds it to the layer
order of docs/design.md.

    modules()        {dotted name: Module} for every Python file of minipar/, models/, train.py,
                     benchmarks/ and tests/; read once per process (tests/test_imports.py and
                     tests/test_docs.py share it: 1-2 s, one pass over each tree), so its callers only read it
    Module.imports   [Import(target, names, line, top_level)]: `from a.b import c` is an edge to the
                     module a.b.c when that is a module, else to a.b (its names: c)
    Module.defined   names a module binds itself (def, class, assignment), not by importing
    Module.imported  {name: source module} of the names it binds by importing a project module
    Module.attribute_uses  [(module alias target, attribute, line)]: `ckpt.save_checkpoint(...)`
"""
from __future__ import annotations

import ast
import collections
import functools
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("minipar", "models")          # what an import can reach
PROGRAMS = ("train.py", "benchmarks", "tests")   # what may import anything


@dataclass
class Import:
    target: str                 # the project module this statement reaches
    names: List[str]            # the names it takes from it ([] for a module import)
    line: int
    top_level: bool             # at module level (also inside a module-level if/try), not in a function


@dataclass
class Module:
    name: str
    path: str
    is_package: bool
    imports: List[Import] = field(default_factory=list)
    defined: Set[str] = field(default_factory=set)
    imported: Dict[str, str] = field(default_factory=dict)
    module_aliases: Dict[str, str] = field(default_factory=dict)   # local name -> project module
    attribute_uses: List[Tuple[str, str, int]] = field(default_factory=list)


def _files() -> List[str]:
    out = []
    for top in PACKAGES + PROGRAMS:
        if top.endswith(".py"):
            out.append(os.path.join(ROOT, top))
            continue
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
    return sorted(out)


def _name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _resolve(node: ast.ImportFrom, mod: Module) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.name.split(".")
    if not mod.is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _walk(tree: ast.AST):
    """(node, inside a function body) for every node, breadth-first as ast.walk: the one pass over
    the tree that every field of a Module is read in."""
    function = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    queue = collections.deque([(tree, False)])
    while queue:
        node, flag = queue.popleft()
        yield node, flag
        child_flag = flag or isinstance(node, function)
        queue.extend((child, child_flag) for child in ast.iter_child_nodes(node))


def _bind(node: ast.AST, names: Set[str]) -> None:
    """The names a module binds itself (def, class, assignment, anywhere in it), not by importing."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name):
                    names.add(n.id)


@functools.lru_cache(maxsize=None)
def modules() -> Dict[str, Module]:
    mods = {}
    for path in _files():
        mods[_name(path)] = Module(_name(path), path, path.endswith("__init__.py"))
    project = set(mods)
    for mod in mods.values():
        tree = ast.parse(open(mod.path).read(), mod.path)
        attributes = []                            # `alias.name` uses, read once the aliases are known
        for node, inside in _walk(tree):
            top = not inside
            _bind(node, mod.defined)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                attributes.append(node)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in project or a.name.split(".")[0] in PACKAGES:
                        mod.imports.append(Import(a.name, [], node.lineno, top))
                        if a.asname and a.name in project:
                            mod.module_aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(node, mod)
                if src.split(".")[0] not in PACKAGES:
                    continue
                plain = []
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    if sub in project:             # `from pkg import module`
                        mod.imports.append(Import(sub, [], node.lineno, top))
                        mod.module_aliases[a.asname or a.name] = sub
                    else:
                        plain.append(a.name)
                        if top:
                            mod.imported[a.asname or a.name] = src
                if plain:
                    mod.imports.append(Import(src, plain, node.lineno, top))
        for node in attributes:
            if node.value.id in mod.module_aliases:
                mod.attribute_uses.append((mod.module_aliases[node.value.id], node.attr, node.lineno))
    return mods


def layer_of(module: str, layers: List[Tuple[int, List[str]]]) -> Optional[int]:
    """The layer whose most specific prefix (a module path or a package folder) names `module`."""
    best, best_len = None, -1
    path = module.replace(".", "/")
    for number, prefixes in layers:
        for p in prefixes:
            stem = p[:-3] if p.endswith(".py") else p.rstrip("/")
            named = path == stem or path + "/__init__" == stem or path.startswith(stem + "/")
            if named and len(stem) > best_len:
                best, best_len = number, len(stem)
    return best


def find_cycle(edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle as [a, b, ..., a], or None."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None
    for n in sorted(edges):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None
