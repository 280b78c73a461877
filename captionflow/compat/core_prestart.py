"""Start the vLLM engine core's process while its front end is still starting.

A vLLM front end (``AsyncLLM``) starts its engine core in a new process (multiprocessing's ``spawn``, as vLLM does
inside a Ray actor) once it has imported vLLM, built the engine's configuration and its renderer; that process then
imports vLLM again before it loads the model. On the H100 host each import takes ~25 s, one after the other, on
every cold start. ``prestart`` spawns the process early - an engine actor calls it first thing in its stage's
constructor - and the process imports vLLM's engine core while the front end builds its configuration and renderer,
then waits. When vLLM's ``CoreEngineProcManager`` asks its multiprocessing context for the core's process
(``get_mp_context`` patched by ``patch_engine_utils``), it is handed that process; ``start()`` sends it the target,
its arguments (pickled at that moment, as ``spawn`` pickles them) and the environment of that moment, and the
process runs the core as a freshly spawned one would. Anything that differs from that case - no prestarted process,
one that died, another start method, another target, arguments that can only pass by inheritance - gets vLLM's own
path. Can go when vLLM starts its core before its front end's own set-up.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.spawn
import os
import sys
import threading
from typing import Any

from captionflow.workers import worker_log

IDLE_EXIT_S = 900.0  # a prestarted process nobody asked for ends after this
CORE_TARGET = "run_engine_core"
HANDOFF_THREAD = "captionflow-core-handoff"
PROCESSOR_THREAD = "captionflow-core-processor"

ENGINE_ACTOR = "MapBatches(vLLMEngineStageUDF)"  # in the name of Ray Data LLM's engine stage actor's tasks
HANDOFF_WAIT_S = 300.0  # the longest a front end's background start-up work waits for its core's hand-off

_lock = threading.Lock()
_waiting: list[tuple[Any, Any]] = []  # (process, the pipe's sending end): at most one
_prestarted = threading.Event()  # this process prestarted a core
_handed_off = threading.Event()  # ... and the core has its work (or vLLM started its own, or the process exits)


def prestart() -> None:
    """Spawn a process that imports vLLM's engine core now and then waits to be told to run it (once per process)."""
    with _lock:
        if _waiting:
            return
        _prestarted.set()
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_wait_for_core, args=(receive,), name="EngineCore")
        process.start()
        receive.close()
        _waiting.append((process, send))
    atexit.register(_dismiss)


def prestart_in_engine_actor() -> bool:
    """``prestart`` where this process is Ray Data LLM's own engine stage actor (its creation task's name says so).

    Called as the actor imports Ray Data LLM's engine stage module, which imports vLLM (~12 s on the H100 host)
    before the stage's constructor runs: the core's process then imports vLLM alongside it instead of after it.
    A subclass of the stage (an actor whose engine attaches to a core started elsewhere) has another name."""
    try:
        import ray

        name = ray.get_runtime_context().get_task_name() if ray.is_initialized() else None
    except Exception:  # not in a Ray worker as Ray 2.60 has it: the stage's constructor prestarts, as before
        return False
    if not name or ENGINE_ACTOR not in name:
        return False
    prestart()
    return True


def after_handoff(timeout: float = HANDOFF_WAIT_S) -> None:
    """Return once this process's prestarted core has its work (at once where it prestarted none).

    A front end's start-up work that can run in the background (tokenizer copies, the HF processor's pre-build)
    waits here: before the hand-off it takes the GIL from the front end's own start-up (its configuration, its
    renderer), which the hand-off waits for, and so delays the core's start; after it, the core loads the model and
    warms up for far longer than that work takes."""
    if _prestarted.is_set():
        _handed_off.wait(timeout)


def release() -> None:
    """Nothing waits for a hand-off any more (the front end is up, or the core started another way)."""
    _handed_off.set()


