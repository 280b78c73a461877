"""A run against an existing 2-node Ray cluster (two raylets on loopback), work spread over both."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ports import free_port

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def two_node_cluster():
    import psutil

    temp = tempfile.mkdtemp(prefix="cfray", dir="/tmp")  # short: Ray's socket paths have a length limit
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=2", "--disable-usage-stats"]
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
        # stop only this cluster's processes (``ray stop`` would stop every Ray on the machine)
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if temp in cmd or f":{port}" in cmd:
                for q in [p] + p.children(recursive=True):
                    try:
                        q.send_signal(signal.SIGKILL)
                    except psutil.Error:
                        pass
        shutil.rmtree(temp, ignore_errors=True)


def test_run_on_existing_two_node_cluster(prefect_api, two_node_cluster, tmp_path):
    from prefect.settings import PREFECT_API_URL

    address, env = two_node_cluster
    env = {**env, "PREFECT_API_URL": PREFECT_API_URL.value()}
    summary = tmp_path / "s.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            "--output",
            str(tmp_path / "out"),
            "--device",
            "cpu",
            "--ray-address",
            address,
            "--summary-json",
            str(summary),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert s["counts"]["captioned"] == s["counts"]["accepted"] > 0
    # which nodes ran the job's tasks and actors (Ray's state API, from a fresh driver)
    probe = (
        "import json, ray; from ray.util.state import list_tasks, list_actors;"
        f"ctx = ray.init(address='{address}');"
        # the state API must ask *this* cluster's dashboard, not the machine's latest-cluster file
        "kw = dict(address='http://' + ctx.dashboard_url, detail=True, timeout=60, raise_on_missing_output=False);"
        "t = list_tasks(limit=10000, **kw); a = list_actors(limit=1000, **kw);"
        "print('NODES' + json.dumps({'nodes': [n['NodeID'] for n in ray.nodes() if n['Alive']],"
        " 'task_nodes': sorted({x.node_id for x in t if x.node_id}),"
        " 'actor_nodes': sorted({x.node_id for x in a if x.node_id})}))"
    )
    line, errors = None, []
    for _ in range(3):  # the state API answers from the dashboard, which can lag behind a busy cluster
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        line = next((x for x in out.stdout.splitlines() if x.startswith("NODES")), None)
        if line:
            break
        errors.append(out.stderr[-2000:])
        time.sleep(5)
    assert line, "state API probe failed:\n" + "\n".join(errors)
    info = json.loads(line[5:])
    assert len(info["nodes"]) == 2
    used = set(info["task_nodes"]) | set(info["actor_nodes"])
    assert used == set(info["nodes"]), f"work ran on {len(used)} of 2 nodes: {info}"
