"""Run a script in a fresh interpreter with this checkout importable, as a Ray worker or engine process starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script(script: str, cwd) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``script`` in a fresh interpreter; the process and the JSON of its last ``RESULT `` line (asserted)."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(cwd),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return proc, json.loads(lines[-1][len("RESULT ") :])
