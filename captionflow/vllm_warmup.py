"""Build vLLM's HF processor in each engine actor while its engine core is still starting.

vLLM's front end (measured with 0.26 on the GPU host and 0.29 here) builds the model's HF processor
(``ProcessorMixin.from_pretrained``, tokenizer files included) once at start-up and once more on the
first request: the renderer works with its own copy of the tokenizer, and the tokenizer object is
part of vLLM's processor cache key. Inside Ray Data LLM that second build runs on the engine actor's
asyncio loop, so nothing is sent to the engine and no result comes back until it ends. On the H100
host with 4 engines it took 12-14 s per engine, about half of a 2,000-image run after the engines
were up (bench/diag_processor_cache.py, README "GPU benchmark").

``install`` is Ray's ``worker_process_setup_hook`` for the engine actors (``SETUP_HOOK``): it imports
nothing heavy; when vLLM's ``vllm.v1.engine.input_processor`` module is imported later in that
process, its ``InputProcessor`` is wrapped so that, once constructed (before the engine core - a
separate process - has loaded and compiled the model), a background thread asks the renderer's
multimodal processor for its HF processor with the request path's arguments. The request then finds
it in vLLM's cache. If anything here fails, vLLM simply builds the processor on the first request,
as it would without this.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import threading
import time

SETUP_HOOK = "captionflow.vllm_warmup.install"
TARGET_MODULE = "vllm.v1.engine.input_processor"
THREAD_NAME = "captionflow-processor-warmup"


def _say(msg: str) -> None:  # to the worker's log file (Ray keeps each worker's stderr)
    print(f"captionflow: {msg}", file=sys.stderr, flush=True)


def start_warmup(renderer) -> threading.Thread | None:
    """Build ``renderer``'s HF processor in a daemon thread (None for a text-only model)."""
    mm = getattr(renderer, "mm_processor", None)
    if mm is None:
        return None

    def run() -> None:
        t0 = time.perf_counter()
        try:
            mm.info.get_hf_processor()  # what a request without mm_processor_kwargs asks for
        except Exception as e:  # vLLM then builds it on the first request, as without this
            _say(f"could not pre-build the HF processor ({e!r}); vLLM builds it on the first request")
            return
        _say(f"HF processor pre-built in {time.perf_counter() - t0:.1f} s")

    t = threading.Thread(target=run, name=THREAD_NAME, daemon=True)
    t.start()
    return t


def patch(module) -> bool:
    """Wrap ``module.InputProcessor.__init__`` (once); False if the module has no such class."""
    cls = getattr(module, "InputProcessor", None)
    if cls is None or getattr(cls, "_captionflow_warmup", False):
        return cls is not None
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        start_warmup(getattr(self, "renderer", None))

    cls.__init__ = __init__
    cls._captionflow_warmup = True
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of TARGET_MODULE so that ``patch`` runs right after
    the module has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET_MODULE:
            return None
        sys.meta_path.remove(self)  # let the normal finders locate it; we only need to see it once
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            if not patch(module):
                _say(f"{name} has no InputProcessor; HF processor pre-build skipped")

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Ray worker_process_setup_hook: patch InputProcessor now if vLLM is loaded, else on import."""
    if TARGET_MODULE in sys.modules:
        patch(sys.modules[TARGET_MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
