"""The package read as text (``ast``), for the layout and docs tests: its modules, what each imports,
the import graph and its cycles. Shares no code with faircast_ds: it reads the files, it imports nothing."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "faircast_ds"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The absolute names one import statement imports (``from a import b``: ``a.b`` and ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:  # relative: resolved against this module's package
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        return [origin] + [f"{origin}.{alias.name}" for alias in node.names]
    return []


def import_graph(*, function_level: bool) -> dict[str, set[str]]:
    """faircast_ds module -> the faircast_ds modules it imports (a module's own parent packages left out:
    they are loaded before it). ``function_level``: imports inside functions count too."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        edges = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in (ast.walk(tree) if function_level else tree.body):
            targets = imported(node, name, path.name == "__init__.py")
            if isinstance(node, ast.ImportFrom):  # ``from pkg import sub``: the submodule; ``from m import x``: m
                origin, names = targets[0], targets[1:]
                targets = [t for t in names if t in known] + ([origin] if any(t not in known for t in names) else [])
            edges.update(t for t in targets if t in known and t != name and not name.startswith(t + "."))
        graph[name] = edges
    return graph


def lazy_table(path: Path) -> dict[str, str]:
    """A package's lazy ``_LAZY`` table: public name -> the module it is loaded from on first use."""
    import re

    table = re.search(r"_LAZY = \{(.*?)\}", path.read_text(), re.S)
    return dict(re.findall(r'"(\w+)":\s*"([\w.]+)"', table.group(1))) if table else {}


def lazy_targets(path: Path) -> set[str]:
    """The modules a package's lazy table names (loaded on first use: an import all the same)."""
    return set(lazy_table(path).values())


def folder_of(module: str) -> str:
    """The top-level folder a module lives in (``faircast_ds.casting.rules`` -> ``cast``); the package's own
    ``__init__`` is ``(root)``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "(root)"


def folder_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """folder -> the other folders its modules import."""
    edges: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            if folder_of(a) != folder_of(b):
                edges.setdefault(folder_of(a), set()).add(folder_of(b))
    return edges


def cycles_in(graph: dict[str, set[str]]) -> list[str]:
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack
                              else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return cycles
