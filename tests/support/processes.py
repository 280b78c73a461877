"""The vLLM processes a run started, for the tests that end runs abruptly (kill, cancel)."""

from __future__ import annotations

import time


def engine_processes(since: float) -> list[str]:
    """vLLM engine cores and workers started after ``since`` (a time.time()) that still run."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] == psutil.STATUS_ZOMBIE or p.info["create_time"] < since:
            continue
        if "VLLM::" in cmd or "spawn_main" in cmd:
            found.append(f"{p.info['pid']} {cmd[:80]}")
    return found


def wait_engines_gone(since: float, timeout_s: float) -> None:
    """Assert that every engine process started after ``since`` is gone within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while left := engine_processes(since):
        assert time.monotonic() < deadline, f"still running {timeout_s:.0f} s later: {left}"
        time.sleep(1)
