"""A Ray cluster of two raylets on loopback for the end-to-end tests, and what ran where on it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ports import free_port

RAY = str(Path(sys.executable).with_name("ray"))


@contextmanager
def two_nodes(num_cpus: int = 2):
    """Yields (address, env) of a fresh 2-node cluster; stops only its own processes afterwards (``ray stop``
    would stop every Ray on the machine)."""
    import psutil

    temp = tempfile.mkdtemp(prefix="cfray", dir="/tmp")  # short: Ray's socket paths have a length limit
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--disable-usage-stats"]
    try:
        subprocess.run(
            [
                RAY,
                "start",
                "--head",
                f"--port={port}",
                f"--temp-dir={temp}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={free_port()}",
                *common,
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=180,
        )
        subprocess.run(
            [RAY, "start", f"--address=127.0.0.1:{port}", *common],
            env=env,
            check=True,
            capture_output=True,
            timeout=180,
        )
        yield f"127.0.0.1:{port}", env
    finally:
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if temp in cmd or f":{port}" in cmd:
                for q in [p] + p.children(recursive=True):
                    try:
                        q.send_signal(signal.SIGKILL)
                    except psutil.Error:
                        pass
        shutil.rmtree(temp, ignore_errors=True)


def nodes_that_ran(address: str, env: dict[str, str]) -> dict:
    """The cluster's nodes, the nodes its tasks and actors ran on, and the node of each task by name (Ray's
    state API, from a fresh driver)."""
    probe = (
        "import json, ray; from ray.util.state import list_tasks, list_actors;"
        f"ctx = ray.init(address='{address}');"
        # the state API must ask *this* cluster's dashboard, not the machine's latest-cluster file
        "kw = dict(address='http://' + ctx.dashboard_url, detail=True, timeout=60, raise_on_missing_output=False);"
        "t = list_tasks(limit=10000, **kw); a = list_actors(limit=1000, **kw);"
        "print('NODES' + json.dumps({'nodes': [n['NodeID'] for n in ray.nodes() if n['Alive']],"
        " 'task_nodes': sorted({x.node_id for x in t if x.node_id}),"
        " 'actor_nodes': sorted({x.node_id for x in a if x.node_id}),"
        " 'tasks': [[x.name, x.node_id, x.state] for x in t]}))"
    )
    errors = []
    for _ in range(3):  # the state API answers from the dashboard, which can lag behind a busy cluster
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        line = next((x for x in out.stdout.splitlines() if x.startswith("NODES")), None)
        if line:
            return json.loads(line[5:])
        errors.append(out.stderr[-2000:])
        time.sleep(5)
    raise AssertionError("state API probe failed:\n" + "\n".join(errors))
