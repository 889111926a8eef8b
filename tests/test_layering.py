"""The house rules: imports flow one way, no import circles, no module over 400 lines.

Layers, lowest first (a module may import its own layer and every lower one)::

    trace (0) -> profiler (1) -> partitioner (2) -> codegen (3) -> runtime (4)
        -> api, compiled, options, cli, plot, data, __main__ and the package ``nowdl/__init__`` (5)

Leaves (errors, units, geometry, models, cpumem, gcpause, lazy, backends, plan, schedule) sit below every
layer: anyone may import them, and they import only other leaves.

The import graph has one node per module (``nowdl.runtime.spatial``; a package is its
``__init__``: ``nowdl.runtime``) and one edge per import statement anywhere in the file: top
level, lazy imports inside functions and ``if TYPE_CHECKING:`` blocks alike (a TYPE_CHECKING
import still ties the modules together for readers and type checkers). ``from pkg import
name`` points at ``pkg.name`` when that is a module, else at ``pkg``. Importing
``nowdl.a.b`` also runs ``nowdl/__init__`` and ``nowdl/a/__init__``; those implicit parent
imports are not edges (else every module would sit in a circle with the package root).

Circles: a package ``__init__`` that re-exports its own submodules (``nowdl.runtime`` ->
``nowdl.schedule``) is its façade, not a dependency, so edges from a package
``__init__`` to modules inside that package are left out of the circle check (they are
still layer-checked). Every other circle fails.

``KNOWN`` lists violations tolerated for a while (none today); the test also fails when an
entry is no longer needed, so the list cannot rot.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "nowdl"
MAX_LINES = 400

LEAVES = (
    "nowdl.errors", "nowdl.units", "nowdl.geometry", "nowdl.models", "nowdl.cpumem", "nowdl.gcpause", "nowdl.lazy",
    "nowdl.backends",
    "nowdl.plan",  # the Plan, its JSON and the cluster topology it is made for
    "nowdl.schedule",  # pipeline schedules: orders, zero bubble, simulation, the grid
)
LAYERS = {
    "nowdl.trace": 0,
    "nowdl.profiler": 1,
    "nowdl.partitioner": 2,
    "nowdl.codegen": 3,
    "nowdl.runtime": 4,
    "nowdl.api": 5,  # nowdl.compile and nowdl.profile
    "nowdl.compiled": 5,  # CompiledModel: plans on the first input, trains through the runtime
    "nowdl.options": 5,  # PlannerOptions and RuntimeOptions: compile()'s settings, checked when made
    "nowdl.cli": 5,
    "nowdl.plot": 5,  # pictures of plans and runs: reads plans and schedules, used by the cli
    "nowdl.data": 5,  # nowdl.data: the public data API over runtime's readers, datasets and loader
    "nowdl.optimizers": 5,  # the compiled model's optimizer, by name or factory
    "nowdl.progress": 5,
    "nowdl.__main__": 5,
    "nowdl": 5,
}
LEAF = -1

#: Inside a layer, its sub-packages (and top modules) in import order, lowest first: a module may
#: import its own sub-package and the ones before it, never one after it.
SUBLAYERS: dict[str, tuple[str, ...]] = {
    "nowdl.partitioner": (
        "spatial",  # which nodes run on tiles, their halos
        "config",  # the vocabulary: PlanRequest, Candidate, grids, lever settings
        "placement",  # which rank holds which part
        "chain",  # the min-max chain DP the DPs, MASTER and the MILP share
        "costs",  # a profile and a candidate as a Problem of numbers
        "master",  # GEMS-MASTER pairing over chain costs
        "exact",  # DPs over orders and ideals
        "milp",  # the HiGHS MILP
        "baselines",  # torchgpipe's block partition and other simple splits
        "solver",  # one configuration's split
        "search",  # configurations, halo fusion, the Plan
    ),
    "nowdl.runtime": ("launch", "spatial", "data", "pipeline", "training", "predict"),
}

# Violations owned by the branch splitting engine.py / trainer.py / run.py / api.py / cli.py.
# Each entry must still be needed (see test_known_entries_are_needed); empty after merging.
KNOWN: dict[str, set[tuple[str, ...]]] = {"upward": set(), "cycle": set(), "long": set()}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def layer(mod: str) -> int | None:
    """The module's rank; None when it is in no layer (the top package matches only itself)."""
    if any(mod == leaf or mod.startswith(leaf + ".") for leaf in LEAVES):
        return LEAF
    keys = [k for k in LAYERS if mod == k or (k != "nowdl" and mod.startswith(k + "."))]
    return LAYERS[max(keys, key=len)] if keys else None


