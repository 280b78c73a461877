"""captionflow's own lines in a Ray worker's output: ``captionflow HH:MM:SS: <message>`` on stderr.

Ray keeps each worker's stderr in its session logs and streams it to the driver, whose run log
(``engines/run_log.py``) forwards these lines (and the benchmarks time a run by them).
"""

from __future__ import annotations

import sys
import time


def say(msg: str) -> None:
    print(f"captionflow {time.strftime('%H:%M:%S')}: {msg}", file=sys.stderr, flush=True)
