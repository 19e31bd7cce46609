"""The package layout is a layering: no import circles in ``src/``, and no module imports a unit above its own.

The graph is read from the source with ``ast`` (every ``import`` statement, those inside functions too:
a lazy import is still a dependency). Importing ``a.b.c`` also runs the packages ``a.b`` and ``a``
first, unless the importer already sits inside them. A module that takes a name from its own
package's ``__init__`` (``from rollyard.placement import check`` inside ``rollyard/placement/``)
depends on that ``__init__``: an edge, so a loop through a package's own face is a circle. The root
package's ``__getattr__`` facade (``rollyard.train`` -> ``rollyard.api``, resolved only when the
attribute is used) is not an edge.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Units (a top-level module or package of rollyard) by layer, lowest first. A unit may import its own
# modules and units of strictly lower layers. The model layer sits below both rollout and trainer.
LAYERS: list[set[str]] = [
    {"types", "signals", "aliases", "schedule"},
    {"config", "tasks", "staleness", "accounting", "waits"},
    {"model", "telemetry", "algo", "sync"},
    {"reward", "checkpoint", "plan"},
    {"rollout", "trainer", "runguard", "checkpoint_writer"},  # checkpoint_writer: checkpoint.write in a thread
    {"env"},  # tools / multi-turn, rollout-side: MultiTurn wraps a rollout engine (rollout.engine.Engine)
    {"evaluate"},
    {"sft", "roles"},
    {"placement"},
    {"api"},
    {"cli", "rollyard"},
]


def _modname(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the rollyard modules it imports (directly, or as parent packages that run first)."""
    mods = {_modname(p, src): p for p in (src / "rollyard").rglob("*.py")}
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for m, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        if m == "rollyard":  # the lazy facade: module-level statements only
            tree = ast.Module(body=[n for n in tree.body if not isinstance(n, ast.FunctionDef)], type_ignores=[])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                sub = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                targets = sub + ([node.module] if len(sub) < len(node.names) else [])
            else:
                continue
            for t in targets:
                parts = t.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    # a parent package on the way to a module is already running when its own module
                    # imports the child; the package itself as the target (a name of its __init__) is not,
                    # except the root (``import rollyard`` for ``__file__``: its __init__ is the lazy facade)
                    inside = m == dep or (m.startswith(dep + ".") and (i < len(parts) or dep == "rollyard"))
                    if dep in mods and not inside and (i == len(parts) or dep != "rollyard"):
                        graph[m].add(dep)
        graph.setdefault(m, set())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rollyard"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    layer = {u: i for i, units in enumerate(LAYERS) for u in units}
    bad = []
    for m, deps in sorted(graph.items()):
        for d in sorted(deps):
            um, ud = _unit(m), _unit(d)
            if um == ud:
                continue
            if um not in layer or ud not in layer:
                bad.append(f"{m} -> {d}: unit {um if um not in layer else ud!r} has no layer in tests/test_layers.py")
            elif layer[ud] >= layer[um]:
                bad.append(f"{m} (layer {layer[um]}) imports {d} (layer {layer[ud]})")
    return bad


def test_no_import_circles_in_src():
    found = cycles(import_graph())
    assert not found, f"import circles: {found}"


def test_no_module_imports_a_unit_above_its_own():
    bad = layer_violations(import_graph())
    assert not bad, "\n".join(bad)


def test_model_layer_imports_no_role_package():
    graph = import_graph()
    roles = {"rollout", "trainer", "reward", "placement", "roles", "sync"}
    leaks = [(m, d) for m, deps in graph.items() if _unit(m) == "model" for d in deps if _unit(d) in roles]
    assert not leaks
    # and both roles that run a forward do import it
    users = {_unit(m) for m, deps in graph.items() for d in deps if _unit(d) == "model"}
    assert {"rollout", "trainer"} <= users


@pytest.mark.parametrize("case, expect", [
    ({"rollyard.a": {"rollyard.b"}, "rollyard.b": {"rollyard.c"}, "rollyard.c": {"rollyard.a"}},
     [["rollyard.a", "rollyard.b", "rollyard.c"]]),
    ({"rollyard.a": {"rollyard.b"}, "rollyard.b": set()}, []),
])
def test_the_cycle_finder_finds_a_planted_circle(case, expect):
    assert cycles(case) == expect


def test_the_walker_sees_lazy_imports_and_a_planted_upward_import(tmp_path):
    pkg = tmp_path / "rollyard"
    (pkg / "model").mkdir(parents=True)
    (pkg / "rollout").mkdir()
    for f in ("__init__.py", "model/__init__.py", "rollout/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "rollout" / "engine.py").write_text("from rollyard.model import llama\n")
    (pkg / "model" / "llama.py").write_text("def f():\n    from rollyard.rollout import engine\n")
    graph = import_graph(tmp_path)
    assert "rollyard.rollout.engine" in graph["rollyard.model.llama"]
    assert cycles(graph) == [["rollyard.model.llama", "rollyard.rollout.engine"]]
    assert layer_violations(graph) == ["rollyard.model.llama (layer 2) imports rollyard.rollout (layer 4)",
                                       "rollyard.model.llama (layer 2) imports rollyard.rollout.engine (layer 4)"]


def test_the_walker_sees_a_loop_through_a_package_s_own_init(tmp_path):
    """A planted loop: the package's __init__ imports a module (lazily) that takes a name back from
    that __init__. A submodule imported by name (``from rollyard.place import step``) is no such edge."""
    pkg = tmp_path / "rollyard" / "place"
    pkg.mkdir(parents=True)
    (tmp_path / "rollyard" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("RULE = 1\n\ndef train():\n    from rollyard.place import pool\n")
    (pkg / "pool.py").write_text("from rollyard.place import RULE, step\n")
    (pkg / "step.py").write_text("")
    (pkg / "colocated.py").write_text("from rollyard.place import step\n")
    graph = import_graph(tmp_path)
    assert graph["rollyard.place.pool"] == {"rollyard.place", "rollyard.place.step"}
    assert graph["rollyard.place.colocated"] == {"rollyard.place.step"}
    assert cycles(graph) == [["rollyard.place", "rollyard.place.pool"]]


MAX_FUNCTION_LINES = 60  # DESIGN.md: small functions; plan/ (the planner's tables of terms) is the exception


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (or method) in ``root``'s Python files over ``limit`` lines, ``plan/`` aside."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if "plan" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit:
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} "
                           f"({node.end_lineno - node.lineno + 1} lines)")
    return out


def test_no_function_over_sixty_lines_outside_plan():
    assert long_functions(SRC) == []


def test_the_length_check_finds_a_planted_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "p.py").write_text(f"def table():\n{body}\n")
    assert long_functions(tmp_path) == ["m.py:5 long (62 lines)"]
