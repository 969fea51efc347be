"""The prose cannot drift from the code: every file, function and module the docs name exists, and
every command they show parses.

Scanned: README.md, docs/*.md, and the docstrings (module, class, function) of every Python file
of the project. In them:

    path.py, dir/path.py, page.md, dir/page.md          exists (relative to the page, to a folder
                                                        above it, or to the root; a bare name
                                                        anywhere in the repository, nearest first)
    configs/x.yaml, benchmarks/results/x.json           exists, when its first folder is one of
                                                        the repository's (a name like
                                                        index/rank-R.json is what a run writes)
    path.py:function                                    `function` (or class) is defined in it
    minipar.x.y, models.llama.Name                      imports, and the attributes exist
    `Class.method` (inside backticks)                   when Class is a class of minipar/ or
                                                        models/ (found with ast), method is defined
                                                        on it or on a base class

And every .py file under minipar/ and models/ is in docs/README.md's reading order (by its full
path) and in docs/design.md's tree (by its name, in the entry of its package folder; see
_missing_from_index for the exact rule).

And every command of the code blocks of README.md and docs/*.md:

    make target                                         the Makefile has the target
    [torchrun --nproc-per-node N] train.py ARGS         the config and overrides load and the
                                                        layout fits N processes: run_setup's
                                                        every check, up to (not into) minipar.init
    python -m module ARGS / python script.py ARGS       exists, has an argparse command line that
                                                        accepts the options shown (minipar.mesh,
                                                        which needs no world, is run)

And every claim that the default suite runs something ("default suite", "default selection", "run
in `make test`") names, in its clause, a test (`test_name`, `test_name[id]`) that the default
selection (-m "not slow") collects: the test exists, is not slow-marked, nor is the case named.

A name that the project cites but does not hold (a file of another repository, say) must be
written with that repository in front (picotron/..., torch/...): EXTERNAL lists the prefixes.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import glob
import importlib
import io
import os
import re
import shlex

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY_DIRS = ("minipar", "models", "benchmarks", "tests")
# paths that name files of other projects, written with their project in front
EXTERNAL = ("torch/", "picotron/", "nanotron/", "torchtitan/", "megatron/", "Megatron-LM/", "transformers/",
            "accelerate/", "axolotl/", "shksprdata/", "ring-flash-attention/", "flash-attention/")
PATH_RE = re.compile(r"(?<![\w/.-])((?:\.\./|\./)?[\w.-]*(?:/[\w.-]+)*\.(?:py|md|yaml|json))"
                     r"(?::(\w+))?(?![\w/])")
MODULE_RE = re.compile(r"(?<![\w./])((?:minipar|models)(?:\.[A-Za-z_]\w*)+)")   # not output_dir/minipar.lock


def _python_files():
    files = [os.path.join(ROOT, "train.py")]
    for d in PY_DIRS:
        files += glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)
    # this file's own docstring shows the patterns with placeholder names
    return sorted(f for f in files if os.path.abspath(f) != os.path.abspath(__file__))


def _docstrings(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def _pages():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


@functools.lru_cache(maxsize=None)
def _texts():
    """(where, text) for every page and every docstring."""
    out = [(page, open(page).read()) for page in _pages()]
    for path in _python_files():
        out += [(path, doc) for doc in _docstrings(path)]
    return tuple(out)


_ALL_FILES = None


def _repo_files():
    global _ALL_FILES
    if _ALL_FILES is None:
        _ALL_FILES = []
        for base, dirs, files in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("out", "__pycache__")]
            _ALL_FILES += [os.path.join(base, f) for f in files]
    return _ALL_FILES


def _resolve(ref, where):
    """The file `ref` names, seen from the file `where`, or None."""
    here = os.path.dirname(where)
    above, d = [], here
    while d.startswith(ROOT):                             # the page's folder, then each one above it
        above.append(d)
        d = os.path.dirname(d)
    # ...and the package root: docstrings write trainer/data/batches.py for minipar/trainer/data/batches.py
    candidates = [os.path.join(a, ref) for a in above] + [os.path.join(ROOT, "minipar", ref)]
    if "/" not in ref:                                    # a bare name: the nearest one of that name
        near = [f for f in _repo_files() if os.path.basename(f) == ref]
        near.sort(key=lambda f: (not f.startswith(here + os.sep), len(f)))
        candidates += near
    return next((os.path.normpath(c) for c in candidates if os.path.isfile(c)), None)


def _defined(path):
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _rel(path):
    return os.path.relpath(path, ROOT)


def test_named_files_and_functions_exist():
    missing = []
    for where, text in _texts():
        for ref, func in PATH_RE.findall(text):
            if ref.startswith(EXTERNAL) or ref.startswith(("http", "www.")) or "://" in ref:
                continue
            if ref.startswith(("out/", "/")) or "<" in ref:    # what a run writes; a template
                continue
            if ref.endswith((".yaml", ".json")):
                first = ref.split("/")[0]
                if "/" not in ref or not (first == ".." or os.path.isdir(os.path.join(ROOT, first))):
                    continue                                  # a file name, not a path of this repository
            target = _resolve(ref, where)
            if target is None:
                missing.append(f"{_rel(where)}: {ref} does not exist")
            elif func and target.endswith(".py") and func not in _defined(target):
                missing.append(f"{_rel(where)}: {ref}:{func}: no {func} in {_rel(target)}")
    assert not missing, "\n".join(sorted(set(missing)))


def _import_chain(dotted):
    """Import the longest module prefix of `dotted`, then follow the rest as attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        base = os.path.join(ROOT, *parts[:i])
        if os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py")):
            obj = importlib.import_module(name)
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj
    raise ModuleNotFoundError(dotted)


