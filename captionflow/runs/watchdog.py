"""A stage that waits on Ray says what it waits on, and does not wait forever.

``Watchdog`` runs beside a driver loop that pulls results from a Ray Data pipeline: every ``every_s`` it
logs how far the stage got and what the cluster offers (a stage whose engines cannot be placed shows up
as "0 of 1 GPU available"); when no result arrived for ``limit_s`` it ends the wait by raising
``StageStalled`` in the waiting thread, with what it was waiting for. The thread is interrupted with
``PyThreadState_SetAsyncExc``: Ray's iterators wait in Python with short timeouts, so it lands promptly.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import Optional

from captionflow.errors import CaptionflowError

log = logging.getLogger("captionflow.watchdog")


class StageStalled(CaptionflowError, TimeoutError):
    """No result for longer than the stage's stall limit."""


def _cluster_line() -> str:
    try:
        import ray

        if not ray.is_initialized():
            return ""
        total, free = ray.cluster_resources(), ray.available_resources()
        parts = [f"{free.get(k, 0.0):g} of {total[k]:g} {k} free" for k in ("CPU", "GPU") if total.get(k)]
        return "; Ray: " + ", ".join(parts) if parts else ""
    except Exception:
        return ""


class Watchdog:
    """``with Watchdog("inference", limit_s=1800, status=lambda: "12 of 40 rows committed") as w:`` then
    ``w.tick()`` whenever a result arrives."""

    def __init__(self, what: str, limit_s: float, status: Callable[[], str], every_s: float = 60.0):
        self.what, self.limit_s, self.status, self.every_s = what, limit_s, status, every_s
        self.last = time.monotonic()
        self.started = False  # a first result came
        self.reason: Optional[str] = None
        self._stop = threading.Event()
        self._target = threading.get_ident()
        self._thread = threading.Thread(target=self._run, name=f"captionflow-watchdog-{what}", daemon=True)

    def tick(self) -> None:
        self.last = time.monotonic()
        self.started = True

    def _run(self) -> None:
        while not self._stop.wait(min(self.every_s, max(self.limit_s / 4, 0.05))):
            idle = time.monotonic() - self.last
            # the engines start first (a minute or more): before the first result, a wait is news, not a warning
            if not self.started and self.every_s <= idle < self.limit_s:
                log.info("%s: %s; no result yet, %.0f s after it began%s", self.what, self.status(), idle,
                         _cluster_line())  # fmt: skip
                continue
            line = f"{self.what}: {self.status()}; last result {idle:.0f} s ago{_cluster_line()}"
            if idle >= self.limit_s and not self._stop.is_set():
                self.reason = (
                    f"{self.what} stalled: no result for {idle:.0f} s (stall_timeout_s={self.limit_s:g}); "
                    f"{self.status()}{_cluster_line()}"
                )
                log.error("%s", self.reason)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), ctypes.py_object(StageStalled))
                return
            if idle >= self.every_s:
                log.warning("%s", line)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._stop.set()
        self._thread.join(timeout=5)
        if exc_type is StageStalled and self.reason:
            raise StageStalled(self.reason) from None
        if self.reason:  # fired as the loop ended anyway: drop the exception still pending for this thread
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._target), None)
        return False
