"""The whole flow on the demo set: real Prefect API, real Ray Data, real vLLM CPU engine."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from captionflow.builtin.demo_data import DEMO_CAPTIONS, FAULTY_FILES, HIDDEN_FILES
from tests.support.browser import DomCounts, rendered_dom

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(prefect_api, tmp_path_factory):
    from flows.cli import main

    out = tmp_path_factory.mktemp("out")
    first, second = out / "first.json", out / "second.json"
    args = ["run", "--output", str(out), "--device", "cpu", "--judge", "--clip-model", "builtin"]
    assert main([*args, "--summary-json", str(first)]) == 0
    assert main([*args, "--summary-json", str(second)]) == 0
    return out, json.loads(first.read_text()), json.loads(second.read_text())


def test_summary_has_documented_shape(demo_run):
    _, s, _ = demo_run
    assert {"dataset_dir", "run_dir", "counts", "metrics", "timings_s"} <= set(s)
    assert {"total", "accepted", "quarantined", "captioned", "failed"} <= set(s["counts"])
    assert {"bleu_4", "rouge_l", "cider"} <= set(s["metrics"]["reference"])
    assert s["metrics"]["stats"]["n_captions"] == s["counts"]["captioned"]
    assert s["timings_s"]["total_s"] > 0
    clip = s["metrics"]["clip"]  # the reference-free score, through Ray Data
    assert clip["clip_model"] == "builtin" and clip["scored"] == s["counts"]["captioned"] and clip["failed"] == 0
    scores = pq.read_table(f"{s['run_dir']}/scores.parquet").to_pylist()
    assert all(0.0 <= r["clip_score"] <= 2.5 for r in scores)
    assert sum(r["clip_score"] for r in scores) / len(scores) == pytest.approx(clip["mean"])


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
    reasons = {}
    for r in q:
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    assert s["quarantine_reasons"] == reasons
    assert s["hidden_skipped"] == {"count": len(HIDDEN_FILES), "examples": sorted(HIDDEN_FILES)}  # not inputs


def test_captions_from_kept_fitted_images_equal_captions_from_decoding(demo_run, tmp_path):
    """The demo set is a golden set: its images are fitted to the engine's grid once and kept beside its shards
    (``workers/fitted_images.py``); a run that keeps none (every image decoded in its own preprocess) captions
    exactly the same."""
    import glob

    from cli_runs import assert_same_captions

    from captionflow.data.layout import FITTED
    from flows.cli import main

    out, s, _ = demo_run
    files = sorted(glob.glob(f"{out}/datasets/*/{FITTED}/*/part-*.parquet"))
    assert files and sum(pq.read_metadata(f).num_rows for f in files) == s["counts"]["accepted"]
    decoded_out, summary = tmp_path / "decoded", tmp_path / "decoded.json"
    args = ["run", "--output", str(decoded_out), "--device", "cpu", "--engine-image-cache-max-images", "0"]
    assert main([*args, "--summary-json", str(summary)]) == 0
    decoded = json.loads(summary.read_text())
    assert glob.glob(f"{decoded_out}/datasets/*/{FITTED}/*/part-*.parquet") == []  # nothing kept
    assert_same_captions(decoded, s, s["counts"]["accepted"])


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
    assert s["cached_stages"] == []
    # same inputs: every stage after the listing is a Prefect cache hit keyed on fingerprints
    assert second["cached_stages"] == ["preprocess", "inference", "judge", "clip-score", "evaluate"]
    assert second["preprocess_skipped"] is True
    assert second["dataset_dir"] == s["dataset_dir"] and second["run_dir"] == s["run_dir"]
    assert second["counts"] == s["counts"]
    assert "inference.ray_init_s" not in second["timings_s"]


def test_a_cached_rerun_publishes_its_artifacts_too(demo_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    _, s, second = demo_run
    assert s["flow_run_id"] and second["flow_run_id"] and s["flow_run_id"] != second["flow_run_id"]
    with get_client(sync_client=True) as client:
        for run in (s, second):
            arts = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run["flow_run_id"]]))
            )
            keys = {a.key for a in arts}
            assert {
                "run-counts",
                "quarantine",
                "stage-timings",
                "inference-passes",
                "caption-report",
                "caption-report-html",
            } <= keys, keys
            link = next(a for a in arts if a.key == "caption-report-html")
            assert Path(run["report_html"]).resolve().as_uri() in link.data
            flow_run = client.read_flow_run(run["flow_run_id"])
            assert flow_run.state.is_completed()
            assert flow_run.state.result()["run_dir"] == run["run_dir"]  # the summary, persisted


def test_judge_answers_always_parse(demo_run):
    _, s, _ = demo_run
    j = s["metrics"]["judge"]
    assert j["parse_rate"] == 1.0  # structured outputs: even the random built-in model's answers parse
    assert j["judged"] == s["counts"]["captioned"] and j["failed"] == 0
    assert 1.0 <= j["mean_score"] <= 5.0 and sum(j["distribution"].values()) == j["judged"]
    scores = pq.read_table(f"{s['run_dir']}/scores.parquet").to_pylist()
    assert all(r["judge_score"] in {1, 2, 3, 4, 5} for r in scores)
    thirds = j["length"]["mean_score_by_length"]  # the judge's score beside caption length
    assert set(thirds) == {"shortest third", "middle third", "longest third"}
    words = [thirds[k]["mean_words"] for k in ("shortest third", "middle third", "longest third")]
    assert words == sorted(words) and all(1.0 <= t["mean_score"] <= 5.0 for t in thirds.values())


def test_report_and_leaderboard_written(demo_run):
    out, s, _ = demo_run
    report = Path(s["report"]).read_text(encoding="utf-8")
    assert "## Headline metrics" in report and "cider" in report
    lb = pq.read_table(out / "leaderboard.parquet").to_pylist()
    assert s["run_dir"] in {r["run_dir"] for r in lb}
    assert "## LLM judge" in report


def test_second_checkpoint_compared_on_leaderboard(demo_run, tmp_path_factory, capsys):
    from captionflow.builtin.model import build_builtin_model
    from flows.cli import main

    out, s, _ = demo_run
    ckpt2 = build_builtin_model(tmp_path_factory.mktemp("ckpt") / "step-2000", seed=1)
    summary = out / "compare.json"
    assert (
        main(
            [
                "compare",
                "builtin",
                str(ckpt2),
                "--output",
                str(out),
                "--device",
                "cpu",
                "--pairwise-against",
                "previous",
                "--summary-json",
                str(summary),
            ]
        )
        == 0
    )
    res = json.loads(summary.read_text())
    first, second = res["runs"]
    printed = capsys.readouterr().out  # where each checkpoint's report is
    assert (
        f"report  builtin: {first['report_html']}" in printed and f"report  {ckpt2}: {second['report_html']}" in printed
    )
    assert first["run_dir"] == s["run_dir"] and "inference" in first["cached_stages"]
    assert "preprocess" in second["cached_stages"]  # the golden set is preprocessed once
    assert second["run_dir"] != s["run_dir"] and second["counts"]["captioned"] == s["counts"]["accepted"]
    board = pq.read_table(out / "leaderboard.parquet").to_pylist()
    assert {r["run_dir"] for r in board} == {s["run_dir"], second["run_dir"]}
    comp = second["metrics"]["comparison"]
    assert comp["runs_on_dataset"] == 2 and comp["previous"]["run_dir"] == s["run_dir"]
    assert comp["previous"]["cider"] == pytest.approx(
        second["metrics"]["reference"]["cider"] - s["metrics"]["reference"]["cider"]
    )
    report = Path(second["report"]).read_text(encoding="utf-8")
    assert "Against earlier checkpoints" in report
    sig = comp["previous"]["significance"]  # a paired bootstrap against the first checkpoint's scores.parquet
    assert {"cider", "bleu_4", "rouge_l", "judge_mean"} >= set(sig) >= {"cider", "bleu_4", "rouge_l"}
    for v in sig.values():
        assert v["n_images"] == s["counts"]["captioned"] and v["ci_low"] <= v["delta"] <= v["ci_high"]
        assert v["verdict"] in ("better", "worse", "no detectable difference")
    # the command says each checkpoint's answer beside its report: the second's against the first
    n = s["counts"]["captioned"]
    said = f"vs builtin: CIDEr-D {sig['cider']['delta']:+.4f}, 95% [{sig['cider']['ci_low']:+.4f}, "
    assert said in printed and f"{sig['cider']['verdict']} (paired bootstrap on {n:,} images)" in printed, printed
    assert sig["cider"]["delta"] == pytest.approx(comp["previous"]["cider"])  # every image paired: the same delta
    assert "Is the difference real? Against the previous run" in report
    assert first["metrics"]["pairwise"]["baseline_model"] == ""  # nothing earlier to judge against: said so
    assert "Not judged: no earlier run" in Path(first["report"]).read_text(encoding="utf-8")
    p = second["metrics"]["pairwise"]
    n = s["counts"]["captioned"]
    assert p["baseline_run_dir"] == s["run_dir"] and p["judged"] == n and p["failed"] == 0
    assert p["parse_rate"] == 1.0  # structured output: the random model's answers parse too
    assert p["wins"] + p["losses"] + p["ties"] == n and 0.0 <= p["consistency"] <= 1.0
    st = p["stats"]
    assert st["ci_low"] <= st["win_rate"] <= st["ci_high"] and st["n_images"] == n
    assert st["verdict"] in ("better", "worse", "no detectable difference")
    per_image = [r["pairwise_score"] for r in pq.read_table(f"{second['run_dir']}/scores.parquet").to_pylist()]
    assert set(per_image) <= {0.0, 0.5, 1.0} and sum(per_image) / n == pytest.approx(st["win_rate"])
    assert "Pairwise judge against" in report
    lb = p["length_bias"]  # both sides' lengths and the win rate by length difference, next to the verdict
    assert lb["mean_words"] > 0 and lb["baseline_mean_words"] > 0
    assert sum(g["images"] for g in lb["win_rate_by_length"].values()) == n
    assert "win rate by length" in report
    page = Path(second["report_html"])
    assert page.parent == Path(second["run_dir"]) and (page.parent / "chart.png").exists()
    dom = DomCounts(rendered_dom(page, tmp_path_factory.mktemp("browser")))
    assert dom.rows["images"] == n and len(dom.rows) == 2  # every demo image, and the side-by-side view
    assert 0 < dom.rows["side-by-side"] <= n
    assert len(dom.images) == n + dom.rows["side-by-side"] + 1  # a thumbnail per row, the chart
    assert dom.body["data-images-loaded"] == str(len(dom.images))  # all decoded by the browser


def test_a_pairwise_rerun_judges_no_pair_again(demo_run, tmp_path_factory):
    from flows.cli import main

    out, s, _ = demo_run
    ckpt2 = next(iter(tmp_path_factory.getbasetemp().glob("ckpt*/step-2000")))
    compared = [r for r in pq.read_table(out / "leaderboard.parquet").to_pylist() if r["model"] == str(ckpt2)]
    assert compared, "runs after test_second_checkpoint_compared_on_leaderboard"
    folder = Path(compared[0]["run_dir"]) / "pairwise"
    before = sorted(p.name for p in folder.rglob("*.parquet"))
    assert before
    rerun = out / "pairwise-rerun.json"
    args = ["run", "--model", str(ckpt2), "--output", str(out), "--device", "cpu", "--pairwise-against", "previous"]
    assert main([*args, "--summary-json", str(rerun)]) == 0
    p = json.loads(rerun.read_text())["metrics"]["pairwise"]
    assert p["baseline_run_dir"] == s["run_dir"] and p["judged"] == s["counts"]["captioned"]
    assert sorted(p.name for p in folder.rglob("*.parquet")) == before  # every judgement was already committed


def test_flow_runs_recorded_by_prefect_api(demo_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["captionflow"])))
        completed = {r.id for r in runs if r.state and r.state.is_completed()}
        assert len(completed) >= 2
        per_run: dict = {}
        by_name: dict = {}
        for t in client.read_task_runs():
            if t.flow_run_id in completed:
                per_run.setdefault(t.flow_run_id, {})[t.name.rsplit("-", 1)[0]] = t.state.name
                by_name.setdefault(t.flow_run_id, {})[t.name.rsplit("-", 1)[0]] = t
    # the listing goes to preprocess unwalked (opaque), and the UI still draws ingest -> preprocess
    for tasks in by_name.values():
        upstream = [i.id for i in tasks["preprocess"].task_inputs["ing"]]
        assert upstream == [tasks["ingest"].id], (upstream, tasks["ingest"].id)
    fresh = [st for st in per_run.values() if st.get("inference") == "Completed"]
    reused = [st for st in per_run.values() if st.get("inference") == "Cached"]
    assert fresh and set(fresh[0]) >= {"ingest", "preprocess", "inference", "evaluate"}
    fully = [st for st in reused if st.get("preprocess") == "Cached" and st.get("evaluate") == "Cached"]
    assert fully, reused  # the plain rerun: every stage after the listing came from the cache
    assert fully[0]["ingest"] == "Completed"  # the listing always runs


def test_the_engines_key_lines_reach_the_run_log(demo_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    _, s, _ = demo_run
    APILogWorker.drain_all()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[s["flow_run_id"]])))
    text = [log.message for log in logs]
    ready = [m for m in text if "init engine (profile, create kv cache, warmup model) took" in m]
    assert ready, text  # forwarded from the vLLM engine's worker process
    assert not any("[core.py:" in m for m in ready)  # vLLM's own prefix dropped
    assert any(m.startswith("inference: captioned ") and "rows/s" in m for m in text), text
    assert len(text) < 200  # key lines, not the engine's whole output
    # a completed run's log has no ERROR line (its engines' shutdown once forwarded KeyError '/psm_...' lines)
    assert [m for m in logs if m.level >= 40] == [], [m.message for m in logs if m.level >= 40]