def test_named_modules_and_attributes_exist():
    missing = []
    for where, text in _texts():
        for dotted in set(MODULE_RE.findall(text)):
            dotted = dotted.rstrip(".")
            if dotted.endswith((".py", ".md", ".yaml")):       # a path written with dots: checked above
                continue
            try:
                _import_chain(dotted)
            except (ImportError, AttributeError) as err:
                missing.append(f"{_rel(where)}: {dotted}: {type(err).__name__}: {err}")
    assert not missing, "\n".join(sorted(set(missing)))


COPIED_RE = re.compile(r"<!-- the tables below are copied from (benchmarks/results/[\w./-]+\.md)")


def test_copied_tables_match_their_results_files():
    """A page that shows a benchmark's tables (marked by the comment above them) shows the rows of
    the results file that the benchmark last wrote, unchanged."""
    stale = []
    for page in _pages():
        text = open(page).read()
        for ref in COPIED_RE.findall(text):
            rows = [line for line in open(os.path.join(ROOT, ref)).read().splitlines()
                    if line.startswith("|")]
            assert rows, f"{ref} holds no table"
            stale += [f"{_rel(page)}: row not in {ref}'s tables: {line}"
                      for line in text.splitlines() if line.startswith("| ") and "---" not in line
                      and text.index(line) > text.index(ref) and line not in rows]
            stale += [f"{_rel(page)} lacks a row of {ref}: {row}" for row in rows if row not in text]
    assert not stale, "\n".join(stale)


RESULTS_REF_RE = re.compile(r"benchmarks/results/([\w./-]+\.md)")
FIGURE_RE = re.compile(r"(?<![\w.])(\d+\.\d{2,})(?:-(\d+\.\d{2,}))?(?![\w.])")


def test_quoted_figures_are_in_their_results_files():
    """A section (heading to heading) that names a benchmark's results file quotes only figures that
    file holds: every number with two or more decimals (a ratio, a bubble, MiB), and every range
    (0.39-0.74) as the file writes it, so a rerun that changes them shows which prose to update."""
    stale = []
    for page in _pages():
        for section in re.split(r"\n(?=#+ )", open(page).read()):
            refs = [os.path.join(ROOT, "benchmarks", "results", r)
                    for r in set(RESULTS_REF_RE.findall(section))]
            source = "".join(open(r).read() for r in refs if os.path.isfile(r))
            if not source:
                continue
            stale += [f"{_rel(page)}, {section.splitlines()[0][:50]!r}: "
                      f"{'-'.join(x for x in m if x)} is not in "
                      f"{', '.join(_rel(r) for r in refs)}" for m in FIGURE_RE.findall(section)
                      if "-".join(x for x in m if x) not in source]
    assert not stale, "\n".join(stale)


