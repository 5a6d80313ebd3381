"""The package's shape, held by tests: imports point one way (`server → engine → kernels`, and between the
engine's parts as `ENGINE_PARTS` allows), no import cycle among the engine's modules, and no file or class reaching
into the private attributes (`_name`) that another file or class defines: parts talk through their public
interfaces."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "duplexd"
FOLDERS = ("clients", "commands", "engine", "kernels", "server", "top")  # top: the modules directly in duplexd/


def _folder(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "top"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("duplexd", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
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
    assert "duplexd.engine.dialogue.scheduler" in graph["duplexd.engine.dialogue.engine"]  # the graph is really built
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


# The engine's parts and what each may import of duplexd besides itself. "shared" is the modules at the engine's
# root (errors, devices, mailbox, listeners). The two services (dialogue, transcription) do not import each other;
# models import nothing of the services, of persona or of weight loading.
ENGINE_PARTS: dict[str, set[str]] = {
    "shared": set(),
    "kv": {"shared", "kernels"},
    "models": {"shared", "kernels", "kv"},
    "weights": {"shared", "models"},
    "persona": {"shared", "models"},
    "stt": {"shared", "wire"},
    "dialogue": {"shared", "kernels", "kv", "models", "persona"},
    "transcription": {"shared", "models", "weights", "wire"},
    "tts": {"shared", "kernels", "kv", "models", "weights"},
    "voice": {"shared", "models", "weights"},
    "agent": {"tts", "shared"},  # the voice agent's LLM, and a reply said through a TTS stream (plain data)
}


def _part(module: str) -> str:
    """`duplexd.engine.models.lm` → models; `duplexd.engine.errors` → shared; `duplexd.kernels.rope` → kernels."""
    parts = module.split(".")
    if parts[:2] != ["duplexd", "engine"]:
        return parts[1] if len(parts) > 1 else parts[0]
    if len(parts) == 2 or not (PACKAGE / "engine" / parts[2]).is_dir():
        return "shared"
    return parts[2]


def _part_offences(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    return [
        f"{name} ({_part(name)}) imports {dep} ({_part(dep)})"
        for name, deps in sorted(graph.items())
        for dep in sorted(deps)
        if _part(dep) != _part(name) and _part(dep) not in allowed.get(_part(name), set())
    ]


def test_part_rule_sees_a_wrong_way_import():
    graph = {"duplexd.engine.models.lm": {"duplexd.engine.dialogue.engine", "duplexd.engine.kv.paged"}}
    assert _part_offences(graph, ENGINE_PARTS) == [
        "duplexd.engine.models.lm (models) imports duplexd.engine.dialogue.engine (dialogue)"
    ]


def test_every_engine_folder_is_a_part_with_a_rule():
    folders = {p.name for p in (PACKAGE / "engine").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ENGINE_PARTS) - {"shared"}


def test_the_engine_parts_import_one_way():
    graph = _duplexd_imports("duplexd.engine")
    assert "duplexd.engine.models.lm" in graph["duplexd.engine.dialogue.lm_gen"]  # the graph is really built
    offences = _part_offences(graph, ENGINE_PARTS)
    assert not offences, "\n".join(offences)


def test_kernels_import_nothing_above_them():
    graph = _duplexd_imports("duplexd.kernels")
    assert graph, "no kernels found"
    offences = [f"{n} imports {d}" for n, deps in sorted(graph.items()) for d in sorted(deps) if _part(d) != "kernels"]
    assert not offences, "\n".join(offences)


def test_the_engine_imports_nothing_of_the_server_or_clients():
    graph = _duplexd_imports("duplexd.engine")
    offences = [
        f"{n} imports {d}"
        for n, deps in sorted(graph.items())
        for d in sorted(deps)
        if d.startswith(("duplexd.server", "duplexd.clients", "duplexd.commands"))
    ]
    assert not offences, "\n".join(offences)


# The server's subpackages: the plumbing every protocol stands on, and the protocols (one folder each, named for whose
# API it speaks). Plumbing imports no protocol and protocols do not import each other; the modules directly in
# server/ (the app factory, `duplexd serve`'s command line, the operator's HTTP routes) assemble them and may import
# any. Within the plumbing, imports may cross folders but form no cycle.
SERVER_PLUMBING = {"core", "connection", "codec", "stt"}
SERVER_PROTOCOLS = {"kyutai", "realtime", "moshi_server", "openai_audio"}


def _server_part(module: str) -> str:
    """`duplexd.server.realtime.events` → realtime; `duplexd.server.app` → top."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else "top"


def _server_offences(graph: dict[str, set[str]]) -> list[str]:
    offences = []
    for name, deps in sorted(graph.items()):
        part = _server_part(name)
        for dep in sorted(d for d in deps if d.startswith("duplexd.server.")):
            other = _server_part(dep)
            if other == part or part == "top":
                continue
            if other == "top":
                offences.append(f"{name} ({part}) imports {dep}, which assembles the server")
            elif other in SERVER_PROTOCOLS:
                offences.append(f"{name} ({part}) imports {dep} (protocol {other})")
    return offences


def test_server_rule_sees_a_protocol_import():
    graph = {
        "duplexd.server.stt.stream": {"duplexd.server.moshi_server.asr_messages", "duplexd.server.core.context"},
        "duplexd.server.realtime.conversation": {"duplexd.server.kyutai.messages", "duplexd.server.realtime.events"},
        "duplexd.server.app": {"duplexd.server.kyutai.chat"},
    }
    assert _server_offences(graph) == [
        "duplexd.server.realtime.conversation (realtime) imports duplexd.server.kyutai.messages (protocol kyutai)",
        "duplexd.server.stt.stream (stt) imports duplexd.server.moshi_server.asr_messages (protocol moshi_server)",
    ]


