"""kvtier's planes depend one way: no import cycles, and no plane imports one above it.

Read from the source with `ast`, so nothing is imported: every module-level import of a kvtier
module is an edge, those under TYPE_CHECKING too (a type named across two modules ties them as
much as a call does); imports inside functions, which load lazily, are not. A package's own
`__init__` is not an edge of its submodules: Python runs it first whatever a submodule imports.
`policies/` and `cli/` sit at the top of the repository and are installed as `kvtier.policies`
and `kvtier.cli` (links in the source tree): they are read where they are.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Every plane above the shared leaves (the modules `kvtier/*.py`: errors, keys, config...).
ABOVE_SHARED = {"ipc", "tiers", "transfer", "store", "daemon", "client", "replay",
                "integrations", "testing", "cli"}
# plane -> planes it must not import at module level. From the bottom: the shared leaves, the
# policies (which know keys and nothing else) and the pools (an engine pool's geometry and how
# its pages are read and written); tiers and transfer move and keep bytes, the store places
# pages over them, the daemon serves the store, the client speaks to the daemon over ipc and
# shares nothing else with it. Test support and the command line stand above everything (test
# support runs a daemon and hands out a client connected to it), the package's own facade
# (`kvtier`, lazy re-exports of the public API) above what it re-exports.
FORBIDDEN = {
    "shared": ABOVE_SHARED,
    "policies": ABOVE_SHARED | {"pools"},
    "pools": ABOVE_SHARED | {"policies"},
    "ipc": ABOVE_SHARED - {"ipc"} | {"pools", "policies"},
    "tiers": ABOVE_SHARED - {"tiers", "ipc"},
    "transfer": ABOVE_SHARED - {"transfer", "ipc"},
    "store": {"daemon", "client", "replay", "integrations", "testing", "cli"},
    "replay": {"daemon", "client", "integrations", "testing", "cli"},
    "client": {"tiers", "transfer", "store", "daemon", "replay", "testing", "cli"},
    "daemon": {"client", "replay", "integrations", "testing", "cli"},
    "integrations": {"tiers", "transfer", "store", "daemon", "replay", "testing", "cli"},
    "testing": {"cli"},
    "cli": {"testing"},
    "kvtier": {"daemon", "replay", "integrations", "testing", "cli"},
}
# Edges allowed across a plane's rule: none (kvtier.testing, which stands on both sides by
# design, is a plane that may import client and daemon alike).
ALLOWED: set[tuple[str, str]] = set()


def module_files() -> dict[str, Path]:
    """Module name -> source file, the linked packages (`kvtier/policies` -> `policies/`) read
    where they are: a walk of `kvtier/` does not follow links."""
    roots = [(REPO / "kvtier", ["kvtier"])]
    roots += [(link.resolve(), ["kvtier", link.name])
              for link in sorted((REPO / "kvtier").iterdir())
              if link.is_symlink() and link.is_dir()]
    files = {}
    for root, prefix in roots:
        for path in sorted(root.rglob("*.py")):
            parts = prefix + list(path.relative_to(root).with_suffix("").parts)
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


def plane_of(module: str) -> str:
    """A subpackage is a plane, the modules `kvtier/*.py` are the shared one, `kvtier` its own."""
    parts = module.split(".")
    if len(parts) == 1:
        return "kvtier"
    return parts[1] if (REPO / "kvtier" / parts[1]).is_dir() else "shared"


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
        if plane_of(target) in FORBIDDEN.get(plane_of(module), set())
        and not any(module == allowed and (target == into or target.startswith(into + "."))
                    for allowed, into in ALLOWED))
    assert wrong == []


def test_every_plane_is_checked() -> None:
    planes = {plane_of(module) for module in import_graph()}
    assert planes - set(FORBIDDEN) == {"cuda"}  # kernels shipped as data: nothing to import


def test_the_graph_sees_the_imports_it_checks() -> None:
    graph = import_graph()
    assert "kvtier.store.page_store" in graph["kvtier.daemon.service"]
    assert "kvtier.errors" in graph["kvtier.tiers.disk"]
    assert "kvtier.policies.base" in graph["kvtier.policies.lru"]
    assert "kvtier.daemon.settings" in graph["kvtier.cli.serve"]
    assert plane_of("kvtier.config") == "shared" and plane_of("kvtier.policies.lru") == "policies"


def test_the_client_loads_without_the_daemon() -> None:
    """What an engine imports to talk to the daemon loads none of the daemon's code."""
    script = ("import sys, kvtier.client; "
              "print(sorted(m for m in sys.modules if m.startswith('kvtier.daemon')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