# ------------------------------------------------------------------------------------- commands
COMMAND_START = re.compile(r"^(?:\$ )?(?:\S*/)?(?:python3?|torchrun|make) ")


def _code_lines(text):
    """Lines of fenced (```) and indented (4 spaces, after a blank line) code blocks."""
    lines, out, fenced, indented = text.splitlines(), [], False, False
    for i, line in enumerate(lines):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            out.append(line.strip())
            continue
        if line.startswith("    ") and (indented or i == 0 or not lines[i - 1].strip()):
            indented = True
            out.append(line.strip())
        elif line.strip():
            indented = False
    return out


def _commands():
    found = []
    for page in _pages():
        lines, joined = _code_lines(open(page).read()), []
        for line in lines:                                   # a trailing backslash continues the line
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1].rstrip() + " " + line
            else:
                joined.append(line)
        for line in joined:
            line = line.split("  #")[0].split(" # ")[0].strip()
            if COMMAND_START.match(line):
                found.append((_rel(page), line))
    return found


def _makefile_targets():
    return set(re.findall(r"^([\w-]+):", open(os.path.join(ROOT, "Makefile")).read(), re.M))


class _Stop(Exception):
    pass


def _check_train(args, world, monkeypatch, page=None, line="", out_dir=None):
    """run_setup.setup_run on these arguments, for `world` processes, stopped at minipar.init (its
    output_dir, which step 7 creates and locks, moved to `out_dir`: never the checkout's out/). A
    command that reads what an earlier command of its page writes under out/ (an example dataset,
    say) is checked up to its keys and their types (the files do not exist yet), and the page must
    show the command that writes them before it."""
    import minipar
    from minipar.trainer.run_setup import setup_run
    config = {}
    if args and not args[0].startswith("--"):
        with open(os.path.join(ROOT, args[0])) as f:
            config = yaml.safe_load(f) or {}
    refs = [a for a in args if "out/" in a] + [v for k, v in config.items() if k not in WRITTEN_KEYS
                                               for v in _strings(v) if "out/" in v]
    outputs = sorted({"/".join(a.split("out/", 1)[1].split("/")[:1]) for a in refs})
    if outputs:
        earlier = [l for p, l in _commands() if p == page]
        earlier = earlier[:earlier.index(line)]
        for out in outputs:
            assert any(f"out/{out}" in e for e in earlier), \
                f"{line}: nothing before it on {page} writes out/{out}"
        from minipar.trainer.config.train_config import parse_overrides, validate_keys
        overrides = args[1:] if args and not args[0].startswith("--") else args
        validate_keys(config, parse_overrides(overrides))      # unknown keys and wrong types raise
        return
    seen = {}

    def fake_init(config, *a, **k):
        seen["config"] = config
        raise _Stop

    monkeypatch.setattr(minipar, "init", fake_init)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for var in [v for v in os.environ if v.startswith("PARALLELISM_CONFIG_")]:
        monkeypatch.delenv(var)
    if args and not args[0].startswith("--"):
        args = [os.path.join(ROOT, args[0])] + args[1:]
    if out_dir is not None:                       # the last --output_dir wins
        args = list(args) + ["--output_dir", str(out_dir)]
    with pytest.raises(_Stop):
        setup_run(args)
    assert seen["config"].total_size == world


WRITTEN_KEYS = ("output_dir", "metrics_file")    # what a run writes, not what it reads


