"""The publish stage against a real Prefect API: table and markdown artifacts of the flow run, the regression
event stored by the server (and none without a regression)."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import flow

from captionflow.config import RunConfig
from tasks.publish import publish_task


@flow
def _publish(cfg: RunConfig, summary: dict):
    from prefect import runtime

    return str(runtime.flow_run.id), publish_task(cfg, summary)


def _summary(tmp_path, cider_delta):
    ds = tmp_path / "dataset"
    ds.mkdir()
    pq.write_table(
        pa.table(
            {
                "source": ["a.jpg", "b.png", "c.gif", "d.jpg"],
                "reason": ["decode_error", "decode_error", "too_small", "decode_error"],
                "detail": ["truncated", "bad crc", "7x7", "no eoi"],
            }
        ),
        ds / "quarantine.parquet",
    )
    report = tmp_path / "report.md"
    report.write_text("# captionflow report\n\n## Headline metrics\n", encoding="utf-8")
    return {
        "dataset_dir": str(ds),
        "run_dir": str(tmp_path / "run"),
        "counts": {"total": 10, "accepted": 6, "quarantined": 4, "duplicates": 0, "captioned": 6, "failed": 0},
        "quarantine_reasons": {"decode_error": 3, "too_small": 1},
        "timings_s": {
            "ingest_s": 0.1,
            "preprocess_s": 0.0,
            "inference_s": 0.0,
            "inference.ray_init_s": 2.0,
            "total_s": 3.0,
        },
        "cached_stages": ["preprocess", "inference"],
        "passes": [{"attempt": 0, "sent": 6, "captioned": 6, "failed": 0, "seconds": 1.0, "first_row_s": 0.5}],
        "report": str(report),
        "resumed_from": 0,
        "model_fingerprint": uuid.uuid4().hex[:16],
        "metrics": {
            "reference": {"cider": 0.5},
            "comparison": {"best_so_far": {"model": "step-1000", "run_dir": "runs/best", "cider": cider_delta}},
        },
    }


def _artifacts(flow_run_id: str) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        got = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in got}


def _rows(artifact) -> list[dict]:
    """A table artifact's rows (the server keeps its data as a JSON string)."""
    import json

    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def _regression_events(fingerprint: str, wait_s: float) -> list[dict]:
    import time

    from prefect.client.orchestration import get_client
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            r = client.request(
                "POST",
                "/events/filter",
                json={
                    "filter": {
                        "event": {"name": ["captionflow.checkpoint.regressed"]},
                        "resource": {"id": [f"captionflow.checkpoint.{fingerprint}"]},
                    },
                    "limit": 10,
                },
            )
            events = r.json()["events"]
            if events or time.monotonic() > deadline:
                return events
            time.sleep(0.5)


def test_publish_shows_the_run_and_alerts_on_a_regression(prefect_api, tmp_path):
    summary = _summary(tmp_path, cider_delta=-0.5)  # best 1.0, this 0.5
    run_id, found = _publish(RunConfig(model="step-2000", regression_threshold=0.1), summary)
    assert found and found["relative_drop"] == 0.5 and found["best_model"] == "step-1000"
    arts = _artifacts(run_id)
    assert {"run-counts", "quarantine", "stage-timings", "inference-passes", "caption-report"} <= set(arts)
    by_reason = {r["reason"]: r for r in _rows(arts["quarantine"])}
    assert by_reason["decode_error"]["count"] == 3 and "a.jpg: truncated" in by_reason["decode_error"]["examples"]
    assert by_reason["decode_error"]["examples"].count("|") == 2  # three examples at most
    assert {r["stage"]: r["cached"] for r in _rows(arts["stage-timings"])} == {
        "ingest": False,
        "preprocess": True,
        "inference": True,
        "total": False,
    }
    assert "## Headline metrics" in arts["caption-report"].data
    events = _regression_events(summary["model_fingerprint"], wait_s=30)
    assert len(events) == 1
    payload = events[0]["payload"]
    assert payload["model"] == "step-2000" and payload["metric"] == "cider" and payload["delta"] == -0.5


def test_no_regression_no_event(prefect_api, tmp_path):
    summary = _summary(tmp_path, cider_delta=-0.01)  # 2% below the best: within 0.05
    run_id, found = _publish(RunConfig(model="step-3000"), summary)
    assert found is None
    assert "run-counts" in _artifacts(run_id)
    assert _regression_events(summary["model_fingerprint"], wait_s=3) == []


def test_a_cached_rerun_reports_the_regression_without_alerting_again(prefect_api, tmp_path):
    summary = _summary(tmp_path, cider_delta=-0.5)
    summary["cached_stages"] = ["preprocess", "inference", "evaluate"]
    _, found = _publish(RunConfig(model="step-2000", regression_threshold=0.1), summary)
    assert found and found["relative_drop"] == 0.5  # still in the summary
    assert _regression_events(summary["model_fingerprint"], wait_s=5) == []


def test_a_report_on_s3_gets_a_signed_link_a_browser_opens(s3_bucket, tmp_path):
    """The UI cannot open file:// links: a report on an object store is linked by a signed https/http URL that
    fetches it without credentials (the tests' S3-compatible server); a local one keeps its file:// URI."""
    import urllib.request

    from captionflow.data.storage import open_fs
    from tasks.publish import report_link

    fs, path = open_fs(f"s3://{s3_bucket}/runs/x/report.html")
    fs.pipe_file(path, b"<!doctype html><title>report</title>")
    link, how = report_link(f"s3://{s3_bucket}/runs/x/report.html")
    assert link.startswith("http") and "Signature" in link and "7 days" in how
    with urllib.request.urlopen(link, timeout=10) as r:  # no credentials: the signature is the permission
        assert r.read() == b"<!doctype html><title>report</title>"
    local, how = report_link(str(tmp_path / "report.html"))
    assert local == (tmp_path / "report.html").resolve().as_uri() and "local file" in how


def test_a_local_report_opens_in_a_browser_from_the_ui_through_the_output_roots_server(tmp_path):
    """report_url: the output root served read only by ``captionflow reports``; the link artifact's URL is the
    report's place there, and a real browser renders it from that link (the UI's file:// link it refused)."""
    import signal
    import socket
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    import pytest
    from browser import rendered_dom

    from tasks.publish import report_link

    out = tmp_path / "out"
    (out / "runs" / "ds" / "m" / "g").mkdir(parents=True)
    report = out / "runs" / "ds" / "m" / "g" / "report.html"
    report.write_text("<!doctype html><html><head><title>captionflow report</title></head><body>"
                      "<h1 id='r'>the report</h1></body></html>")  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "reports", "--output", str(out), "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert "read only at http://127.0.0.1:" in server.stdout.readline()
        link, how = report_link(str(report), str(out), f"http://127.0.0.1:{port}/")
        assert link == f"http://127.0.0.1:{port}/runs/ds/m/g/report.html" and "served from the output root" in how
        dom = rendered_dom(link, tmp_path / "profile")
        assert '<h1 id="r">the report</h1>' in dom
        with pytest.raises(urllib.error.HTTPError, match="403"):  # no listings of the root
            urllib.request.urlopen(f"http://127.0.0.1:{port}/runs/", timeout=10)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/runs/ds/m/g/report.html", data=b"x", method="PUT")
        with pytest.raises(urllib.error.HTTPError, match="501"):  # nothing is written
            urllib.request.urlopen(req, timeout=10)
        # outside the served root, the other links stay as they were
        assert report_link("s3://b/x/report.html", str(out), f"http://127.0.0.1:{port}/")[0] != link
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 143
