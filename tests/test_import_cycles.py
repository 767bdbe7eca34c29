"""No import cycle among the repository's source files (centroidkv/, eval/, baselines/, scripts/,
hydra_plugins/), counting imports inside functions too: the layers import downwards only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("centroidkv", "eval", "baselines", "scripts", "hydra_plugins")


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the source folders (a package by its name)."""
    files = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The repository modules `name` (at `path`) imports anywhere in the file. `from a import b`
    counts `a.b` when that is a module, else `a`; a package's own parents are not counted (Python
    imports them first for every submodule)."""

    def owner(dotted: str) -> str | None:  # the repository module that defines `dotted`
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(owner(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` folders up
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in known else owner(base))
    return {module for module in found if module and module != name}


def import_graph(root: Path) -> dict[str, set[str]]:
    known = module_files(root)
    return {name: imported_modules(path, name, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_source_files_import_without_a_cycle():
    graph = import_graph(ROOT)
    assert {"centroidkv.cache.cache", "eval.runner", "baselines.snapkv"} <= set(graph)
    assert "centroidkv.cache.cache" in graph["centroidkv.plan.decoding"]  # the graph sees real imports
    assert cycles(graph) == []


def test_the_library_imports_no_benchmark_harness_or_script():
    graph = import_graph(ROOT)
    upward = {
        (name, imported)
        for name, imports in graph.items()
        if name.split(".")[0] == "centroidkv"
        for imported in imports
        if imported.split(".")[0] in ("eval", "baselines", "scripts")
    }
    assert upward == set()


def test_a_cycle_is_found(tmp_path):
    """Two files importing each other, one of them inside a function, are reported."""
    package = tmp_path / "centroidkv"
    package.mkdir()
    for folder in SOURCE_FOLDERS[1:]:
        (tmp_path / folder).mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from centroidkv.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from centroidkv import a\n    return a\n")
    (package / "c.py").write_text("import centroidkv.a\n")
    assert cycles(import_graph(tmp_path)) == [["centroidkv.a", "centroidkv.b"]]
