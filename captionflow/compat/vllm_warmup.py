"""Build vLLM's HF processor in each engine actor while its engine core is still starting.

vLLM 0.26's front end builds the model's HF processor (``ProcessorMixin.from_pretrained``, tokenizer
files included) once at start-up and once more on the first request: the renderer works with its own
copy of the tokenizer, and the tokenizer object is part of vLLM's processor cache key. Inside Ray
Data LLM that second build runs on the engine actor's asyncio loop, so nothing is sent to the engine
and no result comes back until it ends: on the H100 host with 4 engines, 12-14 s per engine, half of
a 2,000-image run after the engines were up.
Can go when the GPU host runs vLLM 0.29 or later, which warms the processor itself at start-up (there
this is redundant and harmless).

``install`` is Ray's ``worker_process_setup_hook`` for the job (``SETUP_HOOK``, set by
``captionflow.engines.session.ray_session`` for the GPU preset and on a Ray cluster; Ray ignores one given to a
single actor). It imports no vLLM: when vLLM's
modules in ``PATCHES`` are imported later in a worker, (1) ``InputProcessor`` is wrapped so that, once
constructed (before the engine core - a separate process - has loaded and compiled the model), a
background thread asks the renderer's multimodal processor for its HF processor with the request
path's arguments - the first request then finds it in vLLM's cache; (2) ``AsyncLLM`` logs the moment
it is ready to take requests (``ACCEPTING``), which the GPU benchmark reads, renders requests on its
renderer's threads instead of its event loop (``render_off_loop``) and asks for each request's final output
only (``final_outputs_only``). (3) the front end's tokenizer copies (one per renderer thread) are made in the
background (``tokenizer_pool``), and (4) its engine core's process is prestarted (``core_prestart``). If anything
here fails, vLLM builds the processor on the first request, as it would without this.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
import threading
import time

from captionflow.compat import core_prestart, tokenizer_pool
from captionflow.workers import worker_log

SETUP_HOOK = "captionflow.compat.vllm_warmup.install"
THREAD_NAME = "captionflow-processor-warmup"


def start_warmup(renderer) -> threading.Thread | None:
    """Build ``renderer``'s HF processor in a daemon thread (None for a text-only model)."""
    mm = getattr(renderer, "mm_processor", None)
    if mm is None:
        return None

    def run() -> None:
        core_prestart.after_handoff()
        t0 = time.perf_counter()
        try:
            mm.info.get_hf_processor()  # what a request without mm_processor_kwargs asks for
        except Exception as e:  # vLLM then builds it on the first request, as without this
            worker_log.say(f"could not pre-build the HF processor ({e!r}); vLLM builds it on the first request")
            return
        worker_log.say(f"HF processor pre-built in {time.perf_counter() - t0:.1f} s")

    t = threading.Thread(target=run, name=THREAD_NAME, daemon=True)
    t.start()
    return t


def _prebuilds_done() -> None:
    """Wait for this process's HF processor pre-builds (``start_warmup``), if any."""
    for thread in threading.enumerate():
        if thread.name == THREAD_NAME:
            thread.join()


def _wrap_init(cls, after=None, *, before=None) -> None:
    """``cls.__init__`` calls ``before(self)`` first and ``after(self)`` last (once patched, never again)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if before is not None:
            before(self)
        init(self, *args, **kwargs)
        if after is not None:
            after(self)

    cls.__init__ = __init__
    cls._captionflow_patched = True


def patch_input_processor(module) -> bool:
    """Start the pre-build when ``InputProcessor`` is constructed (False: no such class)."""
    cls = getattr(module, "InputProcessor", None)
    if cls is not None and not getattr(cls, "_captionflow_patched", False):
        _wrap_init(cls, lambda self: start_warmup(getattr(self, "renderer", None)))
    return cls is not None


def patch_async_llm(module) -> bool:
    """Log when an ``AsyncLLM`` (the engine front end Ray Data LLM drives) is ready to take requests:
    ``ACCEPTING`` and the Unix time, which bench/gpu_throughput.py reads (raw vLLM's counterpart is
    ``LLM()`` returning); render its requests off the event loop (``render_off_loop``); send back only
    their final outputs (``final_outputs_only``)."""
    cls = getattr(module, "AsyncLLM", None)
    if cls is not None and not getattr(cls, "_captionflow_patched", False):
        _wrap_init(cls, _accepting)
        render_off_loop(cls)
        final_outputs_only(cls)
    return cls is not None


def _accepting(llm) -> None:
    """The front end is up (its engine core ready): once its HF processor is pre-built and its tokenizer copies
    are made - what its first requests would otherwise wait for, or starve on - it says it accepts requests."""
    core_prestart.release()
    _prebuilds_done()
    tokenizer_pool.filled()
    worker_log.say(f"{ACCEPTING} {time.time():.3f}")


def final_outputs_only(cls) -> None:
    """Ray Data LLM (2.60) reads only the finished output of each request (``vllm_engine_stage._generate_async``
    skips the rest) but sends vLLM's default sampling parameters, which ask for the whole text so far after
    every token: per request and token the front end builds a ``RequestOutput``, queues it and wakes the
    waiting coroutine, all on the event loop that also feeds the engine. ``vllm.LLM`` asks for the final output
    only (``FINAL_ONLY``); so do requests through here. The captions are the same (the finished output is
    built from the same detokenised text). Can go when Ray Data LLM asks for ``FINAL_ONLY`` itself."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    add_request = cls.add_request

    @functools.wraps(add_request)
    async def add_request_final_only(self, request_id, prompt, params, *args, **kwargs):
        if isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.CUMULATIVE:
            params.output_kind = RequestOutputKind.FINAL_ONLY
        return await add_request(self, request_id, prompt, params, *args, **kwargs)

    cls.add_request = add_request_final_only


