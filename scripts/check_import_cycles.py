"""Fails on any import cycle in a package: between modules, and between its subpackages (issue 22).

import-linter's layers contract (`.importlinter`) forbids imports that go up the layers, but two modules or two
packages in the same layer may still import each other; this finds those. The graph is grimp's (the library
import-linter builds on), so imports inside functions count: a lazy import still ties the two modules together.

    python scripts/check_import_cycles.py            # arl
    python scripts/check_import_cycles.py mypkg      # any importable package

Each cycle is printed as a strongly connected component, with one loop through it spelled out; exit 1 if any.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import grimp

Graph = dict[str, set[str]]


def module_graph(package: str) -> Graph:
    """Module -> the modules of `package` it imports (anywhere in its body, functions included)."""
    g = grimp.build_graph(package, include_external_packages=False, cache_dir=None)
    return {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}


def package_of(module: str, package: str) -> str:
    """The unit a module belongs to one level below `package`: `arl.controller.shell` -> `arl.controller`;
    `arl.cli` (a module directly in the package) is its own unit; the package's own `__init__` is `package`."""
    parts = module.split(".")
    depth = len(package.split("."))
    return ".".join(parts[:depth + 1])


def package_graph(modules: Graph, package: str) -> Graph:
    """The module graph collapsed onto `package`'s direct children (imports inside one child dropped)."""
    out: Graph = defaultdict(set)
    for m, targets in modules.items():
        a = package_of(m, package)
        out[a]
        for t in targets:
            b = package_of(t, package)
            if a != b:
                out[a].add(b)
    return dict(out)


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one node, or a node importing itself (Tarjan,
    iterative so a deep graph cannot hit the recursion limit); each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return sorted(found)


def loop_through(graph: Graph, component: list[str]) -> list[str]:
    """One closed path inside `component`, from its first node back to it (breadth-first: a shortest one)."""
    members = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for t in sorted(graph.get(node, ())):
                if t not in members:
                    continue
                if t == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, start]
                if t not in parent:
                    parent[t] = node
                    nxt_frontier.append(t)
        frontier = nxt_frontier
    return component  # unreachable for a real component


def report(package: str) -> list[str]:
    """One line per cycle (packages first, then modules); empty when there is none."""
    modules = module_graph(package)
    lines = []
    for kind, graph in (("package", package_graph(modules, package)), ("module", modules)):
        for component in cycles(graph):
            lines.append(f"{kind} cycle ({len(component)}): {' -> '.join(loop_through(graph, component))}"
                         + (f"  [all: {', '.join(component)}]" if len(component) > 2 else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("package", nargs="?", default="arl")
    args = p.parse_args(argv)
    lines = report(args.package)
    for line in lines:
        print(line)
    if lines:
        print(f"[import cycles] {len(lines)} cycle(s) in {args.package}", file=sys.stderr)
        return 1
    print(f"[import cycles] none in {args.package}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
