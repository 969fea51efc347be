"""Imports run one way: the layer order of docs/design.md, no cycle, project imports at the top of
each file, and every name imported from the file that defines it (no re-export shims).

The graph is read with ast (tests/import_graph.py), so a violation anywhere fails here, not only in
the code paths other tests happen to run."""
from __future__ import annotations

import os
import re

import pytest

from tests.import_graph import ROOT, find_cycle, layer_of, modules

# Project imports that must stay inside a function, and why. Everything else goes at the top.
LAZY = {
    ("minipar", "minipar.mesh"): "`python -m minipar.mesh` imports the package first; runpy warns "
                                 "when the module it is about to run is already imported",
}


def design_layers():
    """[(layer, [path prefixes])] from the block under '## Imports run one way' in docs/design.md."""
    text = open(os.path.join(ROOT, "docs", "design.md")).read()
    section = text.split("## Imports run one way", 1)[1].split("\n## ", 1)[0]
    layers = [(int(m.group(1)), m.group(2).split())
              for m in re.finditer(r"^\s+layer (\d+)\s+(.+)$", section, re.M)]
    assert layers, "docs/design.md: no 'layer N  paths...' lines under '## Imports run one way'"
    return layers


@pytest.fixture(scope="module")
def graph():
    return modules()


def test_design_md_places_every_module(graph):
    layers = design_layers()
    unplaced = sorted(m for m in graph if layer_of(m, layers) is None)
    assert not unplaced, f"modules in no layer of docs/design.md: {unplaced}"


def test_imports_only_point_down_the_layers(graph):
    layers = design_layers()
    wrong = []
    for mod in graph.values():
        mine = layer_of(mod.name, layers)
        for imp in mod.imports:
            theirs = layer_of(imp.target, layers)
            if theirs is not None and mine is not None and theirs > mine:
                wrong.append(f"{mod.name} (layer {mine}) imports {imp.target} (layer {theirs}), "
                             f"line {imp.line}")
    assert not wrong, "imports against the layer order of docs/design.md:\n" + "\n".join(wrong)


def test_no_import_cycle(graph):
    edges = {m.name: {i.target for i in m.imports if i.target in graph and i.target != m.name}
             for m in graph.values()}
    # a package's __init__ is imported by every import of its submodules: count that edge too
    for name in list(edges):
        parts = name.split(".")
        for k in range(1, len(parts)):
            parent = ".".join(parts[:k])
            if parent in graph:
                for src, targets in edges.items():
                    if name in targets and src != parent and not src.startswith(parent + "."):
                        targets.add(parent)
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_project_imports_sit_at_the_top(graph):
    lazy = []
    for mod in graph.values():
        if not mod.name.startswith(("minipar", "models", "train")):
            continue
        for imp in mod.imports:
            if not imp.top_level and (mod.name, imp.target) not in LAZY:
                lazy.append(f"{mod.path[len(ROOT) + 1:]}:{imp.line} imports {imp.target} inside a function")
    assert not lazy, "project imports inside functions (move them to the top):\n" + "\n".join(lazy)


def test_names_are_imported_from_the_file_that_defines_them(graph):
    """`from a.b import n` and `b.n` must find n defined in the file of a.b itself, not imported there from
    another file: a reader follows one hop. Packages (__init__.py) may export their public names."""
    hops = []
    for mod in graph.values():
        uses = [(i.target, n, i.line) for i in mod.imports for n in i.names] + mod.attribute_uses
        for target, name, line in uses:
            src = graph.get(target)
            if src is None or src.is_package or name in src.defined or f"{target}.{name}" in graph:
                continue
            if name in src.imported:
                hops.append(f"{mod.path[len(ROOT) + 1:]}:{line} takes {name} from {target}, which imports "
                            f"it from {src.imported[name]}")
    assert not hops, "names imported through another module (import them from where they are defined):\n" \
        + "\n".join(sorted(hops))


def test_the_graph_reader_sees_what_it_should(graph):
    """The checks above are only as good as the reader: it must see a known top-level import, a
    known attribute use and a known definition."""
    compose = graph["minipar.compose"]
    assert any(i.target == "minipar.comm" and i.top_level for i in compose.imports)
    assert "Step" in compose.defined
    assert any(t == "minipar.comm" for t, _, _ in compose.attribute_uses)
    assert layer_of("minipar.zero3.unit", design_layers()) < layer_of("models.llama", design_layers())


TP_FREE = ("models.llama_layer", "models.moe")   # written for one process; tp applied from outside


def test_the_decoder_layer_knows_no_tensor_parallelism(graph):
    """models/llama_layer.py (and the MoE it builds) import nothing of minipar.tensor_parallel and read
    no `.tp`; minipar/compose.py applies TP by calling tensor_parallel's parallelize on the plain
    decoder (issue 38: the tp size's path does not cross the decoder's layer file). (The layer's
    context parallelism, window_attention.py, borrows mappings.py's all-gather Function for cp.)"""
    for name in TP_FREE:
        tp_imports = [i.target for i in graph[name].imports if i.target.startswith("minipar.tensor_parallel")]
        assert not tp_imports, (name, tp_imports)
        source = open(graph[name].path).read()
        assert not re.search(r"\.tp\b", source), f"{name} reads a tp group"
    compose = graph["minipar.compose"]
    assert compose.imported.get("parallelize") == "minipar.tensor_parallel.parallelize", compose.imported
    assert re.search(r"^\s+parallelize\(model, pgm\.tp,", open(compose.path).read(), re.M)
