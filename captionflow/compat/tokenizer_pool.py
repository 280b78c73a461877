"""vLLM's thread-safe tokenizer pools, filled in the background instead of before the engine core starts.

vLLM (0.26 to 0.29 at least) makes a front end's tokenizer thread-safe with ``maybe_make_thread_pool``: it
deep-copies the tokenizer ``copies`` times (``renderer_num_workers + 1``) before returning, and a copy of such a
tokenizer (the HF processor vLLM builds takes one) makes all its copies again. On the H100 host, with a Qwen2.5-VL
tokenizer and 8 renderer threads, the front end spent ~22 s making the renderer's 9 copies before it started its
engine core, and the HF processor's build ~56 s more. ``patch`` makes the pool empty and returns at once; a daemon
thread then makes the copies while the engine core loads and compiles. A thread that finds the pool empty meanwhile
makes its own copy, which is vLLM's own behaviour when more threads than copies use the tokenizer. A copy of a pooled
tokenizer gets a pool of the same size, filled the same way.

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


def _fill(source: Any, pool: queue.Queue, copies: int) -> None:
    t0 = time.perf_counter()
    for _ in range(copies):
        pool.put(copy.deepcopy(source))
    worker_log.say(f"tokenizer: {copies} thread copies made in the background in {time.perf_counter() - t0:.1f} s")


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
        threading.Thread(target=_fill, args=(source, pool, copies), name=FILL_THREAD, daemon=True).start()
        return pooled

    make_in_background._captionflow_patched = True
    module.maybe_make_thread_pool = make_in_background
    return True
