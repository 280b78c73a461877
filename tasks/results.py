"""Where Prefect keeps the stages' results, how they are keyed, and what the flow learns of each stage.

- Results are persisted under the output root (``<output>/.prefect-cache``, a filesystem block
  ``captionflow-results-<digest>`` holding no credentials), for every stage task of a flow run inside
  ``stage_results(output)``.
- Cache keys are content fingerprints (dataset, model, generation settings, judge), never the run id:
  a new run with the same inputs shows those stages as Cached and does no work. Each key is checked
  against storage before it is used (``validated``): when the outputs a cached result points at are gone
  or incomplete, the cached result is dropped and the stage runs again (the log says why).
- ``record_stage`` (a state hook on every stage task) tells the flow how each stage ended and how long
  it took, so that the flow body is the stage calls and the summary still knows what was cached.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

from captionflow.data.fingerprint import digest
from captionflow.data.layout import RESULTS_CACHE
from captionflow.data.storage import Store, storage_options
from captionflow.engines import run_log
from captionflow.results import StageRecord

CACHE_VERSION = "v3"  # bump when a persisted stage result changes type (or a class in it moves)
log = logging.getLogger("captionflow.data.cache")


def result_storage(output: str):
    """A Prefect filesystem block under the storage root for persisted task results (saved server-side,
    named after the root, without credentials: see ``storage.storage_options``)."""
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    store = Store(output)
    if store.is_local:
        block = LocalFileSystem(basepath=store.path(RESULTS_CACHE))
    else:
        block = RemoteFileSystem(basepath=store.url(RESULTS_CACHE), settings=storage_options(store.uri))
    block.save(name=f"captionflow-results-{digest(store.url())}", overwrite=True)
    return block


class StageLog:
    """How the stages of one flow run ended, in order."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.records: list[StageRecord] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


class _QuietHook(logging.Filter):
    """Prefect logs every hook it runs at INFO ("Running hook 'record_stage' ..."): twice per stage of
    bookkeeping that tells the user nothing. Other hooks' lines pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "'record_stage'" not in record.getMessage()


logging.getLogger("prefect.task_runs").addFilter(_QuietHook())

_STAGE_LOG: contextvars.ContextVar[Optional[StageLog]] = contextvars.ContextVar("captionflow_stages", default=None)


class stage_results:
    """Inside a flow run: persist the results of the stage tasks called in the ``with`` block under ``output``,
    record how each ended, and forward the engines' and Ray's key lines to the run's log (``run_log``).

    The result storage block is saved (a few API calls) on a thread from the moment this is made, so that a flow
    that makes it before its preflight (``caption_flow``) does not wait for it; ``with`` waits for it."""

    def __init__(self, output: str):
        self.output = output
        self._saved: list = []
        self._saving = threading.Thread(
            target=contextvars.copy_context().run, args=(self._save,), name="captionflow-result-storage", daemon=True
        )
        self._saving.start()
        self._exit = contextlib.ExitStack()

    def _save(self) -> None:
        try:
            self._saved.append(result_storage(self.output))
        except BaseException as e:  # raised where the block is needed
            self._saved.append(e)

    def __enter__(self) -> StageLog:
        from prefect.context import FlowRunContext
        from prefect.logging import get_run_logger

        self._saving.join()
        if isinstance(self._saved[0], BaseException):
            raise self._saved[0]
        ctx = FlowRunContext.get()
        stages = StageLog()
        token = _STAGE_LOG.set(stages)
        self._exit.callback(_STAGE_LOG.reset, token)
        try:
            store = ctx.result_store.model_copy(update={"result_storage": self._saved[0]})
            run_logger = get_run_logger()
            self._exit.enter_context(ctx.model_copy(update={"result_store": store}))
            self._exit.enter_context(run_log.forward_to(run_logger, api_only(run_logger)))
        except BaseException:
            self._exit.close()
            raise
        return stages

    def __exit__(self, *exc) -> bool:
        return bool(self._exit.__exit__(*exc))


def api_only(run_logger: logging.LoggerAdapter) -> logging.LoggerAdapter:
    """``run_logger``'s flow run, through a logger that sends to the Prefect API and prints nothing: for
    records that this process's console handlers print already."""
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger("prefect.captionflow")
    if not any(isinstance(h, APILogHandler) for h in logger.handlers):
        logger.addHandler(APILogHandler())
        logger.propagate = False
        logger.setLevel(logging.INFO)
    return logging.LoggerAdapter(logger, dict(run_logger.extra))


def record_stage(task, task_run, state) -> None:
    """State hook (completion and failure) of every stage task."""
    stages = _STAGE_LOG.get()
    if stages is None:
        return
    seconds = task_run.total_run_time.total_seconds() if state.name != "Cached" else 0.0
    if task_run.start_time and task_run.end_time and state.name != "Cached":
        seconds = (task_run.end_time - task_run.start_time).total_seconds()
    stages.records.append(StageRecord(name=task.name, state=state.name, seconds=seconds))


def validated(name: str, key: Callable[..., Optional[str]], missing: Callable[..., Optional[str]]):
    """A ``cache_key_fn``: ``key(**parameters)`` (None: do not cache), versioned; before it is used,
    ``missing(**parameters)`` says what of the stage's outputs storage lacks (None: nothing), and if
    anything, the cached result under that key is dropped so the stage runs again."""

    def cache_key(context, parameters: dict) -> Optional[str]:
        k = key(**parameters)
        if k is None:
            return None
        k = f"{name}-{CACHE_VERSION}-{k}"
        why = missing(**parameters)
        if why:
            store = Store(parameters["cfg"].output)
            if store.exists(RESULTS_CACHE, k):
                log.warning("%s: the cached result no longer matches storage (%s): running the stage again", name, why)
                store.remove(RESULTS_CACHE, k)
        return k

    return cache_key
