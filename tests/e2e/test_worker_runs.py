"""Deployments run by a real Prefect process worker: a custom run that sets one parameter, a GPU run on a CPU
worker, a cancelled run. The deployments and the worker are made by the README's own Prefect commands, as written
there (`captionflow deploy --config golden.yaml --work-pool ...`, `prefect worker start --pool ...`), with a
golden.yaml of the test's; the worker runs the flow from this checkout."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from processes import wait_engines_gone

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
PROMPT = "Name the main object."  # the deployment's, not RunConfig's default


def _readme_commands() -> dict[str, list[str]]:
    """The README's Prefect commands (the bash block after "Prefect deployments."), by their first two words, with
    the programs of this environment (the console scripts beside its Python)."""
    block = (REPO / "README.md").read_text().split("**Prefect deployments.**", 1)[1]
    block = block.split("```bash", 1)[1].split("```", 1)[0]
    commands = {}
    for line in block.strip().splitlines():
        words = shlex.split(line.split("#", 1)[0])
        commands[" ".join(words[:2])] = [str(Path(sys.executable).parent / words[0]), *words[1:]]
    return commands


@pytest.fixture(scope="module")
def worker_pool(prefect_api, tmp_path_factory):
    """The README's ``captionflow deploy --config golden.yaml --work-pool ...`` and ``prefect worker start``."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    home = tmp_path_factory.mktemp("worker")
    out = home / "out"
    (home / "golden.yaml").write_text(f"output: {out}\ndevice: cpu\nmax_tokens: 16\nprompt: {PROMPT}\n")
    commands = _readme_commands()
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONUNBUFFERED": "1"}
    made = subprocess.run(
        commands["captionflow deploy"], cwd=home, env=env, capture_output=True, text=True, timeout=300
    )
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    with get_client(sync_client=True) as client:
        ids = {name: str(client.read_deployment_by_name(f"captionflow/{name}").id) for name in ("golden-nightly",)}
    log = tmp_path_factory.mktemp("worker-log") / "worker.log"
    with open(log, "w") as sink:
        worker = subprocess.Popen(
            [*commands["prefect worker"], "--prefetch-seconds", "5"],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    yield ids, out, log
    worker.terminate()
    try:
        worker.wait(timeout=5)  # idle, it ends in ~0.5 s; after the cancelled run it waited out 30 s every time
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)  # the worker and what it started
        worker.wait(timeout=30)


def _wait(client, run_id, done, timeout_s: float, log: Path):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = client.read_flow_run(run_id)
        if run.state and done(run.state):
            return run
        time.sleep(1)
    raise AssertionError(
        f"flow run {run_id} still {run.state.name} after {timeout_s} s; worker log:\n" + log.read_text()[-4000:]
    )


def _files(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its modification time (ns); empty where ``root`` does not exist."""
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def _history(client, run_id) -> list[str]:
    return [s.name for s in client.read_flow_run_states(run_id)]


def test_a_custom_run_setting_only_max_tokens_keeps_the_deployments_other_values(worker_pool):
    """The run gives ``generation: {max_tokens: 8}``, which replaces the deployment's whole generation group on
    the server (Prefect merges top-level parameters): it runs with the deployment's prompt, output and device."""
    from prefect.client.orchestration import get_client

    ids, out, log = worker_pool
    before = _files(REPO / "captionflow-out")  # a user's own `make run` may have left its demo run there
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(
            uuid.UUID(ids["golden-nightly"]), parameters={"generation": {"max_tokens": 8}}
        )
        run = _wait(client, run.id, lambda s: s.is_final(), 900, log)
        assert run.state.is_completed(), (run.state.message, log.read_text()[-4000:])
        summary = run.state.result()
    assert summary["run_dir"].startswith(str(out))  # the deployment's output root, not the worker's checkout
    # the summary itself is persisted under the output root (it was in the worker's PREFECT_HOME)
    assert (out / ".prefect-cache" / run.state.data.storage_key.rsplit("/", 1)[-1]).is_file()
    assert _files(REPO / "captionflow-out") == before  # nothing written to, or changed in, the checkout's default
    from captionflow.data.storage import Store
    from captionflow.report.markdown import read_leaderboard

    rows = [r for r in read_leaderboard(Store(str(out))) if r["run_dir"] == summary["run_dir"]]
    assert len(rows) == 1
    run_json = Path(summary["run_dir"]) / "run.json"
    import json

    generation = json.loads(run_json.read_text())["generation"]
    assert generation["max_tokens"] == 8 and generation["prompt"] == PROMPT


def test_a_gpu_run_on_a_cpu_worker_fails_fast_naming_the_gpu(worker_pool):
    from prefect.client.orchestration import get_client

    from captionflow.engines.device import local_gpus

    if local_gpus():
        pytest.skip("this machine has a GPU")
    ids, _, log = worker_pool
    t0 = time.monotonic()
    with get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(
            uuid.UUID(ids["golden-nightly"]), parameters={"engine": {"device": "gpu"}}
        )
        run = _wait(client, run.id, lambda s: s.is_final(), 600, log)
        assert run.state.is_failed(), run.state
        tasks = {t.name.rsplit("-", 1)[0]: t for t in client.read_task_runs() if t.flow_run_id == run.id}
        assert "GPU" in (tasks["preflight"].state.message or "") + (run.state.message or "")
        assert "inference" not in tasks  # failed before any stage that waits on Ray
    assert time.monotonic() - t0 < 300


def test_a_cancelled_run_ends_cancelled_without_passing_through_crashed(worker_pool):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    ids, _, log = worker_pool
    started = time.time()
    with get_client(sync_client=True) as client:
        # a new generation setting: inference runs (not cached), so the run is cancelled mid-work
        run = client.create_flow_run_from_deployment(
            uuid.UUID(ids["golden-nightly"]), parameters={"generation": {"max_tokens": 12}}
        )
        _wait(client, run.id, lambda s: s.is_running(), 600, log)
        time.sleep(15)  # into the stages
        client.set_flow_run_state(run.id, Cancelling(message="cancelled by the test"), force=True)
        run = _wait(client, run.id, lambda s: s.is_final(), 300, log)
        history = _history(client, run.id)
    assert run.state.is_cancelled(), history
    assert "Crashed" not in history, history
    # its engine processes end with it (a VLLM::Worker, ~900 MB, outlived the Cancelled run by 50-90 s)
    wait_engines_gone(since=started, timeout_s=30)
