"""kvtier's planes depend one way: no import cycles, and no plane imports one above it.

Read from the source with `ast`, so nothing is imported: every module-level import of a kvtier
module is an edge, those under TYPE_CHECKING too (a type named across two modules ties them as
much as a call does); imports inside functions, which load lazily, are not. A package's own `__init__` is not an edge of its submodules: Python runs it
first whatever a submodule imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# plane -> planes it must not import at module level. From the bottom: tiers and transfer move
# and keep bytes, the store places pages over them, the daemon serves the store, the client
# speaks to the daemon over ipc and shares nothing else with it.
FORBIDDEN = {
    "ipc": {"tiers", "transfer", "store", "daemon", "client", "replay", "integrations", "testing"},
    "tiers": {"transfer", "store", "daemon", "client", "replay", "integrations", "testing"},
    "transfer": {"tiers", "store", "daemon", "client", "replay", "integrations", "testing"},
    "store": {"daemon", "client", "replay", "integrations", "testing"},
    "replay": {"daemon", "client", "integrations", "testing"},
    "client": {"tiers", "transfer", "store", "daemon", "replay", "testing"},
    "daemon": {"client", "replay", "integrations", "testing"},
    "integrations": {"tiers", "transfer", "store", "daemon", "replay", "testing"},
}
# The one module allowed across: it runs `kvtier serve` as a child for tools and tests and
# hands out a client connected to it, so it stands on both sides by design.
ALLOWED = {("kvtier.daemon.child_process", "kvtier.client")}


def module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((REPO / "kvtier").rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def module_imports(path: Path, modules: set[str]) -> set[str]:
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    found.add(submodule if submodule in modules else node.module)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(node.orelse)

    visit(ast.parse(path.read_text()).body)
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    graph = {}
    for name, path in files.items():
        # a package's own __init__ runs before any of its submodules: not an edge of theirs
        parents = {name.rsplit(".", depth)[0] for depth in range(1, name.count(".") + 1)}
        graph[name] = module_imports(path, set(files)) - {name} - parents
    return graph


def plane_of(module: str) -> str | None:
    parts = module.split(".")
    is_package = (REPO / "kvtier" / parts[1]).is_dir() if len(parts) > 1 else False
    return parts[1] if is_package else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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


def test_no_module_imports_itself_back() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_plane_imports_a_plane_above_it() -> None:
    graph = import_graph()
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items() for target in targets
        if plane_of(target) in FORBIDDEN.get(plane_of(module) or "", set())
        and not any(module == allowed and (target == into or target.startswith(into + "."))
                    for allowed, into in ALLOWED))
    assert wrong == []


def test_the_graph_sees_the_imports_it_checks() -> None:
    graph = import_graph()
    assert "kvtier.store.page_store" in graph["kvtier.daemon.service"]
    assert "kvtier.errors" in graph["kvtier.tiers.disk"]
