"""Make PyPI's torchvision importable beside the CPU build of torch.

Why: vLLM's Qwen2-VL model imports transformers' Qwen2-VL image processor, which imports
``torchvision.transforms.v2`` (pure Python on top of torch). On x86-64 Linux, PyPI only has
CUDA builds of torchvision; their compiled ops (``torchvision/_C.so``) need
``libtorch_cuda.so`` and do not load beside ``torch==2.13.0+cpu``. torchvision is written to
live without its compiled ops (``torchvision.extension._has_ops()``), except for two
unguarded ``torch.library.register_fake("torchvision::nms" / "::qnms")`` calls that fail with
"operator torchvision::nms does not exist".

What: an import hook, installed by a ``.pth`` file in the CPU environment, that runs once just
before the first ``import torchvision``. If torchvision's compiled ops load, it does nothing.
Otherwise it declares the schemas of those two operators (no kernels), so that torchvision
imports; its transforms work, and calling ``torchvision.ops.nms`` raises as it would for any
torchvision without its ops. Nothing in captionflow calls those ops.

Can go when a CPU build of torchvision matching the CPU torch is installable from the project's
indexes (PyTorch's CPU wheel index has one): then install that and drop the hook.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import sysconfig

PTH_NAME = "captionflow_torchvision_compat.pth"
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBS: list = []  # keep the Library objects alive: dropping them removes the schemas


def declare_missing_ops() -> bool:
    """Declare the torchvision operator schemas when its compiled ops cannot load.

    Returns True when schemas were declared, False when torchvision's own ops loaded.
    """
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    pkg_dir = list(spec.submodule_search_locations)[0]
    so = [f for f in os.listdir(pkg_dir) if f.startswith("_C.") and f.endswith((".so", ".pyd"))]
    if so:
        try:
            torch.ops.load_library(os.path.join(pkg_dir, so[0]))
            return False
        except (OSError, ImportError, RuntimeError):
            pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for name, schema in _SCHEMAS.items():
        if not _has_schema(name):
            lib.define(schema)
    _LIBS.append(lib)
    return True


def _has_schema(name: str) -> bool:
    import torch

    try:
        return getattr(torch.ops.torchvision, name).default is not None
    except (AttributeError, RuntimeError):
        return False


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            declare_missing_ops()
        except Exception:  # never break an import because of the hook itself
            pass
        return None  # let the normal finders import torchvision


def install_hook() -> None:
    """Called from the ``.pth`` file at interpreter start: cheap, imports nothing heavy."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())


def write_pth(site_packages: str | None = None) -> str:
    """Write the ``.pth`` file into the environment's site-packages; return its path."""
    target = site_packages or sysconfig.get_paths()["purelib"]
    path = os.path.join(target, PTH_NAME)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("import captionflow.compat.torchvision_ops as _m; _m.install_hook()\n")
    return path


if __name__ == "__main__":
    print(write_pth())
