"""The core's layers depend one way: graph -> compiler -> codegen -> backend -> runtime/persistent -> ... .

Every module under yirage/ is parsed (not imported) and every import in it is
checked, including imports inside functions and ``TYPE_CHECKING`` blocks and
``importlib.import_module("yirage...")`` calls: a lazy import is still a
dependency. The known exceptions are listed in ALLOWED with their reason, so
the test passes and shows the debt.

Inside one package the layers say nothing, so a second check forbids import
cycles there (module a imports b and b imports a, at any depth, over the same
kinds of import): in yirage/ and in each backends/*/yirage_backend_* package.
A cycle is usually a late import hiding that two modules are one idea split
in two, or that a shared piece wants its own module below both. Known cycles
are listed in ALLOWED_CYCLES with their reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import yirage

PACKAGE = Path(yirage.__file__).resolve().parent

#: Low to high. A module may import its own package and any package of a strictly lower layer; packages
#: that share a layer are independent of each other. Names are packages or modules under yirage.
LAYERS: list[tuple[str, ...]] = [
    ("yirage.errors", "yirage.log", "yirage.locks", "yirage.system"),  # leaves: no yirage imports
    ("yirage.config", "yirage.quant"),  # settings; quantized block formats (data, no IR)
    ("yirage.graph",),  # pure IR: dtypes, ops, KernelGraph, JSON
    ("yirage.compiler",),  # fusion, kernel IR, lowering, the build cache
    ("yirage.codegen",),  # backend-neutral code generation over the kernel IR
    ("yirage.backend",),  # the Backend interface, plugins, discovery, selection
    ("yirage.autoconfig",),  # PersistentKernel configurations: derived from device_info, saved, applied
    ("yirage.runtime", "yirage.persistent"),  # executables of kernel graphs; the PersistentKernel
    ("yirage.reference",),  # the oracle: graph runner, reference backend, reference PersistentKernel runtime
    ("yirage.models",),
    ("yirage.distributed",),  # tensor parallelism over torch.distributed: world, sharding, collectives
    # autoconfig_sweep: the measured sweep; superopt: g.superoptimize() (compiles, verifies with the oracle, times)
    ("yirage.engine", "yirage.bench", "yirage.autoconfig_sweep", "yirage.superopt"),
    ("yirage.replay",),  # FusedInferEngine: records and replays plans over models (engine) and kernel graphs
    ("yirage.accuracy",),  # accuracy dump and compare: runs models (engine) and kernel graphs
    ("yirage",),  # the public API (yirage/__init__.py only: ``import yirage as yr``)
    ("yirage.testing", "yirage.cli"),  # the conformance kit and the CLI, written against the API
    ("yirage.__main__",),
]

#: (importing module, imported module) -> why it is allowed for now. Keep it short; each one is debt.
ALLOWED: dict[tuple[str, str], str] = {}


def _layer_of(module: str) -> tuple[int, str]:
    """The layer index of ``module`` and the package of LAYERS it belongs to (the longest that holds it)."""
    holders = [(len(package), index, package) for index, layer in enumerate(LAYERS) for package in layer
               if module == package or (package != "yirage" and module.startswith(package + "."))]
    if not holders:
        raise AssertionError(
            f"{module} is in no layer of tests/test_layering.py: add its package to LAYERS where it belongs"
        )
    _, index, package = max(holders)
    return index, package


def _module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module an ``from ... import`` statement reads from."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported(tree: ast.AST, module: str, is_package: bool, root: Path = PACKAGE.parent) -> Iterator[tuple[int, str]]:
    """Every module ``tree`` imports, with its line: ``from yirage import config`` is yirage.config.

    ``root`` is the directory the package of ``module`` lies in (it tells a submodule from a name in a package).
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(node, module, is_package)
            for alias in node.names:
                candidate = f"{source}.{alias.name}"
                sub = root.joinpath(*candidate.split("."))
                is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                yield node.lineno, candidate if is_module else source
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        is_package = path.name == "__init__.py"
        mine, own = _layer_of(module)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for line, target in _imported(tree, module, is_package):
            if target != "yirage" and not target.startswith("yirage."):
                continue
            theirs, other = _layer_of(target)
            if other == own or theirs < mine or (module, target) in ALLOWED:
                continue
            where = "the same layer as" if theirs == mine else "a higher layer than"
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {target}, "
                         f"which is in {where} {own}")
    return found


def test_the_core_depends_one_way() -> None:
    found = violations()
    assert not found, (
        "imports against the layering (graph -> compiler -> codegen -> backend -> runtime/persistent -> "
        "reference -> models -> engine -> API):\n  " + "\n  ".join(found) + "\nmove the code to the layer "
        "that may see both, or pass the dependency in from above (as yirage.runtime installs the compiler "
        "into KernelGraph); only if neither is possible yet, add the edge to ALLOWED with the reason"
    )


def test_every_allowed_edge_still_exists() -> None:
    """An exception that is no longer needed is removed, so ALLOWED only ever lists real debt."""
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        edges |= {(module, target) for _, target in _imported(tree, module, path.name == "__init__.py")}
    stale = [edge for edge in ALLOWED if edge not in edges]
    assert not stale, f"remove these from ALLOWED, the imports are gone: {stale}"


