"""Runs that overlap, grow, or fail: every caption once, nothing stale or foreign, failure said plainly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from captionflow.builtin.demo_data import DEMO_CAPTIONS, ensure_demo_dataset

pytestmark = pytest.mark.slow
SMALL = ["--device", "cpu", "--batch-size", "2", "--commit-rows", "2"]


def _subset(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    demo = ensure_demo_dataset()
    for n in names:
        shutil.copy2(demo / n, folder / n)
    return folder


def _run(args, env, log):
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", *args], env=env, stdout=log, stderr=subprocess.STDOUT
    )


def _captions(run_dir):
    return pq.read_table(f"{run_dir}/captions").column("image_id").to_pylist()


def test_overlapping_runs_caption_each_image_once_and_a_grown_dataset_reuses_its_captions(prefect_api, tmp_path):
    from prefect.settings import PREFECT_API_URL

    names = sorted(DEMO_CAPTIONS)[:5]
    data = _subset(tmp_path / "golden", names)
    out = tmp_path / "out"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    for i in range(2):  # the same dataset, model and output, at the same time
        logs.append(open(tmp_path / f"run{i}.log", "w"))  # noqa: SIM115 - closed below
        procs.append(
            _run(
                ["--dataset", str(data), "--output", str(out), *SMALL, "--summary-json", str(tmp_path / f"s{i}.json")],
                env,
                logs[-1],
            )
        )
    for p, log in zip(procs, logs):
        p.wait(timeout=1200)
        log.close()
    for i, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"run{i}.log").read_text()[-3000:]
    s = [json.loads((tmp_path / f"s{i}.json").read_text()) for i in range(2)]
    assert s[0]["run_dir"] == s[1]["run_dir"]
    ids = _captions(s[0]["run_dir"])
    assert len(ids) == len(set(ids)) == 5  # each image once, though two runs captioned the folder at once
    assert [x["counts"]["captioned"] for x in s] == [5, 5]
    assert sum(p["sent"] for x in s for p in x["passes"]) == 5  # the second found them committed
    waited = "".join((tmp_path / f"run{i}.log").read_text() for i in range(2))
    assert "is held by" in waited  # one waited for the other, and said so
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    assert [r["run_dir"] for r in board] == [s[0]["run_dir"]]

    # one more image: a new dataset (new fingerprint), but the five captions are the same images with the
    # same checkpoint and settings: reused, not recomputed
    _subset(data, sorted(DEMO_CAPTIONS)[5:6])
    grown = tmp_path / "grown.json"
    from flows.cli import main

    assert main(["run", "--dataset", str(data), "--output", str(out), *SMALL, "--summary-json", str(grown)]) == 0
    g = json.loads(grown.read_text())
    assert g["dataset_dir"] != s[0]["dataset_dir"] and g["reused"] == 5
    assert [p["sent"] for p in g["passes"]] == [1]
    assert sorted(_captions(g["run_dir"])) == sorted(set(ids) | set(_captions(g["run_dir"])))
    assert len(_captions(g["run_dir"])) == 6


def test_a_run_whose_rows_all_fail_fails_and_is_not_a_result(prefect_api, tmp_path, monkeypatch, capsys):
    from captionflow.workers.images import content_id
    from flows.cli import main

    names = sorted(DEMO_CAPTIONS)[:2]
    data = _subset(tmp_path / "two", names)
    monkeypatch.setenv("CAPTIONFLOW_INJECT_ROW_FAILURES", ",".join(content_id((data / n).read_bytes()) for n in names))
    out = tmp_path / "out"
    assert main(["run", "--dataset", str(data), "--output", str(out), *SMALL, "--row-retries", "0"]) == 1
    err = capsys.readouterr().err
    assert "run failed: 2 of 2 rows (100%) failed" in err and "max_failure_rate" in err
    assert not (out / "leaderboard.parquet").exists() and not (out / "leaderboard").exists()


def test_an_engine_that_cannot_start_fails_the_run_with_its_root_cause(prefect_api, tmp_path, capsys):
    from flows.cli import main

    data = _subset(tmp_path / "two", sorted(DEMO_CAPTIONS)[:2])
    # an engine argument vLLM knows (so the preflight lets it through) with a value its engine refuses at start
    args = [
        "run",
        "--dataset",
        str(data),
        "--output",
        str(tmp_path / "out"),
        *SMALL,
        "--engine-kwargs",
        '{"max_num_batched_tokens": 1}',
    ]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("captionflow: run failed: inference: ValidationError") and "max_num_batched_tokens" in err