def _strings(value):
    """Every string inside a loaded YAML value (mappings and lists walked)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _argparse_options(path):
    """The option strings a script's argparse parser accepts, read from its source (importing a
    benchmark would pull in everything it compares against)."""
    tree = ast.parse(open(path).read())
    has_parser = any(isinstance(n, ast.Attribute) and n.attr == "ArgumentParser" for n in ast.walk(tree))
    options = {"-h", "--help"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "add_argument":
            options |= {a.value for a in node.args
                        if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return has_parser, options


def _check_python(argv):
    """`python -m X ...` or `python script.py ...`: the file exists, has an argparse command line
    (so it answers --help) that accepts every option shown; minipar.mesh, which needs no world
    and no files, is also run with the arguments shown."""
    if argv[0] == "-m":
        target, args = argv[1], argv[2:]
        base = os.path.join(ROOT, *target.split("."))
        path = base + ".py" if os.path.isfile(base + ".py") else os.path.join(base, "__main__.py")
    else:
        target, args = argv[0], argv[1:]
        path = os.path.join(ROOT, target)
    assert os.path.isfile(path), f"{target}: no such script or module in the repository"
    has_parser, options = _argparse_options(path)
    runs = re.search(r"^from (\w+) import main\b", open(path).read(), re.M)
    # a package's __main__ running a sibling's main()
    if not has_parser and path.endswith("__main__.py") and runs:
        has_parser, options = _argparse_options(os.path.join(os.path.dirname(path), runs.group(1) + ".py"))
    assert has_parser, f"{target} has no argparse command line"
    unknown = [a.split("=")[0] for a in args if a.startswith("-") and a.split("=")[0] not in options]
    assert not unknown, f"{target} does not accept {unknown} (it accepts {sorted(options)})"
    if target == "minipar.mesh":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            importlib.import_module("minipar.mesh").main(args)
        assert "groups" in out.getvalue()


@pytest.mark.parametrize("page,line", _commands(), ids=lambda v: v if len(str(v)) < 60 else str(v)[:60])
def test_commands_in_code_blocks_parse(page, line, monkeypatch, tmp_path):
    argv = shlex.split(line.replace("$ ", "", 1))
    argv = [a for a in argv if not re.match(r"^\w+=", a)] if argv[0] != "make" else argv   # VAR=1 prefixes
    prog = os.path.basename(argv[0])
    if prog == "make":
        assert set(a for a in argv[1:] if "=" not in a) <= _makefile_targets(), line
        return
    world, nodes = 1, 1
    if prog == "torchrun":
        rest = argv[1:]
        while rest and rest[0].startswith("--"):
            opt, _, value = rest[0].partition("=")
            if opt in ("--nproc-per-node", "--nproc_per_node"):
                world = int(value or rest[1])
            if opt == "--nnodes":
                nodes = int(value or rest[1])
            rest = rest[1:] if value or opt in ("--standalone",) else rest[2:]
        argv = rest
    elif prog.startswith("python"):
        argv = argv[1:]
    world *= nodes                    # torchrun --nnodes N: the world spans N launchers
    if argv[0] == "train.py":
        return _check_train(argv[1:], world, monkeypatch, page, line, out_dir=tmp_path / "out")
    assert world == 1, f"{line}: only train.py is launched with torchrun here"
    _check_python(argv)


def test_the_scanner_sees_what_it_must():
    """The patterns find the forms the pages use, and a stale name does not resolve."""
    text = "see [x](../minipar/comm.py), minipar/optim.py:clip_grad_norm_ and zero3.py; NOWHERE.md"
    assert PATH_RE.findall(text) == [("../minipar/comm.py", ""),
                                     ("minipar/optim.py", "clip_grad_norm_"),
                                     ("zero3.py", ""), ("NOWHERE.md", "")]
    page = os.path.join(ROOT, "docs", "x.md")
    assert _resolve("../minipar/comm.py", page) and _resolve("trainer/data/batches.py", page)
    assert _resolve("zero3.py", page) is None and _resolve("NOWHERE.md", page) is None
    assert "clip_grad_norm_" in _defined(_resolve("minipar/optim.py", page))
    assert MODULE_RE.findall("call minipar.optim.build_optimizer.") \
        == ["minipar.optim.build_optimizer"]


def test_commands_are_found():
    """The scan above sees the README's quick start (a regression in the block parser would
    otherwise pass silently)."""
    lines = [line for page, line in _commands() if page == "README.md"]
    assert any(line.startswith("make train") for line in lines)
    assert any("torchrun" in line and "train.py" in line for line in lines)


# ------------------------------------------------------------------------- Class.method references
CODE_SPAN_RE = re.compile(r"`([^`\n]+)`")
CLASS_METHOD_RE = re.compile(r"(?<![\w.])([A-Z]\w*)\.([A-Za-z_]\w*)")
PROJECT_DIRS = ("minipar", "models")


def _project_files():
    return sorted(glob.glob(os.path.join(ROOT, "minipar", "**", "*.py"), recursive=True)
                  + glob.glob(os.path.join(ROOT, "models", "**", "*.py"), recursive=True))


@functools.lru_cache(maxsize=None)
def _project_classes():
    """{class name: [(module, names defined on it, base names)]} for every class under minipar/ and
    models/. Names: the class body's functions, classes and assignments, and the `self.x = ...` of
    its methods (an instance attribute is a name a reader can call up too)."""
    classes = {}
    for path in _project_files():
        module = _rel(path)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        for node in ast.walk(ast.parse(open(path).read())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                    names |= {t.attr for t in targets if isinstance(t, ast.Attribute)
                              and isinstance(t.value, ast.Name) and t.value.id == "self"}
            bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
                     for b in node.bases]
            classes.setdefault(node.name, []).append((module, names, bases))
    return classes


def _has_member(cls, member, seen=()):
    """`member` is defined on some project class named `cls`, or on one of its bases: a project
    base through its source, a base from elsewhere (nn.Module) through the imported class."""
    for module, names, bases in _project_classes().get(cls, ()):
        if member in names:
            return True
        for base in bases:
            if base in _project_classes() and base not in seen:
                if _has_member(base, member, seen + (cls,)):
                    return True
            elif base is not None:
                with contextlib.suppress(ImportError, AttributeError):
                    if hasattr(getattr(importlib.import_module(module), cls), member):
                        return True
    return False


def _bad_class_members(texts):
    """['where: `Class.member`: ...'] for every Class.member written inside backticks whose Class
    is a class of minipar/ or models/ and on which (or on whose bases) member is not defined.
    A Class that the project does not define (torch's Tensor.chunk) is not checked."""
    bad = []
    for where, text in texts:
        for span in CODE_SPAN_RE.findall(text):
            for cls, member in CLASS_METHOD_RE.findall(span):
                if cls in _project_classes() and not _has_member(cls, member):
                    modules = ", ".join(m for m, _, _ in _project_classes()[cls])
                    bad.append(f"{_rel(where)}: `{cls}.{member}`: {cls} ({modules}) defines no {member}")
    return bad


def test_named_class_members_exist():
    bad = _bad_class_members(_texts())
    assert not bad, "\n".join(sorted(set(bad)))


def test_class_member_check_can_fail():
    page = os.path.join(ROOT, "docs", "x.md")
    text = ("`GradSync.sync_gradients()` `GradSync.no_sync()` (a base class's) `LlamaModel.run_layers` "
            "`LlamaForCausalLM.parameters` (nn.Module's) `Tensor.chunk` (not ours) "
            "`Zero3.grads` (self.grads)")
    bad = _bad_class_members([(page, text)])
    assert [b.split(": ", 1)[1].split(":")[0] for b in bad] == ["`GradSync.sync_gradients`"]


# ------------------------------------------------------------ every file in the reading order and tree
def _tree_entries(design_text):
    """{left column: its text} of the indented block under '## The tree' in design.md: an entry
    starts at a line whose text begins after 4 spaces (`    minipar/zero3/   flat_param.py ...`) and
    runs over the more deeply indented lines that follow it."""
    section = design_text.split("\n## The tree", 1)[1].split("\n## ", 1)[0]
    entries, key = {}, None
    for line in section.splitlines():
        if line.startswith("    ") and not line.startswith("     "):
            key, _, rest = line.strip().partition("  ")
            entries[key] = rest.strip()
        elif key is not None and line.startswith("     "):
            entries[key] += " " + line.strip()
        elif line.strip():
            key = None
    return entries


def _missing_from_index(files, reading_order, design_text):
    """The files of `files` (repository-relative) that docs/README.md or design.md's tree leaves out.

    The rule: docs/README.md (the reading order) names each file by its full repository path
    (`minipar/trainer/checkpoint/atomic.py`, `models/__init__.py`); design.md's tree has an entry
    whose left column is the file's package folder (`minipar/trainer/checkpoint/`, `models/`) and
    whose text names the file (`atomic.py`), every file but a package's __init__.py, which the
    entry itself stands for (minipar/__init__.py, holding init(), is named all the same)."""
    entries, missing = _tree_entries(design_text), []
    for rel in files:
        if not re.search(rf"(?<![\w/.]){re.escape(rel)}(?![\w/])", reading_order):
            missing.append(f"docs/README.md: {rel} is not in the reading order")
        folder, name = os.path.dirname(rel) + "/", os.path.basename(rel)
        if name == "__init__.py" and folder != "minipar/":
            continue
        text = entries.get(folder)
        if text is None:
            missing.append(f"docs/design.md: the tree has no entry {folder} (for {rel})")
        elif not re.search(rf"(?<![\w/.]){re.escape(name)}(?![\w/])", text):
            missing.append(f"docs/design.md: the tree's entry {folder} does not name {name}")
    return missing


def test_every_file_is_in_the_reading_order_and_the_tree():
    files = [_rel(f) for f in _project_files()]
    docs = os.path.join(ROOT, "docs")
    missing = _missing_from_index(files, open(os.path.join(docs, "README.md")).read(),
                                  open(os.path.join(docs, "design.md")).read())
    assert not missing, "\n".join(missing)


def test_file_index_check_can_fail():
    design = ("\n## The tree\n\n    minipar/zero3/      flat_param.py (buffers),\n"
              "                        unit.py\n    models/   llama.py\n\n"
              "## Next\n    minipar/zero3/  shard_manager.py\n")
    assert _tree_entries(design) == {"minipar/zero3/": "flat_param.py (buffers), unit.py",
                                     "models/": "llama.py"}
    order = ("`minipar/zero3/flat_param.py`, `minipar/zero3/unit.py`, models/llama.py, "
             "xminipar/zero3/shard_manager.py")
    files = ["minipar/zero3/flat_param.py", "minipar/zero3/unit.py", "minipar/zero3/shard_manager.py",
             "models/llama.py", "models/rope.py", "minipar/plan/model.py", "minipar/zero3/__init__.py"]
    assert _missing_from_index(files, order, design) == [
        "docs/README.md: minipar/zero3/shard_manager.py is not in the reading order",
        "docs/design.md: the tree's entry minipar/zero3/ does not name shard_manager.py",
        "docs/README.md: models/rope.py is not in the reading order",
        "docs/design.md: the tree's entry models/ does not name rope.py",
        "docs/README.md: minipar/plan/model.py is not in the reading order",
        "docs/design.md: the tree has no entry minipar/plan/ (for minipar/plan/model.py)",
        "docs/README.md: minipar/zero3/__init__.py is not in the reading order"]


# ------------------------------------------------------------------ what the default suite is said to run
SUITE_CLAIM_RE = re.compile(r"default (?:suite|selection)|\bruns? in `make test`", re.I)
TEST_REF_RE = re.compile(r"`(?:(?:tests/)?(test_\w+)\.py::)?(test_\w+)(?:\[([^\]`]+)\])?`")


def _clause(text, start, end):
    """The clause around text[start:end], outside backticks: from the previous ';', '. ', blank line
    or unclosed '(' to the next ';', '. ', blank line or unopened ')'."""
    def edge(i, step, opens, closes):
        depth, code = 0, False
        while 0 <= i < len(text):
            c = text[i]
            if c == "`":
                code = not code
            elif not code:
                if c == opens:
                    depth += 1
                elif c == closes:
                    if depth == 0:
                        return i
                    depth -= 1
                elif c == ";" or text.startswith("\n\n", i) or (
                        c == "." and (i + 1 == len(text) or text[i + 1].isspace())):
                    return i
            i += step
        return i
    return text[edge(start - 1, -1, ")", "(") + 1:edge(end, 1, "(", ")")]


def _param_ids(mark):
    """[(id, slow)] of one parametrize mark, as pytest names them: pytest.param's id, the ids list,
    else the values joined by '-' (str, int, float, bool; anything else: argname + index)."""
    names, values = mark.args[0], mark.args[1]
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    ids, out = mark.kwargs.get("ids"), []
    for j, v in enumerate(values):
        is_set = type(v).__name__ == "ParameterSet"
        vals = v.values if is_set else (v if len(names) > 1 else (v,))
        slow = is_set and any(m.name == "slow" for m in v.marks)
        vid = v.id if is_set else None
        if vid is None and isinstance(ids, (list, tuple)):
            vid = ids[j]
        if vid is None:
            parts = [ids(x) if callable(ids) else None for x in vals]
            vid = "-".join(p if p is not None else str(x) if isinstance(x, (str, int, float, bool))
                           else f"{n}{j}" for p, x, n in zip(parts, vals, names))
        out.append((vid, slow))
    return out


def _default_ids(module, name):
    """The ids of `name`'s cases in tests/<module>.py that the default selection (-m "not slow")
    collects ([""] for a test without parameters); None when the module defines no such test."""
    mod = importlib.import_module(module)
    func = getattr(mod, name, None)
    if func is None or not callable(func):
        return None
    marks = list(getattr(func, "pytestmark", [])) + list(getattr(mod, "pytestmark", []))
    if any(m.name == "slow" for m in marks):
        return []
    cases = [("", False)]
    for mark in reversed([m for m in marks if m.name == "parametrize"]):   # the decorator nearest first
        cases = [(f"{a}-{b}" if a else b, s or t) for a, s in cases for b, t in _param_ids(mark)]
    return [i for i, slow in cases if not slow]


def _suite_claim_problems(texts):
    """['where: ...'] for every claim that the default suite runs something ("default suite",
    "default selection", "run in `make test`") whose clause (_clause) names no test in backticks
    (`test_x`, `test_x[id]`, `test_file.py::test_x[id]`), or names one the default selection does
    not collect: absent, slow-marked, or (with [id]) that case absent or slow."""
    tests = sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(ROOT, "tests", "test_*.py")))
    bad = []
    for where, text in texts:
        for claim in SUITE_CLAIM_RE.finditer(text):
            clause = _clause(text, claim.start(), claim.end())
            refs = TEST_REF_RE.findall(clause)
            said = f"{_rel(where)}: {' '.join(clause.split())[:80]!r}"
            if not refs:
                bad.append(f"{said}: names no test (write `test_name` or `test_name[id]` in the clause)")
            for module, name, case in refs:
                where_defined = [module] if module else [m for m in tests if re.search(
                    rf"^def {name}\(", open(os.path.join(ROOT, "tests", m + ".py")).read(), re.M)]
                found = [ids for ids in (_default_ids(m, name) for m in where_defined) if ids is not None]
                if not found:
                    bad.append(f"{said}: no test {name} in tests/{module or 'test_*'}.py")
                elif not any((case in ids) if case else ids for ids in found):
                    bad.append(f"{said}: {name}{f'[{case}]' if case else ''} is not in the default "
                               f"selection (slow-marked, or no such case)")
    return bad


