"""vLLM's thread-safe tokenizer pools, filled in the background instead of before the engine core starts.

vLLM (0.26 to 0.29 at least) makes a front end's tokenizer thread-safe with ``maybe_make_thread_pool``: it
deep-copies the tokenizer ``copies`` times (``renderer_num_workers + 1``) before returning, and a copy of such a
tokenizer (the HF processor vLLM builds takes one) makes all its copies again. On the H100 host, with a Qwen2.5-VL
tokenizer and 8 renderer threads, the front end spent ~22 s making the renderer's 9 copies before it started its
engine core, and the HF processor's build ~56 s more. ``patch`` makes the pool empty and returns at once; a daemon
thread then makes the copies while the engine core loads and compiles. A thread that finds the pool empty meanwhile
makes its own copy, which is vLLM's own behaviour when more threads than copies use the tokenizer. A copy of a pooled
tokenizer gets a pool of the same size, filled the same way.

One thread per process makes every pool's copies, one pool after another, and ``filled`` waits for them: the engine
front end says it accepts requests only once they are made (``vllm_warmup``), as vLLM's own path has them made by
then. Made while it served instead (several copying threads at once), they starved its event loop: on the H100 host
with a warm compile cache, 4 pools per engine were still being copied ~45 s after the engines accepted, and the first
caption came only then.

Where vLLM's pool is not built as expected (its internals differ), the pool is left to grow on demand and the line
says so. Can go when vLLM makes these copies lazily itself.
"""

from __future__ import annotations

import copy
import functools
import queue
import threading
import time
from typing import Any

from captionflow.workers import worker_log

FILL_THREAD = "captionflow-tokenizer-copies"


def _cell(fn: Any, name: str) -> Any:
    """The value ``fn`` closes over under ``name`` (ValueError: it closes over no such name)."""
    code = fn.__code__
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def pool_of(tokenizer: Any) -> tuple[Any, queue.Queue] | None:
    """(the tokenizer the copies are made from, the pool's queue) of a tokenizer that ``maybe_make_thread_pool``
    made thread-safe; None where it is not built as vLLM 0.26-0.29 builds it."""
    try:
        borrow = _cell(type(tokenizer).encode, "_borrow_from_pool")
        make = borrow.__wrapped__  # contextlib.contextmanager keeps the generator function there
        source, pool = _cell(make, "og_tokenizer"), _cell(make, "tokenizer_pool")
    except (AttributeError, TypeError, ValueError, IndexError):
        return None
    return (source, pool) if isinstance(pool, queue.Queue) else None


_jobs: queue.Queue = queue.Queue()  # (the tokenizer to copy, its pool, how many copies)
_worker: list[threading.Thread] = []
_worker_lock = threading.Lock()


def _fill(source: Any, pool: queue.Queue, copies: int) -> None:
    t0 = time.perf_counter()
    for _ in range(copies):
        pool.put(copy.deepcopy(source))
    worker_log.say(f"tokenizer: {copies} thread copies made in the background in {time.perf_counter() - t0:.1f} s")


def _work() -> None:
    while True:
        job = _jobs.get()
        try:
            _fill(*job)
        except Exception as e:  # the pool then grows as threads ask, as vLLM's does
            worker_log.say(f"tokenizer: thread copies not made ({e!r}); made as threads ask")
        finally:
            _jobs.task_done()


def _submit(source: Any, pool: queue.Queue, copies: int) -> None:
    with _worker_lock:
        if not _worker:
            _worker.append(threading.Thread(target=_work, name=FILL_THREAD, daemon=True))
            _worker[0].start()
    _jobs.put((source, pool, copies))


def filled() -> None:
    """Return once every pool asked for so far in this process has its copies."""
    _jobs.join()


def patch(module: Any) -> bool:
    """Make ``module`` (``vllm.tokenizers.hf``) fill its tokenizer pools in the background (False: it lacks what
    this patches)."""
    make = getattr(module, "maybe_make_thread_pool", None)
    backend = getattr(module, "TokenizersBackend", None)
    safe = getattr(module, "ThreadSafeHFTokenizerMixin", None)
    if make is None or backend is None or safe is None:
        return False
    if getattr(make, "_captionflow_patched", False):
        return True

    @functools.wraps(make)
    def make_in_background(tokenizer, copies: int = 1):
        if copies < 1 or not isinstance(tokenizer, backend) or isinstance(tokenizer, safe):
            return make(tokenizer, copies)  # nothing to copy: vLLM's own path
        pooled = make(tokenizer, 0)  # thread-safe, with an empty pool
        found = pool_of(pooled)
        if found is None:
            worker_log.say("tokenizer: vLLM's pool is not the one captionflow knows; copies are made as threads ask")
            return pooled
        source, pool = found
        # a copy or an unpickled pool is rebuilt through the module's (patched) function with the same size
        type(pooled).__reduce__ = lambda self: (module.maybe_make_thread_pool, (source, copies))
        _submit(source, pool, copies)
        return pooled

    make_in_background._captionflow_patched = True
    module.maybe_make_thread_pool = make_in_background
    return True