def render_off_loop(cls) -> None:
    """Ray Data LLM (2.60) hands ``AsyncLLM.generate`` raw prompts (text + images). vLLM 0.26 then processes
    each one - the HF image processor, tokenising - synchronously on the front end's event loop
    (``InputProcessor.process_inputs``, the path vLLM marks deprecated), so one engine's front end does all
    image processing on one thread and its loop stalls for seconds at a time (outputs, new requests and stats
    wait: on the H100, one engine per GPU reached 105 images/s where the engine drains 528). Rendering
    through the renderer's async path (``render_cmpl_async``, vLLM's own non-deprecated route) runs it on the
    renderer's thread pool (``renderer_num_workers`` threads) and hands the engine the rendered input, which
    it accepts as is. Where the front end lacks that path, requests go as before."""
    add_request = cls.add_request

    @functools.wraps(add_request)
    async def add_request_rendered(self, request_id, prompt, params, *args, **kwargs):
        renderer = getattr(self, "renderer", None)
        if (
            isinstance(prompt, dict)
            and "type" not in prompt
            and not kwargs.get("tokenization_kwargs")
            and hasattr(renderer, "render_cmpl_async")
        ):
            (prompt,) = await renderer.render_cmpl_async([prompt])
        return await add_request(self, request_id, prompt, params, *args, **kwargs)

    cls.add_request = add_request_rendered


def patch_engine_stage(module) -> bool:
    """Ray Data LLM's engine stage actor prestarts its engine core's process (``core_prestart``) as it imports the
    stage's module, before vLLM (``BEFORE_IMPORT``), or else first thing in the stage's constructor."""
    cls = getattr(module, "vLLMEngineStageUDF", None)
    if cls is not None and not getattr(cls, "_captionflow_patched", False):
        _wrap_init(cls, before=lambda _udf: core_prestart.prestart())
    return cls is not None


ACCEPTING = "vLLM engine accepting requests at"
# run as the module is imported, before its code: Ray Data LLM's engine stage module imports vLLM
BEFORE_IMPORT = {"ray.llm._internal.batch.stages.vllm_engine_stage": core_prestart.prestart_in_engine_actor}
PATCHES = {
    "vllm.v1.engine.input_processor": patch_input_processor,
    "vllm.v1.engine.async_llm": patch_async_llm,
    "vllm.v1.engine.utils": core_prestart.patch_engine_utils,
    "vllm.tokenizers.hf": tokenizer_pool.patch,
    "ray.llm._internal.batch.stages.vllm_engine_stage": patch_engine_stage,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of each module in PATCHES so that its patch runs
    right after the module has executed."""

    def __init__(self):
        self.seen: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES or name in self.seen:
            return None
        self.seen.add(name)
        if self.seen >= set(PATCHES):
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)  # the normal finders (we return None for a name seen)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            before = BEFORE_IMPORT.get(name)
            try:
                if before is not None:
                    before()
            except Exception as e:  # the module's own patch (PATCHES) still runs
                worker_log.say(f"{name}: what runs before it failed ({e!r})")
            exec_module(module)
            if not PATCHES[name](module):
                worker_log.say(f"{name} lacks the class captionflow patches; left as it is")

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Ray worker_process_setup_hook: patch the modules in PATCHES now if loaded, else on import."""
    for name, fn in PATCHES.items():
        if name in sys.modules:
            fn(sys.modules[name])
    if not all(n in sys.modules for n in PATCHES) and not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
