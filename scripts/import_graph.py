"""The import graph of the product packages, read with `ast` (nothing is imported).

    python -m scripts.import_graph                 # this checkout
    python -m scripts.import_graph --root PATH     # another checkout (main, for a before/after)

Prints each import cycle between modules and each import from `controlplane` into `workers`,
then one summary line; exits 1 if there is any. Every import counts, function-level ones
included: an import hidden in a function is still an arrow between the two modules (the automatic
fallback is reached through such imports).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

PACKAGES = ("exitplane", "controlplane", "runtime", "workers", "dashboards")


def modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` under `root`."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imported_names(module: str, path: Path, tree: ast.AST) -> Iterator[str]:
    """Every dotted name an import statement of the module may refer to."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..y import z`
                anchor = package[: len(package) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            # `from package import submodule` imports the submodule
            yield from (f"{base}.{alias.name}" for alias in node.names)


def graph(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the product modules it imports (the longest known prefix of each name)."""
    known = modules(root, packages)
    edges: dict[str, set[str]] = {name: set() for name in known}
    for module, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name in _imported_names(module, path, tree):
            while name and name not in known:
                name = name.rpartition(".")[0]
            # a package's own parents are imported with it; they are not a dependency
            if name and name != module and not module.startswith(name + "."):
                edges[module].add(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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
    return sorted(found)


def upward(edges: dict[str, set[str]], source: str = "controlplane",
           target: str = "workers") -> list[tuple[str, str]]:
    """Imports from the `source` package into the `target` package."""
    def inside(name: str, package: str) -> bool:
        return name == package or name.startswith(package + ".")

    return sorted((module, imported) for module, imported_set in edges.items()
                  for imported in imported_set
                  if inside(module, source) and inside(imported, target))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(),
                        help="the checkout to read (default: the current directory)")
    args = parser.parse_args(argv)
    edges = graph(args.root)
    if not edges:
        print(f"no product package under {args.root}", file=sys.stderr)
        return 2
    found = cycles(edges)
    crossing = upward(edges)
    for component in found:
        print("cycle:", " , ".join(component))
    for module, imported in crossing:
        print(f"controlplane imports workers: {module} -> {imported}")
    print(f"modules={len(edges)} imports={sum(map(len, edges.values()))} "
          f"cycles={len(found)} controlplane_to_workers={len(crossing)}")
    return 1 if found or crossing else 0


if __name__ == "__main__":
    sys.exit(main())
