"""The package's shape, held by tests: no import cycle among the engine's modules, and no file reaching into the
private attributes (`_name`) that another duplexd file defines: parts talk through their public interfaces."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "engine": "duplexd.engine",
    "kernels": "duplexd.kernels",
    "server": "duplexd.server",
    "clients": "duplexd.clients",
    "duplexd": "duplexd",
}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            out[name] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """duplexd modules that `name` imports (any `import` statement, relative or absolute)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in known else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_no_import_cycle_among_the_engine_modules():
    modules = {n: p for n, p in _modules().items() if n.startswith("duplexd.engine")}
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert "duplexd.engine.scheduler" in graph["duplexd.engine.engine"]  # the graph is really built
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def _private_definitions(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _foreign_private_uses(trees: dict[Path, ast.AST]) -> list[str]:
    defined = {path: _private_definitions(tree) for path, tree in trees.items()}
    everywhere = set().union(*defined.values())
    offences = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in everywhere):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in defined[path]:
                offences.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    return offences


def test_rule_sees_a_private_reach_across_files(tmp_path):
    a = ast.parse("class Engine:\n    def __init__(self):\n        self._ended = []\n")
    b = ast.parse("def end(session):\n    session.engine._ended.append(session)\n")
    assert _foreign_private_uses({ROOT / "a.py": a, ROOT / "b.py": b}) == ["b.py:2 session.engine._ended"]


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_no_private_attribute_of_another_file_is_touched(folder):
    trees = {path: ast.parse(path.read_text()) for path in _modules().values()}
    offences = [o for o in _foreign_private_uses(trees) if o.startswith(f"{folder}/")]
    assert not offences, "\n".join(offences)


def _duplexd_imports(prefix: str) -> dict[str, set[str]]:
    """The duplexd modules each module under `prefix` imports (lazy imports inside functions included)."""
    modules = _modules()
    return {
        name: _imports(name, path, set(modules))
        for name, path in modules.items()
        if name == prefix or name.startswith(f"{prefix}.")
    }


def test_clients_talk_to_the_server_over_the_wire_only():
    graph = _duplexd_imports("duplexd.clients")
    assert "duplexd.clients.connection" in graph["duplexd.clients.kyutai"]  # the graph is really built
    offences = [
        f"{name} imports {dep}"
        for name, deps in sorted(graph.items())
        for dep in sorted(deps)
        if dep.startswith(("duplexd.server", "duplexd.engine"))
    ]
    assert not offences, "\n".join(offences)


def test_the_wire_format_imports_nothing_of_duplexd():
    assert _duplexd_imports("duplexd.wire")["duplexd.wire"] == set()
