"""Put this folder first on PYTHONPATH with CF_DIAG_DIR set: every Python process (Ray workers
included) that imports vLLM records (a) bench/diag_processor_cache.py's processor-cache misses and
(b) call counts and timings of a few front-end functions (first start, last end, total and max
duration), written to CF_DIAG_DIR/diag-<pid>.json every 2 s. A diagnostic, never for production."""
import os
import sys
import threading
import time

TIMED = [  # (module, class or "", function)
    ("vllm.v1.engine.async_llm", "AsyncLLM", "add_request"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "generate"),
    ("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs"),
    ("vllm.transformers_utils.processor", "", "get_processor"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs"),
    ("vllm.v1.engine.core_client", "AsyncMPClient", "add_request_async"),
    ("vllm.v1.engine.core", "EngineCore", "add_request"),
    ("vllm.v1.engine.core", "EngineCore", "step"),
    ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue"),
    ("vllm.v1.engine.core", "EngineCoreProc", "preprocess_add_request"),
    ("captionflow.vllm_warmup", "", "start_warmup"),
    ("ray.llm._internal.batch.stages.vllm_engine_stage", "vLLMEngineStageUDF", "__init__"),
    ("ray.llm._internal.batch.stages.vllm_engine_stage", "vLLMEngineStageUDF", "udf"),
    ("ray.llm._internal.batch.stages.prepare_multimodal_stage", "PrepareMultimodalUDF", "udf"),
    ("ray.llm._internal.batch.stages.chat_template_stage", "ChatTemplateUDF", "udf"),
]


def _wrap(stats: dict, owner, name: str, label: str) -> None:
    import functools
    import inspect

    fn = getattr(owner, name)
    st = stats.setdefault(label, {"n": 0, "first_start": None, "last_end": None, "total_s": 0.0, "max_s": 0.0})

    def note(t0: float) -> None:
        t1 = time.time()
        st["n"] += 1
        st["first_start"] = st["first_start"] or t0
        st["last_end"] = t1
        st["total_s"] += t1 - t0
        st["max_s"] = max(st["max_s"], t1 - t0)

    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def w(*a, **k):
            t0 = time.time()
            try:
                async for x in fn(*a, **k):
                    yield x
            finally:
                note(t0)
    elif inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def w(*a, **k):
            t0 = time.time()
            try:
                return await fn(*a, **k)
            finally:
                note(t0)
    else:
        @functools.wraps(fn)
        def w(*a, **k):
            t0 = time.time()
            try:
                return fn(*a, **k)
            finally:
                note(t0)
    setattr(owner, name, w)


if os.environ.get("CF_DIAG_DIR"):

    def _watch():
        import json

        stats: dict = {}
        done: set = set()
        rec = None
        path = os.path.join(os.environ["CF_DIAG_DIR"], f"diag-{os.getpid()}.json")
        while True:
            time.sleep(0.2 if rec is None else 2.0)
            for mod, cls, fn in TIMED:
                key = (mod, cls, fn)
                m = sys.modules.get(mod)
                if key in done or m is None or (cls and not hasattr(m, cls)) or (not cls and not hasattr(m, fn)):
                    continue
                try:
                    if fn == "get_processor":  # the lru_cache holds the function: wrap the cache instead
                        from bench.diag_processor_cache import instrument

                        rec = instrument()
                    else:
                        _wrap(stats, getattr(m, cls) if cls else m, fn, f"{cls}.{fn}" if cls else fn)
                except Exception as e:  # a diagnostic must never break the process
                    stats[f"wrap-error {fn}"] = repr(e)
                done.add(key)
            if not stats and rec is None:
                continue
            out = {"pid": os.getpid(), "written": time.time(), "timed": stats,
                   "proc_title": open(f"/proc/{os.getpid()}/cmdline", "rb").read()[:200].decode(errors="replace")}
            if rec is not None:
                from bench.diag_processor_cache import summarise

                out["processor_cache"] = summarise(rec)
            with open(path + ".tmp", "w") as f:
                json.dump(out, f, default=str)
            os.replace(path + ".tmp", path)

    threading.Thread(target=_watch, daemon=True, name="cf-diag").start()
