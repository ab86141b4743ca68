"""The package's import graph has no cycle (imports inside functions included); the command line's options need no
torch: ``cli.py`` loads alone and imports torch at module level nowhere; the installed ``bench`` command uses the
public API (no ``flashoverlap.runtime`` or ``flashoverlap.comm``); and nothing in the package imports the benchmark
harness (``benchmarks/``, not installed)."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text. ``from a import b`` counts as importing
    ``a.b`` where that is a module, else ``a``; a submodule's implicit import of its parent packages is left out
    (every submodule has it; it is not a tie between two modules' code)."""
    files = {_module_name(path): path for path in src.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        graph[name] = {owner(t) for t in targets if t.split(".")[0] == "flashoverlap"} - {name, None}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
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
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "flashoverlap.tune.timing" in graph["flashoverlap.bench"]  # the graph sees the imports it should
    assert "flashoverlap.bench" in graph["flashoverlap.cli"]  # (this one inside a function)
    assert not cycles(graph), cycles(graph)


def test_the_options_import_no_torch():
    tree = ast.parse((SRC / "flashoverlap" / "cli.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("torch", "flashoverlap")], names
    # cli.py loads by itself (no flashoverlap package around it, so no torch through the package either).
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('cli', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "assert 'torch' not in sys.modules; print(m.shape('8,16,32'))")
    proc = subprocess.run([sys.executable, "-c", code, str(SRC / "flashoverlap" / "cli.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "(8, 16, 32)", proc.stderr


def _imports(path: Path) -> set[str]:
    """Every module ``path`` names in an import, anywhere in its text."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_installed_bench_uses_the_public_api():
    reached = {name for name in _imports(SRC / "flashoverlap" / "bench.py")
               if name.startswith(("flashoverlap.runtime", "flashoverlap.comm"))}
    assert not reached, reached
    assert len((SRC / "flashoverlap" / "bench.py").read_text().splitlines()) < 800  # readable in one sitting


def test_the_package_never_imports_the_benchmark_harness():
    harness = {f"{path.relative_to(SRC)}: {name}" for path in SRC.rglob("*.py") for name in _imports(path)
               if name.split(".")[0] == "benchmarks"}
    assert not harness, harness


def dynamic_imports(src: Path = SRC) -> list[str]:
    """Every ``__import__(...)`` or ``importlib.import_module(...)`` call in the package: an import that the graph
    above (and a reader's "go to definition") cannot follow."""
    found = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                if name in ("__import__", "import_module"):
                    found.append(f"{path.relative_to(src)}:{node.lineno}")
    return found


def test_no_dynamic_import_in_the_package():
    assert dynamic_imports() == []


def test_dynamic_imports_are_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    source = "import importlib\nx = importlib.import_module('os')\ny = __import__('sys')\n"
    (tmp_path / "pkg" / "a.py").write_text(source)
    assert dynamic_imports(tmp_path) == ["pkg/a.py:2", "pkg/a.py:3"]