def _dismiss() -> None:
    """At exit: an unused prestarted process is told to go (multiprocessing joins its children at exit)."""
    release()
    with _lock:
        while _waiting:
            process, send = _waiting.pop()
            send.close()  # its recv ends
            process.join(5)
            if process.is_alive():
                process.kill()


def _take() -> tuple[Any, Any] | None:
    with _lock:
        if not _waiting:
            return None
        process, send = _waiting.pop()
    if process.is_alive():
        return process, send
    send.close()
    return None


def _wait_for_core(receive) -> None:
    """The prestarted process: import what the core runs, wait for the work, run it as a spawned core would."""
    _end_with_parent(os.getppid())
    import vllm.v1.engine.core  # noqa: F401  - what ~25 s of the core's start-up went to

    if not receive.poll(IDLE_EXIT_S):
        return
    try:
        target, name, args, kwargs, env = receive.recv()
    except EOFError:  # the actor went or dismissed it
        return
    receive.close()
    os.environ.clear()
    os.environ.update(env)
    multiprocessing.current_process().name = name
    _before_core(kwargs.get("vllm_config"))
    target(*args, **kwargs)


def _end_with_parent(parent: int, every_s: float = 1.0) -> None:
    """End this process (and its vLLM workers) within ``every_s`` of its engine actor's: a core whose actor was
    killed (SIGKILL, a node's Ray ended, a cancelled run) was re-parented and lived on, ~1.3 GB with its worker,
    for as long as it was watched (17 min)."""

    def watch() -> None:
        import time

        while os.getppid() == parent:
            time.sleep(every_s)
        try:
            import psutil

            for child in psutil.Process().children(recursive=True):
                child.kill()
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="captionflow-core-parent-watch", daemon=True).start()


def _before_core(vllm_config) -> None:
    """What the core's process sets up in vLLM before the core starts (its environment is the front end's now)."""
    from captionflow.compat import sampler_warmup

    try:
        if sampler_warmup.install():
            worker_log.say("engine core: the warm-up samples with the run's sampling settings")
    except Exception as e:  # vLLM's own warm-up then: slower on an empty Triton cache, never wrong
        worker_log.say(f"engine core: vLLM's own sampler warm-up ({e!r})")
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "is_multimodal_model", False):
        _build_processor_after_loading(model_config)


def _build_processor_after_loading(model_config) -> None:
    """Once the core has loaded the model, load its HF processor (and tokenizer) into vLLM's caches in a thread while
    the core profiles, sizes its KV cache, captures CUDA graphs and warms up.

    The core's scheduler builds the multimodal processor after all that (vLLM 0.26: 2-4 s at the end of a cold
    engine's start on the H100 host); its loads go through vLLM's ``lru_cache``s (``cached_tokenizer_from_config``,
    ``cached_processor_from_config``), which the thread fills beforehand with the same arguments. The thread starts
    only once the model is loaded: the model's modules, imported meanwhile by the core, import each other in cycles
    that a second importing thread can break (an ImportError in the core, seen on the H100 host). A load still under
    way when the scheduler asks is loaded again there, as without this; a failure in the thread is only logged."""
    from vllm.v1.engine import core

    initialize = getattr(core.EngineCore, "_initialize_kv_caches", None)
    if initialize is None or getattr(initialize, "_captionflow_patched", False):
        return

    def initialize_kv_caches(self, *args, **kwargs):
        threading.Thread(target=_build_processor, args=(model_config,), name=PROCESSOR_THREAD, daemon=True).start()
        return initialize(self, *args, **kwargs)

    initialize_kv_caches._captionflow_patched = True
    core.EngineCore._initialize_kv_caches = initialize_kv_caches


