"""A run's driver builds Ray Data LLM processors without importing vLLM.

Ray 2.60's engine stage module (``ray.llm._internal.batch.stages.vllm_engine_stage``) imports
``ray.llm._internal.common.errors``, which imports ``vllm.v1.engine.exceptions`` only to learn vLLM's fatal
error classes - and with it all of vLLM, seconds to tens of seconds of every run's driver before the first
engine is even asked for (docs/benchmarks.md). The driver never runs an engine: the
engine stage's actors import the module again in their own processes, where vLLM is imported anyway.
``without_vllm`` makes ``import vllm`` fail in this process while a processor is built, so that module
falls back to its own default (no fatal error classes, in the driver only). A process that has vLLM
imported already (a warm engine's replica) is left as it is.
Can go when Ray Data LLM imports vLLM's error classes where they are used, not when its stage module loads.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Iterator


class _NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"{name} is not imported in a run's driver (captionflow.compat)", name=name)
        return None


@contextlib.contextmanager
def without_vllm() -> Iterator[None]:
    """While held, ``import vllm`` fails in this process (unless vLLM is imported already)."""
    if "vllm" in sys.modules:
        yield
        return
    finder = _NoVllm()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