#: The packages searched for import cycles: the core and each built-in backend's package.
CYCLE_ROOTS: list[Path] = [PACKAGE, *sorted(PACKAGE.parent.glob("backends/*/yirage_backend_*"))]

#: Import cycles (the modules of one strongly connected component) -> why they are allowed for now. Each one is debt.
ALLOWED_CYCLES: dict[frozenset[str], str] = {
}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (every kind of import, as the layering check sees)."""
    root = package.parent
    files = {_module_name(path, root): path for path in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        targets = {target for _, target in _imported(tree, module, path.name == "__init__.py", root)}
        graph[module] = {target for target in targets if target in files and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: each strongly connected component of two or more modules (Tarjan's
    algorithm, iterative), sorted, as one path through it that ends where it starts (``a -> b -> a``)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(component)
    return sorted((_path_through(graph, component) for component in components), key=lambda path: path[0])


def _path_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle from the component's first module back to itself, for the message."""
    first = min(component)
    came_from: dict[str, str] = {}
    frontier = [first]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == first:
                    path = [node]
                    while path[-1] != first:
                        path.append(came_from[path[-1]])
                    return [first, *reversed(path[:-1]), first]
                if succ not in came_from:
                    came_from[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not a cycle")


def import_cycles() -> dict[frozenset[str], list[str]]:
    """Every import cycle of the packages in CYCLE_ROOTS: its modules -> one path through them."""
    return {frozenset(path): path for package in CYCLE_ROOTS for path in cycles(import_graph(package))}


def test_no_import_cycles_inside_a_package() -> None:
    found = {members: path for members, path in import_cycles().items() if members not in ALLOWED_CYCLES}
    assert not found, (
        "import cycles (lazy imports included):\n  " + "\n  ".join(" -> ".join(path) for path in found.values())
        + "\nmove what both sides need into a module that both import (or merge the two if they are one idea); "
        "only if that is not possible yet, add the cycle's modules to ALLOWED_CYCLES with the reason"
    )


def test_every_allowed_cycle_still_exists() -> None:
    """A cycle that was broken is removed from ALLOWED_CYCLES, so it only ever lists real debt."""
    stale = [sorted(members) for members in ALLOWED_CYCLES if members not in import_cycles()]
    assert not stale, f"remove these from ALLOWED_CYCLES, the cycles are gone (or changed shape): {stale}"


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"a"}}, [["a", "b", "a"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c", "a"]]),  # at any depth
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, []),  # a diamond is no cycle
    ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b", "a"], ["c", "d", "c"]]),
])
def test_the_cycle_finder(graph: dict[str, set[str]], expected: list[list[str]]) -> None:
    assert cycles(graph) == expected


def test_a_lazy_import_closes_a_cycle(tmp_path: Path) -> None:
    """The checker on a planted package: a function-level import back to the importer is a cycle."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import a\n    return a\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert cycles(import_graph(package)) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


@pytest.mark.parametrize(("source", "expected"), [
    ("from yirage.runtime.executable import Executable", True),
    ("def f():\n    from yirage.backend.selection import resolve\n", True),  # a lazy import counts
    ("import importlib\nimportlib.import_module('yirage.persistent.kernel')\n", True),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from yirage.backend import base\n", True),
    ("from yirage.graph.ops import OPS\nfrom yirage.errors import YirageError\n", False),
])
def test_the_checker_sees_every_kind_of_import(source: str, expected: bool) -> None:
    """The checker itself, on a module placed in the graph layer."""
    targets = [t for _, t in _imported(ast.parse(source), "yirage.graph.example", False)]
    upward = [t for t in targets if t.startswith("yirage.") and _layer_of(t)[0] > _layer_of("yirage.graph")[0]]
    assert bool(upward) is expected, targets


def test_a_kernel_graph_holds_no_executables() -> None:
    """The graph is pure IR: compiling caches in the runtime layer, and executables never point back at it."""
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    g = yirage.new_kernel_graph()
    x = g.new_input((4,))
    g.mark_output(g.exp(x))
    exe = g.compile("reference")
    assert not any("executable" in name for name in vars(g)), vars(g).keys()
    assert exe.graph is not g and exe.graph == g
    a = torch.linspace(-1.0, 1.0, 4)
    torch.testing.assert_close(exe([a])[0], a.double().exp().float())

    g.mark_output(g.relu(x))  # a change retires what was compiled before it
    again = g.compile("reference")
    assert again is not exe and len(again([a])) == 2 and len(exe([a])) == 1
    assert g.compile("reference") is again

    from yirage.runtime import graphs

    dead = weakref.ref(g)
    del g, x
    gc.collect()
    assert dead() is None, "the executable cache keeps a dropped graph alive"
    assert all(entry.graph() is not None for entry in graphs._entries.values())


def test_threads_compiling_one_graph_share_one_executable() -> None:
    """The cache outside the graph stays thread-safe: racing compiles of one graph end with one executable."""
    import threading

    torch = pytest.importorskip("torch")
    g = yirage.new_kernel_graph()
    g.mark_output(g.sqrt(g.new_input((5,))))
    barrier = threading.Barrier(6)
    got: list[object] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            barrier.wait(timeout=60)
            got.append(g.compile("reference"))
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(got) == 6 and all(exe is g.compile("reference") for exe in got)
    a = torch.arange(5, dtype=torch.float32)
    torch.testing.assert_close(got[0]([a])[0], a.double().sqrt().float())
