"""The package's shape: no import cycle, the engine never imports the tools nor the memory tier (only the
entry points' dispatch does), no function over 80 lines.

Read from the source with ``ast`` (imports inside functions count too: a lazy import is still a
dependency), so the checks hold for code that no test happens to import.
"""

from __future__ import annotations

import ast
import os

import pytest

import pipeload

ROOT = os.path.dirname(pipeload.__file__)
MAX_LINES = 80


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package's modules ``name`` imports (a name imported from a package counts when it is a module)."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if m == "pipeload":  # the top package re-exports the API; importing it is importing a name
                continue
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_engine_never_imports_the_tools():
    graph = _graph()
    bad = {n: sorted(m for m in deps if m.startswith("pipeload.tools"))
           for n, deps in graph.items() if not n.startswith("pipeload.tools") and n != "pipeload.__main__"}
    assert not {n: d for n, d in bad.items() if d}


FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")


def _external_imports(path: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
    return found


def test_only_the_integrations_import_the_trainers():
    """pipeload works without Lightning, Accelerate or transformers: only the modules under
    ``pipeload.integrations`` import them, and nothing imports those modules (the user does, by name);
    ``pipeload.integrations`` itself imports none of its plug-ins."""
    bad = {name: sorted(_external_imports(path) & set(FRAMEWORKS)) for name, path in _modules().items()
           if not name.startswith("pipeload.integrations.")}
    assert not {n: f for n, f in bad.items() if f}
    graph = _graph()
    users = {n: sorted(m for m in deps if m.startswith("pipeload.integrations"))
             for n, deps in graph.items() if not n.startswith("pipeload.integrations")}
    assert not {n: d for n, d in users.items() if d}
    assert not {m for m in graph["pipeload.integrations"] if m.startswith("pipeload.integrations.")}


def test_only_the_dispatch_imports_the_tier():
    """The memory tier is reached from ``pipeload.save`` / ``pipeload.load`` by an isinstance check of the
    location, never from inside the engine, the planner or the saver's phases."""
    allowed = {"pipeload", "pipeload.save.api", "pipeload.engine.loader"}
    graph = _graph()
    bad = {n: sorted(m for m in deps if m == "pipeload.tier" or m.startswith("pipeload.tier."))
           for n, deps in graph.items()
           if not n.startswith(("pipeload.tier", "pipeload.tools")) and n not in allowed}
    assert not {n: d for n, d in bad.items() if d}


def test_no_function_over_80_lines():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, "\n".join(long)


@pytest.mark.parametrize("graph", [{"a": {"b"}, "b": {"c"}, "c": {"a"}}, {"a": {"a2"}, "a2": {"a"}}])
def test_the_cycle_check_finds_cycles(graph):
    assert _cycle(graph) is not None
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_device_layer_names_an_accelerator_api():
    """``torch.cuda`` (and any accelerator's own module) is asked for only through ``pipeload.device``,
    so that every accelerator with streams and events takes the same paths."""
    named = []
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith((".py", ".pyx")):
                path = os.path.join(dirpath, f)
                if "torch.cuda" in open(path).read():
                    named.append(os.path.relpath(path, ROOT))
    assert set(named) <= {"device.py"}, named
