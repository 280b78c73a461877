"""Joining this machine's warm service's Ray: its token authentication holds even where Ray was imported first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from captionflow.processes import process_started

PROBE = """
from ray._raylet import AuthenticationMode, get_authentication_mode  # Ray reads its configuration now

assert get_authentication_mode() != AuthenticationMode.TOKEN
from captionflow.engines.address import local_service_address

print(local_service_address(), get_authentication_mode() == AuthenticationMode.TOKEN)
"""


def test_a_process_that_imported_ray_first_joins_the_service_with_token_authentication(tmp_path):
    # captionflow evaluate (external captions) once failed its preprocessing 3 times on InvalidAuthToken while a
    # service ran: Ray had read RAY_AUTH_MODE before the service file set it
    (tmp_path / "service.json").write_text(
        json.dumps(
            {
                "address": "127.0.0.1:6379",
                "pid": os.getpid(),  # a live process, as the service's is
                "pid_started": process_started(os.getpid()),
                "auth_mode": "token",
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    env["CAPTIONFLOW_CACHE"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["127.0.0.1:6379", "True"], r.stdout
