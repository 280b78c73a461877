"""vLLM's thread-safe tokenizer pools: filled in the background, copied cheaply, and made once per front end.

vLLM (0.26 to 0.32 at least) makes a front end's tokenizer thread-safe with ``maybe_make_thread_pool``: it
deep-copies the tokenizer ``copies`` times (``renderer_num_workers + 1``) before returning, and every copy of such a
tokenizer makes all its copies again. Three things made that the longest part of an engine's start on the H100 host
(Qwen2.5-VL tokenizer, 8 renderer threads):

- The copies were made before the engine core started (~22 s for the renderer's 9). ``patch`` makes the pool empty
  and returns at once; one daemon thread per process then makes the copies while the engine core loads, and
  ``filled`` waits for them: the front end says it accepts requests only once they are made (``vllm_warmup``), as
  vLLM's own path has them made by then. Made while it served instead, they starved its event loop.
- Each copy deep-copied the vocabulary and merges the tokenizer keeps from its construction (151k entries each,
  read by nothing afterwards: the Rust tokenizer holds its own): ~1.2 s a copy. Copies share them (``_copy``):
  ~0.5 s, the Rust tokenizer's own copy.
- Building the HF processor deep-copies its keyword arguments twice (transformers' ``get_config_dict`` and the
  tokenizer's ``init_kwargs``), the pooled tokenizer among them, and each such copy made a whole new pool: 4 pools,
  ~40 copies per front end, ~55-70 s of copying. A copy of a pooled tokenizer now shares its pool (the same
  thread-safe copies, borrowed one per call as before); only an unpickled one, in another process, gets its own.

Where vLLM's pool is not built as expected (its internals differ), the pool is left to grow on demand and the line
says so. Can go when vLLM makes these copies lazily and once itself.
"""

from __future__ import annotations

import copy
import functools
import queue
import threading
import time
from typing import Any

from captionflow.compat import core_prestart
from captionflow.workers import worker_log

FILL_THREAD = "captionflow-tokenizer-copies"


def _cell(fn: Any, name: str) -> Any:
    """The value ``fn`` closes over under ``name`` (ValueError: it closes over no such name)."""
    code = fn.__code__
    return fn.__closure__[code.co_freevars.index(name)].cell_contents


def pool_of(tokenizer: Any) -> tuple[Any, queue.Queue] | None:
    """(the tokenizer the copies are made from, the pool's queue) of a tokenizer that ``maybe_make_thread_pool``
    made thread-safe; None where it is not built as vLLM 0.26-0.32 builds it."""
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


# What a tokenizers-backed tokenizer keeps from its construction only: copies share these.
_INIT_DATA = ("_vocab", "_merges")


def _shared(tokenizer: Any, memo: dict) -> dict:
    """``memo`` (a deepcopy memo) with ``tokenizer``'s construction data mapped to itself: not copied."""
    for name in _INIT_DATA:
        value = getattr(tokenizer, "__dict__", {}).get(name)
        if value is not None:
            memo.setdefault(id(value), value)
    return memo


def _copy(tokenizer: Any) -> Any:
    """A deep copy of a plain tokenizer that shares its construction data (``_INIT_DATA``)."""
    return copy.deepcopy(tokenizer, _shared(tokenizer, {}))


def _fill(source: Any, pool: queue.Queue, copies: int) -> None:
    t0 = time.perf_counter()
    for _ in range(copies):
        pool.put(_copy(source))
    worker_log.say(f"tokenizer: {copies} thread copies made in the background in {time.perf_counter() - t0:.1f} s")


def _work() -> None:
    core_prestart.after_handoff()  # not while the front end starts its engine core
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


def _twin(self: Any) -> Any:
    """A shallow copy of a pooled tokenizer: the same pool."""
    twin = object.__new__(type(self))
    twin.__dict__.update(self.__dict__)
    return twin


def _deep_twin(self: Any, memo: dict) -> Any:
    """A deep copy of a pooled tokenizer: its own state (construction data shared, as ``_copy``), the same pool."""
    twin = object.__new__(type(self))
    memo[id(self)] = twin
    twin.__dict__.update(copy.deepcopy(self.__dict__, _shared(self, memo)))
    return twin


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
        cls = type(pooled)  # vLLM's class for this pool: its methods borrow from this pool
        # a copy shares the pool; an unpickled one is rebuilt through the module's (patched) function, same size
        cls.__copy__, cls.__deepcopy__ = _twin, _deep_twin
        cls.__reduce__ = lambda self: (module.maybe_make_thread_pool, (source, copies))
        _submit(source, pool, copies)
        return pooled

    make_in_background._captionflow_patched = True
    module.maybe_make_thread_pool = make_in_background
    return True
