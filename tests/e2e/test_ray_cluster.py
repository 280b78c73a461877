"""A run against an existing 2-node Ray cluster (two raylets on loopback), work spread over both."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ray_cluster import nodes_that_ran

pytestmark = pytest.mark.slow


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
    info = nodes_that_ran(address, env)
    assert len(info["nodes"]) == 2
    used = set(info["task_nodes"]) | set(info["actor_nodes"])
    assert used == set(info["nodes"]), f"work ran on {len(used)} of 2 nodes: {info}"


def test_two_checkpoints_evaluated_at_once_through_ray_task_runner_one_per_node(prefect_api, tmp_path):
    """``captionflow compare A B --parallel 2`` on a 2-node cluster: the dataset preprocessed once, each
    checkpoint's caption flow in a Ray task of prefect-ray's RayTaskRunner on its own node, reporting to the
    Prefect API from there, and both leaderboard rows written."""
    import shutil

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from ray_cluster import two_nodes

    from captionflow.builtin.demo_data import DEMO_CAPTIONS, ensure_demo_dataset
    from captionflow.builtin.model import build_builtin_model

    data = tmp_path / "golden"
    data.mkdir()
    for n in sorted(DEMO_CAPTIONS)[:6]:
        shutil.copy2(ensure_demo_dataset() / n, data / n)
    other = build_builtin_model(tmp_path / "step-2000", seed=1)
    summary = tmp_path / "s.json"
    with two_nodes(num_cpus=4) as (address, env):  # one pipeline needs ~4 logical CPUs at its widest
        env = {**env, "PREFECT_API_URL": PREFECT_API_URL.value()}
        args = ["compare", "builtin", str(other), "--dataset", str(data), "--output", str(tmp_path / "out")]
        args += ["--device", "cpu", "--ray-address", address, "--parallel", "2", "--summary-json", str(summary)]
        r = subprocess.run(
            [sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True, timeout=1800
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        info = nodes_that_ran(address, env)
    s = json.loads(summary.read_text())
    runs = s["runs"]
    assert len(runs) == 2 and len({x["run_dir"] for x in runs}) == 2
    assert len({x["dataset_dir"] for x in runs}) == 1 and all(x["counts"]["captioned"] == 6 for x in runs)
    assert [row["run_dir"] for row in s["leaderboard"]] == [x["run_dir"] for x in runs]  # both rows, in order
    # each evaluation in its own Ray task of the RayTaskRunner, one on each node
    evaluations = [t for t in info["tasks"] if t[0] == "evaluate-checkpoint"]
    assert len(evaluations) == 2 and {t[2] for t in evaluations} == {"FINISHED"}
    assert {t[1] for t in evaluations} == set(info["nodes"]), info["tasks"]
    # and from there, the Prefect API got each checkpoint's flow run and stage task runs
    with get_client(sync_client=True) as client:
        flow_runs = {str(f.id): f for f in client.read_flow_runs()}
        task_runs = client.read_task_runs()
        checkpoint_tasks = [t for t in task_runs if t.name.startswith("evaluate-checkpoint")]
        assert len(checkpoint_tasks) == 2 and all(t.state.is_completed() for t in checkpoint_tasks)
        fanned = {t.flow_run_id for t in checkpoint_tasks}
        assert len(fanned) == 1 and flow_runs[str(fanned.pop())].name  # one compare-parallel flow run holds both
        for run in runs:
            fr = flow_runs[run["flow_run_id"]]  # created from the Ray worker, as a subflow of its task
            assert fr.state.is_completed() and fr.parent_task_run_id is not None
            assert client.read_task_run(fr.parent_task_run_id).flow_run_id == checkpoint_tasks[0].flow_run_id
            stages = {t.name.rsplit("-", 1)[0]: t.state.name for t in task_runs if t.flow_run_id == fr.id}
            assert stages["inference"] == "Completed" and stages["preprocess"] == "Cached", stages
