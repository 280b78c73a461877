"""Inference survives: SIGKILL mid-run then resume, failed rows retried, resume on S3."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from captionflow.builtin.demo_data import DEMO_CAPTIONS, ensure_demo_dataset
from captionflow.workers.images import content_id

pytestmark = pytest.mark.slow
SMALL_BATCHES = ["--device", "cpu", "--batch-size", "2", "--commit-rows", "2", "--max-concurrent-batches", "1"]


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (Ray's raylet, workers, the vLLM engine): a dead node."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def test_sigkill_mid_inference_then_resume_exactly_once(prefect_api, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from flows.cli import main

    out = tmp_path / "out"
    log = open(tmp_path / "killed-run.log", "w")  # noqa: SIM115 - the killed run's output, read as it grows
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", "--output", str(out), *SMALL_BATCHES],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    pattern = str(out / "runs" / "*" / "*" / "*" / "captions" / "*.parquet")
    deadline = time.time() + 600
    while time.time() < deadline and not glob.glob(pattern):
        assert proc.poll() is None, (tmp_path / "killed-run.log").read_text()[-3000:]
        time.sleep(0.2)
    assert glob.glob(pattern), "no caption shard was committed within 10 minutes"
    _kill_tree(proc.pid)
    committed = [i for f in glob.glob(pattern) for i in pq.read_table(f).column("image_id").to_pylist()]
    assert 0 < len(committed) < len(DEMO_CAPTIONS), "the kill should land mid-inference"

    summary_file = tmp_path / "resumed.json"
    assert main(["run", "--output", str(out), *SMALL_BATCHES, "--summary-json", str(summary_file)]) == 0
    s = json.loads(summary_file.read_text())
    assert s["resumed_from"] == len(committed)
    assert s["passes"][0]["sent"] == len(DEMO_CAPTIONS) - len(committed)  # only the rest went to the engine
    ids = [i for f in glob.glob(pattern) for i in pq.read_table(f).column("image_id").to_pylist()]
    assert len(ids) == len(set(ids)) == s["counts"]["accepted"] == s["counts"]["captioned"]
    shard_ids = pq.read_table(f"{s['dataset_dir']}/shards").column("image_id").to_pylist()
    assert set(ids) == set(shard_ids)
    # the UI: the killed attempt's progress is marked as over, the resumed one's reached 100%
    attempts = _progress_attempts(s["flow_run_id"])
    assert len(attempts) == 2, attempts
    killed, resumed = sorted(attempts, key=lambda a: a.created)
    assert killed.description.startswith("attempt ended without finishing") and float(killed.data) < 100
    assert f"resumed from {len(committed)} committed rows" in killed.description
    assert float(resumed.data) == 100 and not resumed.description.startswith("attempt ended")


def _progress_attempts(flow_run_id: str) -> list:
    """Every version of the inference progress artifact of the folder that flow run captioned."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        mine = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
        key = next(a.key for a in mine if (a.key or "").startswith("inference-progress-"))
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_failed_rows_recorded_then_retried_on_s3(prefect_api, s3_bucket, monkeypatch, tmp_path):
    import shutil

    import pyarrow.fs
    import s3fs

    from flows.cli import main

    demo = ensure_demo_dataset()
    rejected = ["coffee.png", "rocket.jpg"]
    bad = sorted(content_id((demo / n).read_bytes()) for n in rejected)
    # ten images, two of them rejected (20%, under the default max_failure_rate): every file of the run (shards,
    # captions, report thumbnails) goes to the S3 server, and a small set keeps that short
    data = tmp_path / "ten"
    data.mkdir()
    for n in [*rejected, *[n for n in sorted(DEMO_CAPTIONS) if n not in rejected][:8]]:
        shutil.copy2(demo / n, data / n)
    out = f"s3://{s3_bucket}/cf"
    run = ["run", "--dataset", str(data), "--output", out, "--device", "cpu"]

    # 1) the engine rejects two rows; no retry pass allowed: they are recorded, never counted as done
    monkeypatch.setenv("CAPTIONFLOW_INJECT_ROW_FAILURES", ",".join(bad))
    first = tmp_path / "first.json"
    assert main([*run, "--row-retries", "0", "--summary-json", str(first)]) == 0
    s1 = json.loads(first.read_text())
    assert s1["counts"]["failed"] == 2 and s1["counts"]["captioned"] == s1["counts"]["accepted"] - 2
    fs = s3fs.S3FileSystem(endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    run_dir = s1["run_dir"].removeprefix("s3://")
    failures = pq.read_table(f"{run_dir}/failures", filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)))
    assert sorted(failures.column("image_id").to_pylist()) == bad
    assert all("temperature" in e for e in failures.column("error").to_pylist())

    # 2) rerun: the two rows are retried (first attempt fails again, the retry pass succeeds)
    second = tmp_path / "second.json"
    assert main([*run, "--summary-json", str(second)]) == 0
    s2 = json.loads(second.read_text())
    assert s2["cached_stages"] == ["preprocess"]  # inference was not cached: it had failed rows
    assert s2["resumed_from"] == s1["counts"]["captioned"]
    assert [p["sent"] for p in s2["passes"]] == [2, 2]
    assert s2["passes"][0]["failed"] == 2 and s2["passes"][1]["captioned"] == 2
    assert s2["counts"]["failed"] == 0 and s2["counts"]["captioned"] == s2["counts"]["accepted"]
    caps = pq.read_table(f"{run_dir}/captions", filesystem=pyarrow.fs.PyFileSystem(pyarrow.fs.FSSpecHandler(fs)))
    ids = caps.column("image_id").to_pylist()
    assert len(ids) == len(set(ids)) == s2["counts"]["accepted"]
    retried = {r["image_id"]: r["attempt"] for r in caps.to_pylist() if r["image_id"] in bad}
    assert retried == dict.fromkeys(bad, 1)