def test_what_the_default_suite_is_said_to_run_it_collects():
    bad = _suite_claim_problems(_texts())
    assert not bad, "\n".join(sorted(set(bad)))


def test_suite_claim_check_can_fail():
    page = os.path.join(ROOT, "docs", "x.md")
    text = ("every schedule on pp 2 (default suite: "
            "`test_each_schedule_on_pp2_matches_single_process[afab]`) and for 20 steps. ZB-V in the "
            "default suite, twice. The fp64 proof runs in the default suite "
            "(`test_zero_bubble_gradients_equal_1f1b_exactly_and_send_its_bytes[zbv-4-4]`); "
            "`test_docs.py::test_suite_claim_check_can_fail` runs in `make test`; the default selection "
            "runs `test_twenty_steps_match_single_process`, `test_nowhere_at_all`.")
    bad = [b.split(": ", 2)[2] for b in _suite_claim_problems([(page, text)])]
    assert bad == ["names no test (write `test_name` or `test_name[id]` in the clause)",
                   "test_zero_bubble_gradients_equal_1f1b_exactly_and_send_its_bytes[zbv-4-4] is not in the "
                   "default selection (slow-marked, or no such case)",
                   "test_twenty_steps_match_single_process is not in the default selection (slow-marked, "
                   "or no such case)",
                   "no test test_nowhere_at_all in tests/test_*.py"], bad
    ids = functools.partial(_default_ids, "test_pipeline")
    assert ids("test_zero_bubble_biases_and_lora_equal_1f1b_in_fp64") == ["bias", "lora"]
    assert ids("test_pp_layouts_match_single_process_fast") == ["pp4-1f1b", "pp2-tp2-sp",
                                                                "pp2-tp2-sp-async-zb_h1"]
    assert ids("test_zero_bubble_gradients_equal_1f1b_exactly_and_send_its_bytes") == [
        "zb_h1-2-2", "zbv-2-4", "zb_h1-3-3", "zbv-3-3"]
    assert ids("test_twenty_steps_match_single_process") == [] and ids("test_no_such_test") is None


