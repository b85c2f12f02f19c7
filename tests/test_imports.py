"""polytrain's modules import each other without a circle: every import, at module level or inside a function,
is an edge from the importing module to the polytrain module it names, and to the packages above it (whose
``__init__`` runs first); a cycle among them fails the test."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """{module: the polytrain modules it imports}, from the source of every module under ``root``."""
    modules = {_module_name(p, root): p for p in (root / "polytrain").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def with_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with what an import runs first: importing a.b.c runs a.b's ``__init__``, so an edge to each
    package above a target, but for the importer's own packages (already being imported when it runs)."""
    out = {}
    for name, targets in graph.items():
        own = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)} | {name}
        out[name] = targets | {parent for target in targets for parent in _parents(target)
                               if parent in graph and parent not in own}
    return out


def _parents(module: str) -> list[str]:
    """The packages above ``module``: a.b.c -> [a.b, a]."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_of_polytrain_imports_itself_through_others():
    graph = with_packages(import_graph())
    assert len(graph) > 80
    assert cycles(graph) == []


def test_the_check_finds_a_cycle(tmp_path):
    package = tmp_path / "polytrain"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from polytrain.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (package / "c.py").write_text("import polytrain.a\n")
    assert cycles(import_graph(tmp_path)) == [["polytrain.a", "polytrain.c", "polytrain.sub.b"]]


#: what train/ may import of strategies/: the protocol (the Strategy class and its capabilities' types, the step's
#: recipe and result, the traits), the registry and each strategy's settings; never a strategy itself
PROTOCOL_MODULES = {"polytrain.strategies", "polytrain.strategies.base", "polytrain.strategies.step",
                    "polytrain.strategies.traits", "polytrain.strategies.registry", "polytrain.strategies.settings"}


def crossings(graph: dict[str, set[str]]) -> list[str]:
    """The imports between train/ and strategies/ that are not through the protocol: train/ importing a module of
    strategies/ outside :data:`PROTOCOL_MODULES`, and any import from strategies/ into train/."""
    def under(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            if under(module, "polytrain.train") and under(target, "polytrain.strategies") and \
                    target not in PROTOCOL_MODULES:
                found.append(f"{module} -> {target}")
            if under(module, "polytrain.strategies") and under(target, "polytrain.train"):
                found.append(f"{module} -> {target}")
    return found


def test_train_and_the_strategies_meet_only_through_the_protocol():
    assert crossings(import_graph()) == []


def test_the_check_finds_a_crossing(tmp_path):
    package = tmp_path / "polytrain"
    for sub in ("train", "strategies"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "strategies" / "base.py").write_text("")
    (package / "strategies" / "sync.py").write_text("def f():\n    from polytrain.train import loop\n")
    (package / "train" / "loop.py").write_text("from polytrain.strategies import base, sync\n")
    assert crossings(import_graph(tmp_path)) == ["polytrain.strategies.sync -> polytrain.train.loop",
                                                 "polytrain.train.loop -> polytrain.strategies.sync"]
