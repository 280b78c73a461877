"""``captionflow run`` in a child process against the session's Prefect API, and what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow.parquet as pq


def run_cli(args, tmp_path, name, wait=True):
    """Run ``captionflow run ARGS``; with ``wait``: (its summary, its log), failing with the log's end if it failed;
    else (the process, its open log, the summary's path)."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed by the caller's wait
    summary = tmp_path / f"{name}.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", *args, "--summary-json", str(summary)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    if not wait:
        return proc, log, summary
    proc.wait(timeout=1200)
    log.close()
    text = (tmp_path / f"{name}.log").read_text()
    assert proc.returncode == 0, text[-4000:]
    return json.loads(summary.read_text()), text


def captions(run_dir) -> list[dict]:
    return pq.read_table(f"{run_dir}/captions", columns=["image_id", "caption"]).to_pylist()


def assert_same_captions(run: dict, baseline: dict, n: int) -> None:
    """``run`` made with the settings that make a caption of ``baseline``'s - the same generation fingerprint - and
    the same ``n`` captions."""
    assert run["run_dir"].split("/")[-2:] == baseline["run_dir"].split("/")[-2:]
    mine = {r["image_id"]: r["caption"] for r in captions(run["run_dir"])}
    assert len(mine) == n and mine == {r["image_id"]: r["caption"] for r in captions(baseline["run_dir"])}
