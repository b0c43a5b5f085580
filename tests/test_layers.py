"""The code's layering holds: import-linter's contracts (pyproject.toml), and torch's private modules only in
fxpipe/_compat.py."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers import HANG_S

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fxpipe"


def test_import_linter_contracts_hold() -> None:
    """No cycle, no upward import, runtime/ imports neither passes/ nor the zoo (see [tool.importlinter])."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is not installed; pip install -e '.[dev]' installs import-linter")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "BROKEN" not in proc.stdout and "KEPT" in proc.stdout


def _private_torch_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Imports of, and attribute paths through, a private torch module (a ``_name`` below ``torch``)."""
    found = []

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if private(node.module) or (node.module.split(".")[0] == "torch"
                                        and any(private(f"{node.module}.{a.name}") for a in node.names)):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Attribute):
            parts = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in ("torch", "dist"):
                dotted = ".".join(["torch", *reversed(parts)])
                if private(dotted):
                    found.append((node.lineno, dotted))
    return found


def test_private_torch_modules_are_reached_only_through_compat() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for line, what in _private_torch_uses(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert offenders == [], "use a function of fxpipe/_compat.py instead:\n" + "\n".join(sorted(set(offenders)))


def test_the_private_torch_check_can_fail() -> None:
    code = ("import torch._dynamo\nfrom torch._subclasses.fake_tensor import FakeTensorMode\n"
            "from torch.utils import _pytree\nx = torch._guards.tracing\ny = dist.distributed_c10d._get_default_store\n"
            "import torch.fx\nz = torch.__version__\n")
    assert sorted({line for line, _ in _private_torch_uses(ast.parse(code))}) == [1, 2, 3, 4, 5]


def test_error_classes_live_in_errors_py() -> None:
    """Every exception class fxpipe raises to a user is in fxpipe/errors.py (private control-flow ones aside)."""
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    isinstance(b, ast.Name) and (b.id.endswith("Error") or b.id == "Exception") for b in node.bases):
                elsewhere.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert elsewhere == []


# The modules at or above fxpipe.api: the only ones that may import the root package ``fxpipe`` (whose lazy
# attributes, fxpipe.compile among them, reach the compile API: an upward import the layers contract cannot see).
ABOVE_API = ("fxpipe.cli", "fxpipe.backend", "fxpipe.api", "fxpipe.targets", "fxpipe.render")


def _graph() -> object:
    import grimp  # installed with import-linter

    return grimp.build_graph("fxpipe", exclude_type_checking_imports=True)


def root_importers(graph: object) -> list[str]:
    """The modules below fxpipe.api that import the root package ``fxpipe`` itself."""
    return sorted(m for m in graph.modules if m != "fxpipe" and not any(m == a or m.startswith(a + ".")
                                                                       for a in ABOVE_API)
                  and graph.direct_import_exists(importer=m, imported="fxpipe"))


def import_cycles(graph: object) -> list[list[str]]:
    """Every cycle of module imports in ``graph`` (its strongly connected components of more than one module, or
    of one that imports itself), by Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(root: str) -> None:  # iterative: the graph may be deeper than Python's recursion limit
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, edges = work[-1]
            nxt = next((m for m in edges if m in graph.modules), None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt)))))
                elif nxt in on_stack:
                    low[module] = min(low[module], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == module:
                        break
                if len(component) > 1 or graph.direct_import_exists(importer=module, imported=module):
                    found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_nothing_below_the_api_imports_the_root_package() -> None:
    assert root_importers(_graph()) == [], "import the module itself (e.g. fxpipe.passes.assemble), not fxpipe"


def test_no_module_import_cycle() -> None:
    assert import_cycles(_graph()) == []


def test_the_graph_checks_can_fail() -> None:
    import grimp

    graph = grimp.ImportGraph()
    for m in ("fxpipe", "fxpipe.api", "fxpipe.runtime", "fxpipe.runtime.a", "fxpipe.runtime.b", "fxpipe.cli"):
        graph.add_module(m)
    graph.add_import(importer="fxpipe.runtime.a", imported="fxpipe")
    graph.add_import(importer="fxpipe.cli", imported="fxpipe")
    graph.add_import(importer="fxpipe.runtime.a", imported="fxpipe.runtime.b")
    graph.add_import(importer="fxpipe.runtime.b", imported="fxpipe.runtime.a")
    assert root_importers(graph) == ["fxpipe.runtime.a"]
    assert import_cycles(graph) == [["fxpipe.runtime.a", "fxpipe.runtime.b"]]
