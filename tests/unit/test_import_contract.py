"""The import contract: which parts of lmserve may import which, written once here and checked over
the source of every module (its `import` statements parsed with `ast`, those inside functions and
under TYPE_CHECKING included: a deferred import is still a dependency).

- Rooms that must not reach into others (NEVER) and rooms that may reach only a few (ONLY).
- No import cycle anywhere among lmserve's modules.

Module-level imports are what the rules see: `from lmserve.model.native import build` depends on
lmserve.model.native.build, and on the packages above it only through their __init__ files.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _package_roots() -> dict[str, str]:
    """setup.py's ROOTS (import package -> folder: the mapping the wheel is built with), read without
    running setup()."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["ROOTS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ROOTS")


ROOTS = _package_roots()

# (modules under this name, what they must never import: lmserve modules or third-party packages, why)
NEVER = [
    ("lmserve.model", ("lmserve.server", "lmserve.client", "grpc"),
     "the model loads and runs without the server or the network"),
    ("lmserve.client", ("lmserve.model", "lmserve.server", "torch", "numpy"),
     "`pip install lmserve` is the client alone (grpcio and protobuf, no torch)"),
    ("lmserve.server.engine", ("grpc", "lmserve.server.http", "lmserve.server.service", "lmserve.server.app"),
     "the engine is called by the gRPC and HTTP edges and knows neither"),
    ("lmserve.model.native", ("lmserve.model.tuning", "lmserve.model.checkpoints", "lmserve.model.loader"),
     "the native library and step are built without the choices measured on them"),
    ("lmserve.model.attention", ("lmserve.model.tuning", "lmserve.model.checkpoints", "lmserve.model.loader",
                                 "lmserve.model.llama"),
     "attention serves the decoder; it never reaches up into it or its loading"),
    ("lmserve.model.linear", ("lmserve.model.tuning", "lmserve.model.checkpoints", "lmserve.model.loader",
                              "lmserve.model.llama", "lmserve.model.attention"),
     "the linear kernels serve the decoder; it never reaches up into it or its loading"),
]

# (modules under this name, the only lmserve modules they may import besides their own room's, why)
ONLY = [
    ("lmserve.model.errors", (), "the errors every room raises"),
    ("lmserve.model.config", ("lmserve.model.errors",), "the model config is read before anything is built"),
    ("lmserve.model.cache_dir", (), "where every room caches: a leaf"),
    ("lmserve.model.text", ("lmserve.model.errors",), "the tokenizer serves text alone (the client's token safety, tests)"),
    # a checkpoint carries its tokenizer (GGUF metadata) and its weights in block formats the kernels serve
    ("lmserve.model.checkpoints", ("lmserve.model.config", "lmserve.model.errors", "lmserve.model.text",
                                   "lmserve.model.linear.formats", "lmserve.model.native.build"),
     "reading a checkpoint needs its config, its tokenizer, its weights' block formats and the native "
     "dequantizer where the library is loaded, nothing that serves"),
]


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _imports(name: str) -> set[str]:
    """Every module `name` imports: lmserve modules by their full name, others by their top package."""
    path = MODULES[name]
    package = name if _is_package(name) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in MODULES else base)
    return {m if m.startswith("lmserve") else m.split(".")[0] for m in out}


IMPORTS = {name: _imports(name) for name in MODULES}


def _graph() -> dict[str, set[str]]:
    """lmserve module -> the lmserve modules its import runs: each imported module and the packages
    above it that are not already above the importer (their __init__ runs first)."""
    graph = {}
    for name, deps in IMPORTS.items():
        edges = set()
        for dep in deps:
            if dep not in MODULES:
                continue
            parts = dep.split(".")
            for i in range(1, len(parts) + 1):
                above = ".".join(parts[:i])
                if above in MODULES and not _under(name, above) and above != name:
                    edges.add(above)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _room(name: str, rooms: list[str]) -> str | None:
    return next((r for r in rooms if _under(name, r)), None)


@pytest.mark.parametrize("who, banned, why", NEVER, ids=[r[0] for r in NEVER])
def test_never(who, banned, why):
    broken = sorted(f"{name} imports {dep}" for name, deps in IMPORTS.items() if _under(name, who)
                    for dep in deps if any(_under(dep, b) for b in banned))
    assert not broken, f"{who} must not import {', '.join(banned)} ({why}):\n" + "\n".join(broken)


@pytest.mark.parametrize("who, allowed, why", ONLY, ids=[r[0] for r in ONLY])
def test_only(who, allowed, why):
    broken = sorted(f"{name} imports {dep}" for name, deps in IMPORTS.items() if _under(name, who)
                    for dep in deps if dep.startswith("lmserve") and dep in MODULES
                    and not any(_under(dep, a) for a in (who, *allowed)) and not _under(who, dep))
    assert not broken, f"{who} may import only {', '.join(allowed) or 'nothing of lmserve'} ({why}):\n" + "\n".join(broken)


def test_rules_name_real_modules():
    """A rule about a room that no longer exists (renamed, moved) would pass without checking anything."""
    named = [who for who, *_ in NEVER + ONLY] + [m for _, banned, _ in NEVER for m in banned if m.startswith("lmserve")]
    named += [m for _, allowed, _ in ONLY for m in allowed]
    missing = sorted({n for n in named if not any(_under(m, n) for m in MODULES)})
    assert not missing, f"the contract names modules that do not exist: {missing}"


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "modules importing each other in a loop:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_loop():
    """The checker itself: a loop through three modules is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_relative_imports_resolve_to_modules():
    """Every relative import names an lmserve module or package (a moved file's stale import fails here)."""
    stale = sorted(f"{name} imports {dep}" for name, deps in IMPORTS.items() for dep in deps
                   if dep.startswith("lmserve") and dep not in MODULES)
    assert not stale, "\n".join(stale)