# ------------------------------------------ the reading path: compose.py first, techniques in <= 4 files
PLUMBING = {"minipar.mesh", "minipar.comm", "minipar.comm_calls", "minipar.comm_ledger", "minipar.config",
            "minipar.graph_boundary"}


def _reach(graph, entry):
    """Every project module `entry` imports, directly or through others, not going through the plumbing."""
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in PLUMBING:
            todo += [i.target for i in graph[name].imports if i.target in graph]
    return seen - PLUMBING


def _module(path):
    name = path[:-3].replace("/", ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _technique_rows():
    text = open(os.path.join(ROOT, "docs", "README.md")).read().replace("\nThe model they plug into", "\n#")
    section = text.split("### Follow one technique top to bottom", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| ([^|`]+?) \| `([^`]+)` \| ([^|]+) \| (\d+) \|$", section, re.M)
    assert len(rows) >= 7, "docs/README.md: the table of files per technique is missing rows"
    return [(t, e, re.findall(r"`([^`]+)`", files), int(n)) for t, e, files, n in rows]


def test_each_technique_reads_top_to_bottom_in_the_files_listed():
    """docs/README.md's files per technique are exactly what the entry point reaches in the import
    graph (so the list cannot drift from the code), and at most four."""
    from tests.import_graph import modules
    graph = modules()
    for technique, entry, files, count in _technique_rows():
        reached = _reach(graph, _module(entry))
        assert {_module(f) for f in files} == reached, (technique, sorted(reached))
        assert count == len(files), technique
        assert count <= 4, (technique, count)


def test_compose_is_the_first_file_of_the_reading_order():
    text = open(os.path.join(ROOT, "docs", "README.md")).read()
    assert re.findall(r"`([\w/]+\.py)`", text)[0] == "minipar/compose.py"


def test_the_path_of_one_size_is_the_code():
    """docs/README.md's stops of tensor_parallel_size, from the YAML to the collective: each stop's
    code is in its file; each step to another file is a call down an import (or through a
    package's __init__) or a return to a file already on the path; the stated counts are the table's."""
    from tests.import_graph import modules
    graph = modules()
    text = open(os.path.join(ROOT, "docs", "README.md")).read()
    section = text.split("### One size from the YAML to the collective", 1)[1].split("\n#", 1)[0]
    stops = re.findall(r"^\| (\d+) \| `([^`]+)` \| `(.+?)` \| [^|]+ \|$", section, re.M)
    assert [int(n) for n, _, _ in stops] == list(range(1, len(stops) + 1)) and len(stops) >= 10
    for _, path, code in stops:
        assert code in open(os.path.join(ROOT, path)).read(), (path, code)
    edges = {(name, i.target) for name, m in graph.items() for i in m.imports}
    packages = {name for name, m in graph.items() if m.is_package}

    def calls(a, b):
        return (a, b) in edges or any((a, p) in edges and (p, b) in edges for p in packages)
    returns, seen = 0, [stops[0][1]]
    for (_, a, _), (_, b, _) in zip(stops, stops[1:]):
        if a == b:
            continue
        if b in seen:
            returns += 1
        else:
            assert calls(_module(a), _module(b)), f"{a} -> {b}: no import between them"
        seen.append(b)
    files = set(seen)
    claim = rf"\b{len(stops)} stops in {len(files)} files, {returns} of them returns\."
    assert re.search(claim, section), (len(stops), len(files), returns)
