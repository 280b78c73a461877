"""Where a warm engine service running on this machine can be reached (``controller.py`` writes it).

Apart from ``controller.py`` so that the Ray session can look it up without importing the service itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

from captionflow.data.cache import default_cache_dir
from captionflow.processes import alive


def service_file() -> Path:
    """Where a local service says how to reach it (runs on this machine read it)."""
    return default_cache_dir() / "service.json"


def local_service_address() -> Optional[str]:
    """The Ray address of a warm engine service running on this machine, if one is."""
    path = service_file()
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    try:
        if not alive(int(info["pid"]), info.get("pid_started")):
            return None  # its process is gone (or its number now belongs to another one): the file is stale
    except (KeyError, ValueError):
        return None
    if info.get("auth_mode") and "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = info["auth_mode"]
        if "ray._raylet" in sys.modules:  # Ray read its configuration when imported: read it again, as ray does
            from ray._raylet import Config  # when it turns token authentication on (authentication_token_setup)

            Config.initialize("")
    # a run on a local service's Ray ends soon after that Ray does (see _Lifeline), not after Ray's default 60 s;
    # 30 s leaves the lifeline room to end the run first on a loaded machine (15 s did not, once, on 2 cores)
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "30")
    return info.get("address")
