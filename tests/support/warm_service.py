"""``captionflow serve`` in a child process on the built-in model on CPU, for the warm engine tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "flows.cli"]


def start_service(env, log: Path, *options: str) -> subprocess.Popen:
    """The service's process (its own session: a kill of its group takes its Ray too), once it says it is ready."""
    proc = subprocess.Popen(
        [*CLI, "serve", "--device", "cpu", "--idle-timeout", "900", *options],
        env=env,
        stdout=open(log, "w"),  # noqa: SIM115 - the service's output, read as it grows
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while "warm engines ready" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(2)
    return proc
