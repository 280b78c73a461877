"""What a run's log shows of the machinery under it: the key lines of the engines and Ray workers, Ray Data's
warnings, and captionflow's own lines, forwarded to one sink logger (the Prefect flow run's logger).

Ray streams every worker's stdout/stderr to the driver; captionflow keeps that stream off the driver's
stdout (a vLLM engine writes hundreds of lines; each worker's full output stays in Ray's session logs,
``/tmp/ray/session_latest/logs``) and forwards only the lines that tell the story:

- engine ready (vLLM's ``init engine ... took``, captionflow's ``AsyncLLM accepting requests``), model
  loading and compile times, vLLM's throughput lines;
- errors: a line at vLLM's ERROR level, an exception's last line, a worker killed for memory (at DEBUG from a worker
  whose stage has every result it waited for: ``engines_at_work``, or whose engine's client has begun its orderly
  shutdown: its shutdown is not the run's error);
- Ray Data's warnings from the driver (``The job may hang forever unless the cluster scales up``);
- captionflow's own log records (watchdog, cache, lease, service) at INFO and above.

``forward_to(lines, records)`` sets the sinks for the duration of a flow run (outside one, nothing is
forwarded): worker lines go to ``lines``; driver records, which this process's own handlers already print,
go to ``records`` (for Prefect: the API only, so the console does not show them twice).
A Ray Client connection (``ray://``) streams worker output its own way: only the driver's lines are
forwarded there.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any, Optional

HANDLER = "captionflow-run-log"

# (pattern, level) of the worker lines worth the run's log; the first that matches decides
KEY_LINES = [
    (re.compile(r"\bERROR\b|\b[A-Z]\w*(?:Error|Exception): |OutOfMemory|out of memory|was killed"), logging.ERROR),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\) took"), logging.INFO),
    (re.compile(r"accepting requests|Model loading took|torch\.compile takes|compiled graph"), logging.INFO),
    (re.compile(r"Avg prompt throughput|Avg generation throughput"), logging.INFO),
    (re.compile(r"^captionflow \d\d:\d\d:\d\d: "), logging.INFO),  # captionflow's own worker lines
]
# worker lines that look like errors but are not the run's: dropped before KEY_LINES
NOISE = [
    # the GCS of a Ray that outlives runs (the warm engine service's) reaping a finished run's actors whose
    # processes already exited
    re.compile(r"gcs_actor_scheduler\.cc:\d+: Failed to kill actor .*Socket closed"),
    # Python's multiprocessing resource tracker, as an engine's processes exit: a shared-memory segment another
    # process of the engine had already released (cpython gh-82300), never a fault of the run
    re.compile(r"^KeyError: '/(?:psm_|mp-)[\w-]+'$"),
]
# an engine front end's client shutting its engine down (vLLM's "[shutdown] MPClient: ..." lines): the error lines
# that follow from that worker are its shutdown's (the output handler meeting its core gone), not the run's
SHUTTING_DOWN = re.compile(r"\] \[shutdown\] MPClient: ")
_VLLM_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:INFO|WARNING|ERROR|DEBUG) \d\d-\d\d [\d:]+ \[[^\]]+\] ")

# the current (lines, records) sinks, each a logging.Logger or LoggerAdapter; empty: forward nothing
_SINK: list[tuple[Any, Any]] = []
# workers heard from while a stage waited on them (_AT_WORK), and those whose stage has every result it waited for
# (_DONE): their error lines come from the engines shutting down (EngineDeadError, a front end whose core is gone
# first), not from the run's work
_AT_WORK: list[set] = []
_DONE: set = set()


@contextlib.contextmanager
def engines_at_work() -> Iterator[None]:
    """Around a stage's wait for its workers' results: the error lines of the workers heard from meanwhile that
    arrive after it (their shutdown) are forwarded at DEBUG, so a completed run's log has no ERROR line that is not
    the run's (Ray's session logs keep every line). The next stage's workers are other processes: theirs stay
    errors."""
    seen: set = set()
    _AT_WORK.append(seen)
    try:
        yield
    finally:
        _AT_WORK.remove(seen)
        _DONE.update(seen)


def key_line(line: str) -> Optional[tuple[int, str]]:
    """(level, text) when a worker's output line is one of the key lines, else None."""
    if any(p.search(line) for p in NOISE):
        return None
    for pattern, level in KEY_LINES:
        if pattern.search(line):
            return level, _VLLM_PREFIX.sub("", line.strip())[:500]
    return None


def _send(which: int, level: int, msg: str, *args: Any) -> None:
    if _SINK:
        with contextlib.suppress(Exception):  # the log must never break a run
            _SINK[-1][which].log(level, msg, *args)


def _on_worker_lines(data: dict) -> None:
    """Ray's stdstream dispatcher calls this (in the driver's log thread) with a batch of a worker's lines."""
    if not _SINK:
        return
    who = data.get("actor_name") or data.get("task_name") or ("raylet" if data.get("pid") == "raylet" else "worker")
    pid = data.get("pid")
    finished = pid in _DONE  # a worker of a stage that has every result it waited for: shutting down
    for seen in [] if finished else _AT_WORK:
        seen.add(pid)
    for line in data.get("lines") or []:
        if not finished and SHUTTING_DOWN.search(line):
            finished = True  # the engine's orderly shutdown: its error lines from here on are not the run's
            _DONE.add(pid)
        hit = key_line(line)
        if hit:
            level = logging.DEBUG if hit[0] >= logging.ERROR and finished else hit[0]
            _send(0, level, "%s (pid %s): %s", who, data.get("pid"), hit[1])


class _Forward(logging.Handler):
    """Driver-side records (Ray Data's warnings, captionflow's loggers) to the sink."""

    def __init__(self, level: int):
        super().__init__(level)

    def emit(self, record: logging.LogRecord) -> None:
        _send(1, record.levelno, "%s: %s", record.name, record.getMessage())


_RAY_DATA = _Forward(logging.WARNING)
_CAPTIONFLOW = _Forward(logging.INFO)


def take_worker_output(replace_printing: bool) -> None:
    """Once Ray is connected in this process: forward the workers' key lines. ``replace_printing``: also
    stop Ray printing every worker line to this process's stdout (only for a Ray captionflow connected)."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:  # another Ray: the lines stay in Ray's logs
        return
    if replace_printing:
        dispatcher.remove_handler("ray_print_logs")
    dispatcher.remove_handler(HANDLER)
    dispatcher.add_handler(HANDLER, _on_worker_lines)


@contextlib.contextmanager
def forward_to(lines: Any, records: Optional[Any] = None) -> Iterator[None]:
    """Inside this block, forward the workers' key lines to ``lines`` and the driver's records to ``records``
    (default ``lines``): loggers or adapters (anything with ``.log``)."""
    sink = (lines, records if records is not None else lines)
    if not _SINK:
        _DONE.clear()  # a new run: no stage of it has finished yet
    _SINK.append(sink)
    ray_data, ours = logging.getLogger("ray.data"), logging.getLogger("captionflow")
    level = ours.level
    ray_data.addHandler(_RAY_DATA)
    ours.addHandler(_CAPTIONFLOW)
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    try:
        yield
    finally:
        _SINK.remove(sink)
        if not _SINK:
            ray_data.removeHandler(_RAY_DATA)
            ours.removeHandler(_CAPTIONFLOW)
            ours.setLevel(level)
