"""The vLLM processes a run started, for the tests that end runs abruptly (kill, cancel)."""

from __future__ import annotations

import os
import time

# make test runs the tests on several pytest-xdist workers at once: a process of this worker's tests inherits its
# PYTEST_XDIST_WORKER, another worker's engines are not this test's
WORKER = "PYTEST_XDIST_WORKER"


def engine_processes(since: float) -> list[str]:
    """vLLM engine cores and workers of this test process's runs started after ``since`` (a time.time()) that
    still run."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] == psutil.STATUS_ZOMBIE or p.info["create_time"] < since:
            continue
        if ("VLLM::" in cmd or "spawn_main" in cmd) and _ours(p):
            found.append(f"{p.info['pid']} {cmd[:80]} (parent {_parent(p)})")
    return found


def _ours(p) -> bool:
    import psutil

    try:
        return p.environ().get(WORKER) == os.environ.get(WORKER)
    except psutil.NoSuchProcess:
        return False


def _parent(p) -> str:
    """Who a left-over engine process hangs on: its parent's pid and command."""
    import psutil

    try:
        parent = p.parent()
        return f"{parent.pid} {' '.join(parent.cmdline())[:80]}" if parent else "none"
    except psutil.Error:
        return "gone"


def wait_engines_gone(since: float, timeout_s: float) -> None:
    """Assert that every engine process started after ``since`` is gone within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while left := engine_processes(since):
        assert time.monotonic() < deadline, f"still running {timeout_s:.0f} s later: {left}"
        time.sleep(1)


def marked_processes(name: str, value: str) -> list[str]:
    """The processes that still run with ``name=value`` in their environment (a marker a test gave a command, which
    every process it starts inherits: Ray's raylet, GCS and agents, engines)."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.environ().get(name) == value:
                found.append(f"{p.info['pid']} {' '.join(p.info['cmdline'] or [])[:80]}")
        except psutil.Error:
            continue
    return found
