"""Whether a process recorded earlier (a lease holder, a warm service, an engine core's host) still runs.

Process numbers are reused, so a process is recorded as its pid and its start time, and is alive only if that
very process runs (and is not a zombie its parent has not reaped yet).
"""

from __future__ import annotations

from typing import Optional


def process_started(pid: int) -> Optional[float]:
    """The start time of process ``pid`` (None: no such process)."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def alive(pid: int, started: Optional[float] = None) -> bool:
    """The process runs, and is the one started at ``started`` (when given)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if started is not None and abs(proc.create_time() - started) > 1.0:
            return False
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
