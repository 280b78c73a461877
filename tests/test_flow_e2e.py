"""The whole flow on the demo set: real Prefect API, real Ray Data, real vLLM CPU engine."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from captionflow.demo_data import DEMO_CAPTIONS, FAULTY_FILES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(prefect_api, tmp_path_factory):
    from captionflow.cli import main

    out = tmp_path_factory.mktemp("out")
    first, second = out / "first.json", out / "second.json"
    assert main(["run", "--output", str(out), "--device", "cpu", "--summary-json", str(first)]) == 0
    assert main(["run", "--output", str(out), "--device", "cpu", "--summary-json", str(second)]) == 0
    return out, json.loads(first.read_text()), json.loads(second.read_text())


def test_summary_has_documented_shape(demo_run):
    _, s, _ = demo_run
    assert {"dataset_dir", "run_dir", "counts", "metrics", "timings_s"} <= set(s)
    assert {"total", "accepted", "quarantined", "captioned", "failed"} <= set(s["counts"])
    assert {"bleu_4", "rouge_l", "cider"} <= set(s["metrics"]["reference"])
    assert s["metrics"]["stats"]["n_captions"] == s["counts"]["captioned"]
    assert s["timings_s"]["total_s"] > 0


def test_every_input_accounted_for(demo_run):
    out, s, _ = demo_run
    c = s["counts"]
    assert c["total"] == len(DEMO_CAPTIONS) + len(FAULTY_FILES)
    assert c["accepted"] + c["quarantined"] + c["duplicates"] == c["total"]
    assert c["quarantined"] == len(FAULTY_FILES) and c["accepted"] == len(DEMO_CAPTIONS)
    assert c["captioned"] == c["accepted"] and c["failed"] == 0
    q = pq.read_table(f"{s['dataset_dir']}/quarantine.parquet").to_pylist()
    assert {r["source"] for r in q} == set(FAULTY_FILES)
    assert all(r["reason"] and r["detail"] for r in q)


def test_captions_exactly_once(demo_run):
    _, s, second = demo_run
    shards = pq.read_table(f"{s['dataset_dir']}/shards")
    caps = pq.read_table(f"{s['run_dir']}/captions")
    ids = caps.column("image_id").to_pylist()
    assert len(ids) == len(set(ids)) == shards.num_rows
    assert set(ids) == set(shards.column("image_id").to_pylist())
    assert all(n > 0 for n in caps.column("num_output_tokens").to_pylist())


def test_rerun_reuses_dataset_and_captions(demo_run):
    _, s, second = demo_run
    assert second["preprocess_skipped"] is True
    assert second["dataset_dir"] == s["dataset_dir"] and second["run_dir"] == s["run_dir"]
    assert second["resumed_from"] == s["counts"]["accepted"]
    assert second["counts"] == s["counts"]
    assert "inference.ray_init_s" not in second["timings_s"]  # nothing left to caption: Ray not started


def test_report_and_leaderboard_written(demo_run):
    out, s, _ = demo_run
    report = open(s["report"], encoding="utf-8").read()
    assert "## Headline metrics" in report and "cider" in report
    lb = pq.read_table(out / "leaderboard.parquet").to_pylist()
    assert len(lb) == 1 and lb[0]["run_dir"] == s["run_dir"]


def test_flow_runs_recorded_by_prefect_api(demo_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["captionflow"])))
        completed = [r for r in runs if r.state and r.state.is_completed()]
        assert len(completed) >= 2
        tasks = client.read_task_runs()
        names = {t.name.rsplit("-", 1)[0] for t in tasks if t.flow_run_id == completed[0].id}
        assert {"ingest", "preprocess", "inference", "evaluate"} <= names
