"""A walk through the code from the inference task: how many rooms (modules) a reader enters, how often a call
climbs to a floor above (tests/test_architecture.py's FLOORS; a module of the old pipeline/ counted on its new home's
floor), and how often the walk returns to a room it had already left. Rooms and returns count the Ray side's modules
(engines, the warm engine service, the run's bookkeeping, the stages): the foundation's helpers (errors, storage)
are entered from everywhere by design.

The walk follows calls statically, depth first in source order, from ``tasks/inference.py::inference_task``: a call
of a name the module defines or imports (a function, a class: its ``__init__`` and ``__post_init__``), of an imported
module's attribute (``service.for_run``), of ``self.method``, and a project function handed on as an argument
(``functools.partial(f, ...)``, a callback). Each function is walked once, where the walk first reaches it. Calls on
other objects (``ledger.drain``) are not followed: a reader follows them by their type, which a static walk does not
know, so the counts are lower bounds, the same for every revision walked.

    python bench/walk.py                 # the working tree
    python bench/walk.py --rev b21050d   # a revision (checked out into a temporary folder)
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_architecture import FLOORS  # noqa: E402

PACKAGES = ("captionflow", "flows", "tasks", "deployments")
# where the modules of pipeline/ (before the floors) live now: their floor
MOVED = {
    **{f"captionflow.pipeline.{m}": f"captionflow.engines.{m}" for m in
       ("engine", "presets", "processor", "session", "request_format", "device", "worker_prewarm", "staging",
        "run_log")},
    **{f"captionflow.pipeline.{m}": f"captionflow.runs.{m}" for m in
       ("ledger", "watchdog", "plan", "fanout", "baseline")},
    **{f"captionflow.pipeline.{m}": f"captionflow.stages.{m}" for m in
       ("preprocess", "inference", "judge", "pairwise", "clip_score")},
    "captionflow.pipeline.deadline": "captionflow.deadline",
}  # fmt: skip
# the house the walk counts rooms and returns in: the Ray side (the foundation's helpers are not rooms one walks)
HOUSE = ("captionflow.pipeline", "captionflow.engines", "captionflow.service", "captionflow.runs", "captionflow.stages")


def floor(module: str) -> int:
    module = MOVED.get(module, module)
    if not module.startswith("captionflow."):
        return len(FLOORS)  # tasks/, flows/: above the library
    for i, packages in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return i
    return 0


class Code:
    def __init__(self, root: Path):
        self.root = root
        self.trees: dict[str, ast.Module] = {}
        for pkg in PACKAGES:
            for path in (root / pkg).rglob("*.py"):
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                self.trees[".".join(parts)] = ast.parse(path.read_text(encoding="utf-8"))
        self.defs: dict[tuple[str, str], ast.AST] = {}  # (module, qualname) -> def
        self.names: dict[str, dict[str, tuple[str, str]]] = {}  # module -> name -> (module, qualname) or module
        for m, tree in self.trees.items():
            names = self.names[m] = {}
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.defs[(m, node.name)] = node
                    names[node.name] = (m, node.name)
                    if isinstance(node, ast.ClassDef):
                        for sub in node.body:
                            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                                self.defs[(m, f"{node.name}.{sub.name}")] = sub
            for node in ast.walk(tree):  # imports anywhere in the module (inside functions too)
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for a in node.names:
                        full = f"{node.module}.{a.name}"
                        if full in self.trees:
                            names[a.asname or a.name] = (full, "")
                        elif node.module in self.trees:
                            names[a.asname or a.name] = (node.module, a.name)
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name in self.trees and a.asname:
                            names[a.asname] = (a.name, "")

    def resolve(self, module: str, cls: str | None, node: ast.AST) -> tuple[str, str] | None:
        """The project function or class a call's target (or a name handed on) is, if known."""
        if isinstance(node, ast.Name):
            got = self.names[module].get(node.id)
            return got if got and got[1] and got in self.defs else None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "self" and cls and (module, f"{cls}.{node.attr}") in self.defs:
                return module, f"{cls}.{node.attr}"
            got = self.names[module].get(node.value.id)
            if got and not got[1] and (got[0], node.attr) in self.defs:
                return got[0], node.attr
            if got and got[1] and (got[0], f"{got[1]}.{node.attr}") in self.defs:  # Class.method
                return got[0], f"{got[1]}.{node.attr}"
        return None

    def calls(self, module: str, qualname: str) -> list[tuple[str, str]]:
        node = self.defs[(module, qualname)]
        if isinstance(node, ast.ClassDef):
            methods = (f"{qualname}.{n}" for n in ("__init__", "__post_init__"))
            return [(module, m) for m in methods if (module, m) in self.defs]
        cls = qualname.split(".")[0] if "." in qualname else None
        types = self.local_types(module, node)
        found = []
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                for target in [sub.func, *sub.args, *(k.value for k in sub.keywords)]:
                    got = self.resolve(module, cls, target) or self.method(module, target, types)
                    if got and got != (module, qualname) and got not in found:
                        found.append(got)
        return found

    def class_of(self, module: str, node: Optional[ast.AST]) -> Optional[tuple[str, str]]:
        """The project class an annotation or a constructor call names (``Optional[X]``, ``X | None``, ``X(...)``)."""
        if node is None:
            return None
        if isinstance(node, ast.Call):
            node = node.func
        if isinstance(node, ast.Subscript):  # Optional[X]
            return self.class_of(module, node.slice)
        if isinstance(node, ast.BinOp):  # X | None
            return self.class_of(module, node.left) or self.class_of(module, node.right)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
            try:
                return self.class_of(module, ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return None
        got = self.resolve(module, None, node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        return got if got and isinstance(self.defs.get(got), ast.ClassDef) else None

    def local_types(self, module: str, fn: ast.AST) -> dict[str, tuple[str, str]]:
        """The project classes of a function's parameters (by annotation) and of its names bound to a constructor
        call or ``with X(...) as name``: a reader follows ``ledger.drain`` to ``Ledger.drain``."""
        types = {}
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        for a in args:
            got = self.class_of(module, a.annotation)
            if got:
                types[a.arg] = got
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
                got = self.class_of(module, sub.value) if isinstance(sub.value, ast.Call) else None
                if got:
                    types[sub.targets[0].id] = got
            elif isinstance(sub, ast.withitem) and isinstance(sub.optional_vars, ast.Name):
                got = self.class_of(module, sub.context_expr) if isinstance(sub.context_expr, ast.Call) else None
                if got:
                    types[sub.optional_vars.id] = got
        return types

    def method(self, module: str, target: ast.AST, types: dict) -> Optional[tuple[str, str]]:
        """``x.method`` for a name ``x`` of a known project class, or ``X(...).method``."""
        if not isinstance(target, ast.Attribute):
            return None
        owner = None
        if isinstance(target.value, ast.Name):
            owner = types.get(target.value.id)
        elif isinstance(target.value, ast.Call):
            owner = self.class_of(module, target.value)
        if owner is None:
            return None
        m, cls = owner
        while True:
            if (m, f"{cls}.{target.attr}") in self.defs:
                return m, f"{cls}.{target.attr}"
            base = self.defs[(m, cls)].bases  # the method of a base class
            up = self.class_of(m, base[0]) if base else None
            if up is None:
                return None
            m, cls = up


def walk(root: Path, entry=("tasks.inference", "inference_task")) -> dict:
    code = Code(root)
    seen: set[tuple[str, str]] = set()
    entered: list[str] = []  # rooms in the order first entered
    left: set[str] = set()  # rooms the walk has been in and left
    climbs: list[str] = []
    returns: list[str] = []
    stack: list[str] = []

    def visit(fn: tuple[str, str]) -> None:
        module = fn[0]
        caller = stack[-1] if stack else None
        if caller != module:
            if caller and floor(module) > floor(caller) and floor(caller) < len(FLOORS):
                climbs.append(f"{caller} -> {module}")
            if module in left and module not in stack:
                returns.append(module)
            if module not in entered:
                entered.append(module)
        stack.append(module)
        for callee in code.calls(*fn):
            if callee not in seen:
                seen.add(callee)
                visit(callee)
        stack.pop()
        if module not in stack:
            left.add(module)

    seen.add(entry)
    visit(entry)
    house = [m for m in entered if m.startswith(HOUSE)]
    return {
        "rooms": len(house),
        "climbs": len(climbs),
        "returns": sum(1 for r in returns if r.startswith(HOUSE)),
        "functions": len(seen),
        "rooms_in_order": house,
        "climbs_list": climbs,
        "returns_list": [r for r in returns if r.startswith(HOUSE)],
        "entered": {m: 1 + returns.count(m) for m in house},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", help="a git revision to walk instead of the working tree")
    ap.add_argument("--json", action="store_true", help="print the whole walk as JSON")
    a = ap.parse_args()
    if a.rev:
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", tmp, a.rev], check=True)
            try:
                result = walk(Path(tmp))
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tmp], check=True)
    else:
        result = walk(ROOT)
    if a.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{'rooms':>6} {'climbs':>7} {'returns':>8} {'functions':>10}")
    print(f"{result['rooms']:>6} {result['climbs']:>7} {result['returns']:>8} {result['functions']:>10}")
    for c in result["climbs_list"]:
        print("  climb:", c)
    most = sorted(result["entered"].items(), key=lambda kv: -kv[1])[:5]
    print("  entered most:", ", ".join(f"{m.removeprefix('captionflow.')} {n}x" for m, n in most))


if __name__ == "__main__":
    main()