def imports(mod: str, path: Path, known: set[str]) -> set[str]:
    """Every nowdl module ``mod`` imports, anywhere in its file."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.add(sub if sub in known else src)
    res = set()
    for name in out:
        while name and name not in known:  # `import nowdl.a.b as x` style: nearest module
            name = name.rpartition(".")[0]
        if name and name != mod:
            res.add(name)
    return res


def import_graph() -> nx.DiGraph:
    mods = modules()
    g = nx.DiGraph()
    g.add_nodes_from(mods)
    for mod, path in mods.items():
        for dst in imports(mod, path, set(mods)):
            g.add_edge(mod, dst)
    return g


def upward_edges(g: nx.DiGraph) -> set[tuple[str, ...]]:
    return {(a, b) for a, b in g.edges if (layer(b) or 0) > (layer(a) or 0)}


def cycles(g: nx.DiGraph) -> list[list[str]]:
    """Every import circle, package ``__init__`` -> own submodule (façade) edges left out."""
    packages = {m for m, p in modules().items() if p.name == "__init__.py"}
    h = g.copy()
    h.remove_edges_from([(a, b) for a, b in g.edges if a in packages and b.startswith(a + ".")])
    return [sorted(c) for c in nx.simple_cycles(h)]


def cycle_keys(g: nx.DiGraph) -> set[tuple[str, ...]]:
    """Each circle, named by the KNOWN entry that breaks it (an edge on it), else by itself."""
    out: set[tuple[str, ...]] = set()
    for c in cycles(g):
        hit = [k for k in KNOWN["cycle"] if all(m in c for m in k)]
        out.update(hit or [tuple(c)])
    return out


def sublayer(mod: str) -> tuple[str, int] | None:
    """(layer package, rank of ``mod``'s sub-package in SUBLAYERS), None outside them or for a
    layer's own ``__init__`` (its façade re-exports from every sub-package)."""
    for top, order in SUBLAYERS.items():
        if mod.startswith(top + "."):
            part = mod[len(top) + 1:].split(".")[0]
            return (top, order.index(part)) if part in order else (top, -1)
    return None


def sub_upward_edges(g: nx.DiGraph) -> set[tuple[str, ...]]:
    """Edges from a sub-package of a layer to a later one of the same layer (SUBLAYERS)."""
    out = set()
    for a, b in g.edges:
        sa, sb = sublayer(a), sublayer(b)
        if sa and sb and sa[0] == sb[0] and sb[1] > sa[1]:
            out.add((a, b))
    return out


def long_files() -> set[tuple[str, ...]]:
    out = set()
    for path in modules().values():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            out.add((str(path.relative_to(ROOT)),))
    return out


def test_graph_sees_lazy_and_type_checking_imports() -> None:
    g = import_graph()
    assert g.has_edge("nowdl.runtime.pipeline.engine", "nowdl.codegen.stage")  # top level
    assert g.has_edge("nowdl.cli.commands", "nowdl.cli.run")  # lazy, inside a function
    assert g.has_edge("nowdl.schedule.build", "nowdl.plan.plan")  # TYPE_CHECKING
    assert g.has_edge("nowdl.runtime.spatial", "nowdl.runtime.spatial.exchange")  # package façade
    assert layer("nowdl.models.resnet") == LEAF and layer("nowdl.runtime.spatial.exchange") == 4
    # the checks do fire: a circle and an upward edge added by hand are found
    g.add_edges_from([("nowdl.trace.tracer", "nowdl.runtime.pipeline.engine"), ("nowdl.runtime.pipeline.engine", "nowdl.trace.tracer")])
    assert ("nowdl.trace.tracer", "nowdl.runtime.pipeline.engine") in upward_edges(g)
    assert ("nowdl.runtime.pipeline.engine", "nowdl.trace.tracer") in cycle_keys(g)


def test_sub_packages_import_one_way() -> None:
    """The partitioner's and the runtime's sub-packages import in SUBLAYERS' order, no arrow back."""
    g = import_graph()
    unplaced = sorted({m for m in modules() if (s := sublayer(m)) and s[1] < 0})
    assert not unplaced, f"place these modules' sub-packages in SUBLAYERS of {__name__}: {unplaced}"
    bad = sub_upward_edges(g)
    assert not bad, "sub-packages importing a later one of their layer:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(bad))
    # the check does fire: the cost model reaching up into the search is found
    g.add_edge("nowdl.partitioner.costs.costmodel", "nowdl.partitioner.search.assemble")
    g.add_edge("nowdl.runtime.launch.group", "nowdl.runtime.pipeline.engine")
    assert sub_upward_edges(g) == {("nowdl.partitioner.costs.costmodel", "nowdl.partitioner.search.assemble"),
                                   ("nowdl.runtime.launch.group", "nowdl.runtime.pipeline.engine")}


def test_partitioner_docstring_names_the_order() -> None:
    """The partitioner's ``__init__`` tells readers SUBLAYERS' order, so it cannot drift from it."""
    doc = " ".join((ast.get_docstring(ast.parse((PKG / "partitioner" / "__init__.py").read_text())) or "").split())
    order = ", ".join(SUBLAYERS["nowdl.partitioner"])
    assert order in doc, f"nowdl/partitioner/__init__.py should name the sub-package order: {order}"


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in modules() if layer(m) is None)
    assert not unplaced, f"place these modules in LAYERS or LEAVES of {__name__}: {unplaced}"


