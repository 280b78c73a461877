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


def end_with_this_process(child: int) -> None:
    """Starts a small guard process (its own session: a terminal's signals to this process group do not reach it)
    that ends process ``child`` - SIGTERM, then SIGKILL 5 s later - once this process is gone, however it went
    (``kill -9`` included), and itself ends with ``child``. For the children that would outlive it otherwise: a
    run's temporary Prefect server (~200 MB) stayed up whenever its driver was killed."""
    import os
    import subprocess
    import sys

    me = os.getpid()
    subprocess.Popen(
        [sys.executable, "-m", "captionflow.processes", str(me), repr(process_started(me)), str(child),
         repr(process_started(child))],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )  # fmt: skip


def _guard(parent: int, parent_started: Optional[float], child: int, child_started: Optional[float]) -> None:
    import time

    import psutil

    while alive(child, child_started):
        if not alive(parent, parent_started):
            try:
                proc = psutil.Process(child)
                proc.terminate()
                proc.wait(5)
            except psutil.TimeoutExpired:
                proc.kill()
            except psutil.Error:
                pass
            return
        time.sleep(0.5)


if __name__ == "__main__":
    import sys

    def _started(text: str) -> Optional[float]:
        return None if text == "None" else float(text)

    _guard(int(sys.argv[1]), _started(sys.argv[2]), int(sys.argv[3]), _started(sys.argv[4]))