def _build_processor(model_config) -> None:
    import time

    started = time.monotonic()
    try:
        from vllm.multimodal import MULTIMODAL_REGISTRY

        # Twice: the processor's cache key holds the tokenizer, and the core may have loaded its own meanwhile (the
        # tokenizer cache keeps the first one loaded): the second build is then keyed on the one the scheduler gets.
        for _ in range(2):
            MULTIMODAL_REGISTRY.get_processing_info(model_config).get_hf_processor()
    except Exception as e:
        worker_log.say(f"engine core: the multimodal processor was not built ahead ({e!r})")
        return
    worker_log.say(f"engine core: the multimodal processor was built ahead in {time.monotonic() - started:.1f} s")


def _deliver(send, work: bytes) -> None:
    try:
        send.send_bytes(work)
    except OSError:  # the process died: vLLM's wait for its core sees it and says so
        pass
    finally:
        send.close()


class _Handoff:
    """Stands in for the ``Process`` vLLM asked its context for: ``start()`` hands the work to the prestarted
    process (or, if that died meanwhile, starts vLLM's own); everything else is the process's."""

    def __init__(self, ctx, taken, target, name, args, kwargs):
        self._ctx, self._taken = ctx, taken
        self._work = (target, name, args, kwargs)
        self._process = taken[0]

    def start(self) -> None:
        from multiprocessing.reduction import ForkingPickler

        process, send = self._taken
        target, name, args, kwargs = self._work
        try:
            if not process.is_alive():
                raise BrokenPipeError("the prestarted process is gone")
            work = ForkingPickler.dumps((target, name, args, kwargs, dict(os.environ)))  # as spawn pickles, now
        except Exception as e:  # gone, or arguments that cannot be sent: vLLM's own path
            send.close()
            worker_log.say(f"engine core: the prestarted process was not used ({e!r}); starting one as vLLM does")
            self._process = self._ctx.Process(target=target, name=name, args=args, kwargs=kwargs)
            self._process.start()
            release()
            return
        # Written by a thread: the process reads once its imports are done, and vLLM's own wait for its core (with
        # its time limit, watching the process) starts when this returns.
        handoff = threading.Thread(target=_deliver, args=(send, bytes(work)), name=HANDOFF_THREAD, daemon=True)
        handoff.start()
        release()
        worker_log.say(f"engine core: runs in the process prestarted for it (pid {process.pid})")

    def __getattr__(self, attr):
        return getattr(self._process, attr)


class _PrestartingContext:
    """A multiprocessing context that hands out the prestarted process for the engine core's target."""

    def __init__(self, ctx):
        self._ctx = ctx

    def Process(self, group=None, target=None, name=None, args=(), kwargs=None, *, daemon=None):
        kwargs = dict(kwargs or {})
        usable = (
            getattr(target, "__name__", "") == CORE_TARGET
            and self._ctx.get_start_method() == "spawn"
            and not daemon
            and kwargs.get("tensor_queue") is None  # a queue passes to a child only by inheritance
            and _plain_executable()  # vLLM may wrap it (NUMA binding)
        )
        taken = _take() if usable else None
        if taken is None:
            if getattr(target, "__name__", "") == CORE_TARGET:
                release()  # the core starts as vLLM starts it
            return self._ctx.Process(group=group, target=target, name=name, args=args, kwargs=kwargs, daemon=daemon)
        return _Handoff(self._ctx, taken, target, name or "EngineCore", args, kwargs)

    def __getattr__(self, attr):
        return getattr(self._ctx, attr)


def _plain_executable() -> bool:
    exe = multiprocessing.spawn.get_executable()
    return exe is None or os.fsdecode(exe) == sys.executable


def patch_engine_utils(module) -> bool:
    """Make ``module`` (``vllm.v1.engine.utils``) start its engine cores in a prestarted process where there is one."""
    get_mp_context = getattr(module, "get_mp_context", None)
    if get_mp_context is None:
        return False
    if not getattr(get_mp_context, "_captionflow_patched", False):

        def prestarting_mp_context(*args, **kwargs):
            return _PrestartingContext(get_mp_context(*args, **kwargs))

        prestarting_mp_context._captionflow_patched = True
        module.get_mp_context = prestarting_mp_context
    return True
