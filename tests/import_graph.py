"""The import graph of our own packages, read from the source (no module is imported)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "tooling")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported module, line, deferred) for each import of one of ``known``: deferred when
    it is inside a function or an ``if TYPE_CHECKING:`` block."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, int, bool]] = []

    def visit(node, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = True
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, inner) for a in child.names if a.name in known)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for alias in child.names:
                    full = f"{child.module}.{alias.name}"
                    target = full if full in known else child.module
                    if target in known:
                        found.append((target, child.lineno, inner))
            visit(child, inner)

    visit(tree, False)
    # A lazy export table (a module-level __getattr__ that imports the modules it names):
    # each module named by a string in it is imported too, when first used.
    lazy = any(
        (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")
        or (isinstance(n, ast.Assign) and "__getattr__" in ast.unparse(n.targets[0]))
        for n in tree.body
    )
    if lazy:
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in known:
                found.append((node.value, node.lineno, True))
    return found


def graph(include_deferred: bool = True) -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, _, deferred in imports_of(path, known):
            if target != name and (include_deferred or not deferred):
                edges[name].add(target)
                # Importing a.b.c runs a/__init__ and a/b/__init__ first.
                parts = target.split(".")
                for i in range(1, len(parts)):
                    parent = ".".join(parts[:i])
                    if parent in known and parent != name and not name.startswith(parent + "."):
                        edges[name].add(parent)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in edges:
        if v not in index:
            strongconnect(v)
    return result