def test_no_upward_imports() -> None:
    bad = upward_edges(import_graph()) - KNOWN["upward"]
    assert not bad, "modules importing a higher layer:\n" + "\n".join(
        f"  {a} ({layer(a)}) -> {b} ({layer(b)})" for a, b in sorted(bad)
    )


def test_no_import_circles() -> None:
    bad = cycle_keys(import_graph()) - KNOWN["cycle"]
    assert not bad, "import circles:\n" + "\n".join(f"  {' <-> '.join(c)}" for c in sorted(bad))


def test_no_long_modules() -> None:
    bad = long_files() - KNOWN["long"]
    assert not bad, f"modules over {MAX_LINES} lines: {sorted(bad)}"


def test_known_entries_are_needed() -> None:
    g = import_graph()
    found = {"upward": upward_edges(g), "cycle": cycle_keys(g), "long": long_files()}
    stale = {k: sorted(v - found[k]) for k, v in KNOWN.items() if v - found[k]}
    assert not stale, f"KNOWN entries no longer needed (remove them): {stale}"


MAX_MODULES = 15


def test_no_crowded_folders() -> None:
    """No package holds more than MAX_MODULES modules (its ``__init__`` included), and every
    package's ``__init__`` says what it is for."""
    crowded, silent = [], []
    for init in PKG.rglob("__init__.py"):
        n = len(list(init.parent.glob("*.py")))
        if n > MAX_MODULES:
            crowded.append((str(init.parent.relative_to(ROOT)), n))
        if not ast.get_docstring(ast.parse(init.read_text())):
            silent.append(str(init.relative_to(ROOT)))
    assert not crowded, f"folders over {MAX_MODULES} modules: {crowded}"
    assert not silent, f"package __init__ files without a docstring: {silent}"


def test_tests_import_no_test_module() -> None:
    """No file under tests/ imports a test module (``test_*``): what tests share lives in
    ``tests/helpers/``, so a test module can move without breaking another."""
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(a.name for a in node.names)]
            else:
                continue
            if any(part.startswith("test_") for name in names for part in name.split(".")):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"imports of test modules (move what they share to tests/helpers/): {bad}"


def private_imports() -> list[str]:
    """Imports of a private name (``_x``, a module or what it defines) of another package (folder)
    than the importing module's: ``from nowdl.a.b import _x``, ``from nowdl.a._b import x``,
    ``import nowdl.a._b``. Such a name should be public (or the helper live where it is used)."""

    def folder(parts: list[str]) -> Path | None:
        base = ROOT.joinpath(*parts)
        if (base / "__init__.py").exists():
            return base
        return base.parent if base.with_suffix(".py").exists() else None

    def crosses(dotted: str, here: Path) -> bool:
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            if part.startswith("_") and not part.startswith("__"):
                where = folder(parts[: i + 1]) or folder(parts[:i])  # a module, or a name in one
                if where is not None and where != here:
                    return True
        return False

    bad = []
    for mod, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            bad += [f"{mod} imports {n}" for n in names if n.startswith("nowdl.") and crosses(n, path.parent)]
    return bad


def test_no_private_imports_across_packages() -> None:
    bad = private_imports()
    assert not bad, (
        "private names imported from another package (make them public and list them in __all__, "
        "or move the helper to where it is used):\n" + "\n".join(f"  {b}" for b in sorted(bad))
    )
