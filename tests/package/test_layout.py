"""The package's seams, checked on its source (no import, no network).

The rules of docs/architecture.md that a reader relies on and a refactor can
silently break: a module reaches another only through public names; torch's
private state is touched in one module; the native extension is imported in one
module; environment variables are read in one module; imports sit at the top
of modules except where a comment-documented reason allows otherwise.
"""

import ast
import os

import pytest

from harness import REPO

PACKAGE = os.path.join(REPO, "torch_pccl")

# The one module allowed to use torch.distributed's private names.
TORCH_INTERNALS = "c10d/torch_internals.py"
# The one module that imports the compiled extension.
NATIVE_LOADER = "core/native.py"
# The one module that reads environment variables.
SETTINGS = "config.py"
# Modules whose function-level imports are deliberate: backend.py runs while torch
# imports (the native extension loads at the first group); the package's register()
# loads torch only when called (the master runs without torch); the master loads
# aiohttp only to serve its status page; _autoload.py (the layers' wiring) imports the
# elastic layer, which registers its group factory with c10d, at the first group;
# elastic/rendezvous.py imports the master only in the rank that hosts a fixed world's
# (~80 ms of a group's start on every other rank).
DEFERRED_IMPORTS = {"c10d/backend.py", "__init__.py", "master/server.py", "_autoload.py",
                    "elastic/rendezvous.py"}


def _modules():
    for folder, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, PACKAGE).replace(os.sep, "/")
                with open(path, encoding="utf-8") as f:
                    yield rel, ast.parse(f.read(), filename=path)


MODULES = dict(_modules())


def _own_private_names(tree):
    """Private names a module defines itself: its functions, classes, globals and attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _is_private(name):
    return name.startswith("_") and not name.startswith("__")


def test_the_package_is_found():
    # Guards the other tests against passing on an empty walk.
    assert {"config.py", "errors.py", "core/communicator.py", "c10d/process_group.py",
            "elastic/topology.py", "control/protocol.py", "algorithms/quantized.py"} <= set(MODULES)


@pytest.mark.parametrize("rel", sorted(MODULES))
def test_no_private_access_across_modules(rel):
    """``obj._name`` only on self/cls or on a name this module defines itself."""
    tree = MODULES[rel]
    own = _own_private_names(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in own or rel == TORCH_INTERNALS:
                continue
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _is_private(alias.name):
                    bad.append(f"line {node.lineno}: imports {alias.name} from {node.module}")
    assert not bad, f"{rel} reaches into other modules' private names: {bad}"


def test_torch_private_state_is_touched_in_one_module():
    users = set()
    for rel, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and \
                    node.attr in ("_world", "_get_default_group", "_get_backend"):
                users.add(rel)
    assert users == {TORCH_INTERNALS}


def test_the_native_extension_is_imported_in_one_module():
    users = set()
    for rel, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and \
                    node.module.split(".")[-1] == "_pccl_native":
                users.add(rel)
            elif isinstance(node, ast.Import) and any(
                    a.name.endswith("_pccl_native") for a in node.names):
                users.add(rel)
    assert users == {NATIVE_LOADER}


def test_environment_variables_are_read_in_config_only():
    readers = set()
    for rel, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
                readers.add(rel)
    assert readers == {SETTINGS}


def test_every_environment_variable_read_is_a_listed_setting():
    """config.py reads the environment in ``_raw`` alone, every ``_raw`` call names a
    module-level ``Setting``, and every such ``Setting`` is in ``config.SETTINGS`` (the
    README's table): a variable cannot be read without being documented."""
    from torch_pccl import config

    tree = MODULES[SETTINGS]
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    raw = next(f for f in functions if f.name == "_raw")
    inside_raw = {id(n) for n in ast.walk(raw)}
    stray = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb")
             and id(node) not in inside_raw]
    assert not stray, f"config.py reads the environment outside _raw at lines {stray}"
    settings = {node.targets[0].id for node in tree.body
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "Setting"}
    assert {getattr(config, name) for name in settings} == set(config.SETTINGS)
    for f in functions:
        for node in ast.walk(f):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_raw":
                arg = node.args[0]
                assert isinstance(arg, ast.Name) and (arg.id in settings or arg.id == "setting"), \
                    f"_raw called with {ast.dump(arg)} at line {node.lineno}"


def _module_name(rel):
    """``c10d/backend.py`` -> ``c10d.backend``; a package's ``__init__.py`` -> its name."""
    name = rel[:-3].replace("/", ".")
    return "" if name == "__init__" else name.removesuffix(".__init__")


def _imports(rel, tree, names):
    """The torch_pccl modules ``rel`` imports anywhere (functions included), by name:
    ``from .. import config`` is an import of ``config``, not of the package."""
    me = _module_name(rel)
    package = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "torch_pccl":
                base = node.module.partition(".")[2]
            else:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                out.add(sub if sub in names else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch_pccl":
                    out.add(alias.name.partition(".")[2])
    return {m for m in out if m in names and m != me}


def test_no_import_cycle_among_the_modules():
    """Lower layers never import upper ones, not even inside a function: the import graph
    of torch_pccl's modules (deferred imports counted) has no cycle."""
    names = {_module_name(rel) for rel in MODULES}
    graph = {_module_name(rel): _imports(rel, tree, names) for rel, tree in MODULES.items()}
    done, path = set(), []

    def visit(node):
        if node in path:
            cycle = path[path.index(node):] + [node]
            raise AssertionError("import cycle: " + " -> ".join(m or "torch_pccl"
                                                                for m in cycle))
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


@pytest.mark.parametrize("rel", sorted(MODULES))
def test_imports_at_the_top(rel):
    if rel in DEFERRED_IMPORTS:
        return
    inner = []
    for node in ast.walk(MODULES[rel]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    inner.append(f"line {sub.lineno} in {node.name}()")
    assert not inner, f"{rel} imports inside functions: {inner}"


MAX_MODULE_LINES = 600


@pytest.mark.parametrize("rel", sorted(MODULES))
def test_no_module_is_over_600_lines(rel):
    """One concern per module, each small enough to read in one sitting (STYLE.md): a module
    that grows past this is split by concern before the next concern goes in."""
    with open(os.path.join(PACKAGE, rel), encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    assert lines <= MAX_MODULE_LINES, f"{rel} has {lines} lines"


def test_c10d_holds_no_elastic_object():
    """c10d sits below the elastic layer and keeps nothing of it: no membership, not even in a
    docstring; the elastic layer keeps its own map from a group to its membership
    (elastic/groups.py)."""
    mentions = []
    for rel in MODULES:
        if rel.startswith("c10d/"):
            with open(os.path.join(PACKAGE, rel), encoding="utf-8") as f:
                mentions += [f"{rel}:{i}" for i, line in enumerate(f, 1)
                             if "membership" in line.lower()]
    assert not mentions, mentions
