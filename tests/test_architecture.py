"""The floor plan holds: the library imports nothing above it, the import graph has no cycle (imports inside
functions included), and the code that runs in Ray workers imports neither Prefect nor Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("captionflow", "flows", "tasks", "deployments")
ABOVE_THE_LIBRARY = ("flows", "tasks", "deployments")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _imports(path: Path, modules: dict[str, Path], typing: bool = True) -> set[str]:
    """Project modules imported anywhere in the file (top level or inside functions); ``typing`` False: not those
    imported only for type annotations (``if TYPE_CHECKING:``)."""
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set()
    if not typing:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                skip |= {id(n) for b in node.body for n in ast.walk(b)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name.split(".")[0] in PACKAGES:
                found.add(name)
    return found


def _graph(typing: bool = True) -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules, typing) - {m} for m, p in modules.items()}


def test_the_library_imports_nothing_above_it():
    bad = {
        m: sorted(i for i in deps if i.split(".")[0] in ABOVE_THE_LIBRARY)
        for m, deps in _graph().items()
        if m.split(".")[0] == "captionflow"
    }
    assert not {m: d for m, d in bad.items() if d}


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


# The library in floors, lowest first. A module imports from its own package, from lower floors, and, on the
# foundation only, from the other packages of its floor: the engines know nothing of the warm engine service or the
# stages that use them; the service and the run's bookkeeping stand beside each other on the engines, neither
# importing the other; the stages (and preflight, which checks what they will use) use all of it.
FLOORS = [
    (  # the foundation: contracts, data, statistics, reports, what runs in workers
        "captionflow.errors",
        "captionflow.processes",
        "captionflow.config",
        "captionflow.deadline",
        "captionflow.results",
        "captionflow.model_source",
        "captionflow.data",
        "captionflow.workers",
        "captionflow.builtin",
        "captionflow.compat",
        "captionflow.evaluation",
        "captionflow.report",
    ),  # fmt: skip
    ("captionflow.engines",),
    ("captionflow.service", "captionflow.runs"),
    ("captionflow.stages", "captionflow.preflight"),
]


def _floor(module: str) -> tuple[int, str]:
    """(floor, package) of a library module."""
    for i, packages in enumerate(FLOORS):
        for p in packages:
            if module == p or module.startswith(p + "."):
                return i, p
    raise AssertionError(f"{module} is on no floor (add it to FLOORS)")


def test_the_library_imports_only_downwards():
    climbs, sideways = [], []
    for m, deps in _graph(typing=False).items():  # an annotation names a class of a floor above, it uses nothing
        if m.split(".")[0] != "captionflow" or m == "captionflow":
            continue
        floor, package = _floor(m)
        for d in deps:
            if d == "captionflow":
                continue
            f, p = _floor(d)
            if f > floor:
                climbs.append(f"{m} -> {d}")
            elif f == floor and p != package and floor > 0:
                sideways.append(f"{m} -> {d}")
    assert not climbs, climbs
    assert not sideways, sideways


def test_the_floors_are_the_packages_there_are():
    """Every library package is on a floor, and the engine floor holds what starts engines."""
    for m in _modules():
        if m.startswith("captionflow."):
            _floor(m)
    assert {"captionflow.engines.session", "captionflow.engines.processor", "captionflow.engines.engine"} <= set(
        _modules()
    )


# Worker modules that run a model import torch inside the actor that loads it, never at module level (the
# run-time check below holds for them too).
LOADS_A_MODEL = {"captionflow.workers.clip_rows": {"torch"}}


def test_worker_code_imports_neither_prefect_nor_ray():
    workers = [m for m in _modules() if m.startswith("captionflow.workers")]
    assert {"captionflow.workers.images", "captionflow.workers.decode", "captionflow.workers.llm_rows"} <= set(workers)
    for m in workers:  # statically, imports inside functions included
        for node in ast.walk(ast.parse(_modules()[m].read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                heavy = {"prefect", "ray", "vllm", "torch"} - LOADS_A_MODEL.get(m, set())
                assert not [n for n in names if n.split(".")[0] in heavy], (m, names)
    # and at run time: importing them pulls in none of the heavy stacks
    code = (
        "import sys, " + ", ".join(workers) + "; "
        "print(sorted(m for m in ('prefect', 'ray', 'vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_each_stage_has_a_task_named_after_it():
    for stage in ("preflight", "ingest", "preprocess", "inference", "judge", "evaluate"):
        tree = ast.parse((ROOT / "tasks" / f"{stage}.py").read_text(encoding="utf-8"))
        names = [
            kw.value.value
            for fn in ast.walk(tree)
            if isinstance(fn, ast.FunctionDef)
            for dec in fn.decorator_list
            if isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "task"
            for kw in dec.keywords
            if kw.arg == "name"
        ]
        assert names == [stage], (stage, names)
    flow = (ROOT / "flows" / "caption_flow.py").read_text(encoding="utf-8")
    body = flow[flow.index("def caption_flow(") :]
    order = [body.index(f"{s}_task(") for s in ("preflight", "ingest", "preprocess", "inference", "judge", "evaluate")]
    assert order == sorted(order)
