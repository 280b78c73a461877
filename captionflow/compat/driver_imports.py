"""A run's driver builds Ray Data LLM processors without importing vLLM.

Ray 2.60's engine stage module (``ray.llm._internal.batch.stages.vllm_engine_stage``) imports
``ray.llm._internal.common.errors``, which imports ``vllm.v1.engine.exceptions`` only to learn vLLM's fatal
error classes - and with it all of vLLM, seconds to tens of seconds of every run's driver before the first
engine is even asked for (docs/benchmarks.md). The driver never runs an engine: the
engine stage's actors import the module again in their own processes, where vLLM is imported anyway.
``without_vllm`` makes ``import vllm`` fail in the thread that holds it while a processor is built, so that
module falls back to its own default (no fatal error classes, in the driver only); other threads (a preflight
asking where vLLM is installed) are not affected. A process that has vLLM imported already (a warm engine's
replica) is left as it is.
Can go when Ray Data LLM imports vLLM's error classes where they are used, not when its stage module loads.

``prewarm`` imports what building a run's pipeline imports (Ray Serve first for a warm run, whose checkpoint starts
loading into the service's engines as preflight ends; Ray Data, Ray Data LLM's processors) in a background thread
while the run's first stages run: on a warm run it was most of the ~2 s
between the cached preprocess and the dataset's start on the critical path (py-spy of the driver on the 2-core
VM: the processor's imports ~3/4 of it, Ray Data's first context most of the rest).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import sys
import threading
from collections.abc import Iterator

log = logging.getLogger("captionflow.driver")
PREWARM_THREAD = "captionflow-driver-imports"
_prewarm: list[threading.Thread] = []


class _NoVllm(importlib.abc.MetaPathFinder):
    """Refuses vLLM to the threads in ``blocked``. Installed once, first on ``sys.meta_path``, and never removed:
    adding and removing a finder while another thread walks ``sys.meta_path`` for an import of its own can make
    that walk skip the next finder, and that import fail."""

    def __init__(self) -> None:
        self.blocked: set[int] = set()

    def find_spec(self, name, path=None, target=None):
        if (name == "vllm" or name.startswith("vllm.")) and threading.get_ident() in self.blocked:
            raise ModuleNotFoundError(f"{name} is not imported in a run's driver (captionflow.compat)", name=name)
        return None


_finder = _NoVllm()
_finder_lock = threading.Lock()


def _install() -> None:
    with _finder_lock:
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


@contextlib.contextmanager
def without_vllm() -> Iterator[None]:
    """While held, ``import vllm`` fails in this thread (unless vLLM is imported already)."""
    if "vllm" in sys.modules:
        yield
        return
    _install()
    me = threading.get_ident()
    _finder.blocked.add(me)
    try:
        yield
    finally:
        _finder.blocked.discard(me)


_install()  # now, while this process is most likely importing on one thread only


def _imports(serve: bool) -> None:
    try:
        with without_vllm():
            if serve:  # first: a warm engine service starts loading the run's checkpoint as preflight ends
                import ray.serve
            import ray.data
            import ray.data.llm  # the processors and their stages
            from ray.llm._internal.batch.processor.base import Processor  # noqa: F401

            ray.data.DataContext.get_current()
    except Exception as e:  # the stage imports them itself, and says what fails there
        log.debug("prewarming the driver's imports failed: %s", e)


def prewarm(serve: bool = False) -> None:
    """Start importing, in the background, what a run's inference stage imports first (once per process);
    ``serve``: Ray Serve too (a warm engine service may serve the run)."""
    if _prewarm or "vllm" in sys.modules:
        return
    thread = threading.Thread(target=_imports, args=(serve,), name=PREWARM_THREAD, daemon=True)
    _prewarm.append(thread)
    thread.start()


def prewarmed(timeout_s: float = 120.0) -> None:
    """Wait for ``prewarm``'s imports (if started), so that no module is imported by two threads at once."""
    for thread in _prewarm:
        thread.join(timeout_s)
