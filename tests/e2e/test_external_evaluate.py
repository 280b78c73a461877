"""`captionflow evaluate` on captions produced elsewhere: real Prefect API, the demo set, real Parquet."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from captionflow.builtin.demo_data import DEMO_CAPTIONS


def _write(path: Path, captions: dict[str, str]) -> str:
    path.write_text("".join(json.dumps({"file_name": k, "caption": v}) + "\n" for k, v in captions.items()))
    return str(path)


def test_external_captions_get_the_metrics_report_leaderboard_and_verdict_of_a_run(prefect_api, tmp_path):
    from flows.cli import main

    out = tmp_path / "out"
    good = _write(tmp_path / "good.jsonl", {k: refs[0] for k, refs in DEMO_CAPTIONS.items()})
    bad = _write(tmp_path / "bad.jsonl", dict.fromkeys(DEMO_CAPTIONS, "a photo of something"))
    args = ["--output", str(out), "--bootstrap-resamples", "2000", "--summary-json"]
    assert main(["evaluate", good, "--name", "teacher", *args, str(tmp_path / "good.json")]) == 0
    assert main(["evaluate", bad, *args, str(tmp_path / "bad.json")]) == 0
    first, second = (json.loads((tmp_path / f).read_text()) for f in ("good.json", "bad.json"))

    n = len(DEMO_CAPTIONS)
    assert first["counts"]["captioned"] == n and first["counts"]["failed"] == 0
    assert first["metrics"]["reference"]["cider"] > 1.0  # each caption is one of its image's references
    assert Path(first["report_html"]).exists() and Path(first["report"]).exists()
    board = {r["model"]: r for r in pq.read_table(out / "leaderboard.parquet").to_pylist()}
    assert set(board) == {"external:teacher", "external:bad.jsonl"}
    assert all(r["external"] and r["generation_fingerprint"] == "external" for r in board.values())
    comp = second["metrics"]["comparison"]["previous"]
    assert comp["model"] == "external:teacher"  # external captions are compared with external captions
    sig = comp["significance"]["cider"]  # worse by construction: the interval excludes 0
    assert sig["verdict"] == "worse" and sig["ci_high"] < 0 and sig["n_images"] == n
    assert "Is the difference real?" in Path(second["report"]).read_text(encoding="utf-8")
    assert main(["evaluate", str(tmp_path / "missing.jsonl"), "--output", str(out)]) == 2  # a clear user error