def test_every_server_folder_is_plumbing_or_a_protocol():
    folders = {p.name for p in (PACKAGE / "server").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == SERVER_PLUMBING | SERVER_PROTOCOLS
    assert not SERVER_PLUMBING & SERVER_PROTOCOLS


def test_the_server_parts_import_one_way():
    graph = _duplexd_imports("duplexd.server")
    assert "duplexd.server.connection.pump" in graph["duplexd.server.kyutai.chat"]  # the graph is really built
    offences = _server_offences(graph)
    assert not offences, "\n".join(offences)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_only_the_serve_command_imports_the_server():
    """The commands run models in process (`infer`, `transcribe`, `capacity`) without FastAPI; the command line's
    `serve` (`duplexd.server.cli`, named in `commands.cli.COMMANDS`) is the one way in to the server (the command
    line itself imports only serve's `SettingsError`, to report it), and nothing but `__main__` imports a command."""
    from duplexd.commands.cli import COMMANDS

    graph = {n: d for n, d in _duplexd_imports("duplexd").items() if n.startswith("duplexd.commands")}
    assert "duplexd.commands.transcribe_stt" in graph["duplexd.commands.transcribe"]  # the graph is really built
    reported = ("duplexd.commands.cli", "duplexd.server.core.settings")
    offences = [
        f"{n} imports {d}"
        for n, deps in sorted(graph.items())
        for d in sorted(deps)
        if d.startswith("duplexd.server") and (n, d) != reported
    ]
    offences += [
        f"duplexd {name} runs {module}"
        for name, (module, _) in COMMANDS.items()
        if module.startswith("duplexd.server") and name != "serve"
    ]
    outside = _duplexd_imports("duplexd")
    offences += [
        f"{n} imports {d}"
        for n, deps in sorted(outside.items())
        for d in sorted(deps)
        if d.startswith("duplexd.commands") and not n.startswith("duplexd.commands") and n != "duplexd.__main__"
    ]
    assert not offences, "\n".join(offences)


def test_the_client_commands_import_no_model_code():
    """`duplexd chat` and `loadtest` are client processes, often many at once: their command line, parsed as the
    entry point parses it, imports no torch (2.5 s of CPU and ~300 MB a process) and nothing of the engine's models
    but their configs (`ConfigError`, which the command line reports)."""
    script = (
        "import sys\n"
        "from duplexd.commands.cli import main\n"
        "for command in ('chat', 'loadtest'):\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(' '.join(sorted(m for m in sys.modules if m == 'torch' or m.startswith('duplexd.engine.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: duplexd loadtest" in done.stdout  # both commands' arguments were really built
    loaded = done.stdout.splitlines()[-1].split()
    assert loaded == ["duplexd.engine.errors", "duplexd.engine.models", "duplexd.engine.models.config"]


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


def _class_privates(cls: ast.ClassDef) -> set[str]:
    """Private names a class defines: attributes it sets on self/cls, its methods and its annotated fields."""
    names = set()
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _other_class_reaches(tree: ast.AST) -> list[str]:
    """Within one file: a class reading a private name that another class of the file defines and it does not."""
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    owned = {c.name: _class_privates(c) for c in classes}
    offences = []
    for c in classes:
        others = set().union(*(v for k, v in owned.items() if k != c.name)) - owned[c.name]
        for node in ast.walk(c):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in others
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                offences.append(f"{node.lineno} {c.name}: {ast.unparse(node)}")
    return offences


def test_rule_sees_a_private_reach_across_classes():
    tree = ast.parse(
        "class Stream:\n    def __init__(self):\n        self._inbox = []\n"
        "class Service:\n    def busy(self, s):\n        return bool(s._inbox)\n"
    )
    assert _other_class_reaches(tree) == ["6 Service: s._inbox"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_class_touches_a_private_attribute_of_another_class(folder):
    offences = [
        f"{path.relative_to(ROOT)}:{o}"
        for path in _modules().values()
        if _folder(path) == folder
        for o in _other_class_reaches(ast.parse(path.read_text()))
    ]
    assert not offences, "\n".join(offences)


@functools.cache
def _every_foreign_private_use() -> tuple[str, ...]:
    """The whole tree's offences, found once for every folder's case."""
    return tuple(_foreign_private_uses({path: ast.parse(path.read_text()) for path in _modules().values()}))


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_private_attribute_of_another_file_is_touched(folder):
    offences = [o for o in _every_foreign_private_use() if _folder(ROOT / o.split(":")[0]) == folder]
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


def test_no_import_cycle_among_the_client_modules():
    """A connection's base class, its protocols and the factory choosing between them import one way."""
    graph = _duplexd_imports("duplexd.clients")
    assert "duplexd.clients.kyutai" in graph["duplexd.clients.protocols"]  # the graph is really built
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_wire_format_imports_nothing_of_duplexd():
    assert _duplexd_imports("duplexd.wire")["duplexd.wire"] == set()


def test_the_repository_root_holds_no_package_but_duplexd_and_tests():
    """`python -m pytest` puts the root on sys.path, so a folder there named like a PyPI package (`kernels`, which
    transformers imports) would shadow it: the parts live inside `duplexd/`."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages == {"duplexd", "tests"}
