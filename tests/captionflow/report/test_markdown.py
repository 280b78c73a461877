"""The leaderboard (upserts, deltas against earlier runs) and the markdown report, without a flow."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from captionflow.data.layout import LEADERBOARD
from captionflow.data.storage import Store
from captionflow.report.markdown import evaluated_as, read_leaderboard, render_report, update_leaderboard
from captionflow.results import Counts, InferenceResult, Manifest


def _metrics(cider: float, n: int = 10) -> dict:
    return {
        "stats": {"n_captions": n, "failure_rate": 0.0},
        "reference": {"bleu_4": cider / 10, "rouge_l": cider / 2, "cider": cider},
    }


def test_leaderboard_upserts_and_compares_with_previous_and_best(tmp_path):
    store = Store(str(tmp_path))
    run = lambda m: ("runs", "ds", m, "gen")
    assert update_leaderboard(store, "ds", run("m1"), "ckpt-1", _metrics(0.5))["previous"] is None
    comp = update_leaderboard(store, "ds", run("m2"), "ckpt-2", _metrics(0.3))
    assert comp["runs_on_dataset"] == 2 and comp["previous"]["model"] == "ckpt-1"
    assert comp["previous"]["cider"] == pytest.approx(-0.2) and comp["best_so_far"]["model"] == "ckpt-1"
    update_leaderboard(store, "ds", run("m2"), "ckpt-2", _metrics(0.7))  # the same run again: replaced
    rows = pq.read_table(store.path(LEADERBOARD)).to_pylist()
    assert sorted((r["model"], r["cider"]) for r in rows) == [("ckpt-1", 0.5), ("ckpt-2", 0.7)]
    other = update_leaderboard(store, "other-ds", run("m3"), "ckpt-3", _metrics(0.1))
    assert other["previous"] is None and other["runs_on_dataset"] == 1  # never across datasets


def test_a_row_says_its_deadline_and_rows_of_an_older_version_keep_the_newer_columns(tmp_path):
    from captionflow.report.markdown import ROWS, _row_name

    store = Store(str(tmp_path))
    update_leaderboard(store, "ds", ("runs", "ds", "m1", "gen"), "ckpt-1", _metrics(0.5))
    old = store.read_json(ROWS, _row_name(read_leaderboard(store)[0]))
    for key in ("verdict", "deadline"):  # a row written before these columns existed
        del old[key]
    store.write_json(old, ROWS, _row_name(old))
    missed = {"deadline": "2026-11-29T06:00:00", "line": "MISSED by 3 h 05 min", "met": False, "spare_s": -11100.0}
    update_leaderboard(store, "ds", ("runs", "ds", "m2", "gen"), "ckpt-2", {**_metrics(0.3), "deadline": missed})
    rows = {r["model"]: r for r in pq.read_table(store.path(LEADERBOARD)).to_pylist()}
    assert rows["ckpt-2"]["deadline"] == "MISSED by 3 h 05 min (2026-11-29T06:00:00)"
    assert rows["ckpt-1"]["deadline"] is None and "verdict" in rows["ckpt-1"]


def test_a_copied_checkpoint_is_named_as_the_row_it_shares(tmp_path):
    store = Store(str(tmp_path))
    run = ("runs", "ds", "m1", "gen")
    assert evaluated_as(store, store.url(*run), "ckpt-1") is None  # no row yet
    update_leaderboard(store, "ds", run, "/ckpts/step-1000", _metrics(0.5))
    assert evaluated_as(store, store.url(*run), "/ckpts/step-1000") is None  # the same name
    assert evaluated_as(store, store.url(*run), "/copies/step-1000") == "/ckpts/step-1000"


def test_comparisons_never_cross_generation_settings_and_a_missing_judge_keeps_its_score(tmp_path):
    store = Store(str(tmp_path))
    update_leaderboard(
        store, "ds", ("runs", "ds", "m1", "max16"), "ckpt-1", {**_metrics(0.9), "judge": {"mean_score": 4.0}}
    )
    comp = update_leaderboard(store, "ds", ("runs", "ds", "m2", "max32"), "ckpt-2", _metrics(0.1))
    assert comp["previous"] is None and comp["best_so_far"] is None  # other generation settings: no comparison
    update_leaderboard(store, "ds", ("runs", "ds", "m1", "max16"), "ckpt-1", _metrics(0.8))  # evaluated again, no judge
    row = next(r for r in read_leaderboard(store) if r["model_fingerprint"] == "m1")
    assert row["cider"] == 0.8 and row["judge_mean"] == 4.0


def _upserts(root: str, writer: int, n: int) -> None:
    store = Store(root)
    for i in range(n):
        update_leaderboard(store, "ds", ("runs", "ds", f"w{writer}-{i}", "gen"), f"ckpt-{writer}-{i}", _metrics(i / n))


def test_concurrent_writers_lose_no_row(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_upserts, args=(str(tmp_path), w, 40)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    store = Store(str(tmp_path))
    assert len(read_leaderboard(store)) == 80
    assert pq.read_table(store.path(LEADERBOARD)).num_rows == 80  # the compacted view holds every row too


def _manifest_and_inference(source: str, counts: Counts, reasons: dict) -> tuple[Manifest, InferenceResult]:
    """A dataset's manifest and a run of it that captioned every accepted image."""
    manifest = Manifest(
        dataset_fingerprint="ds",
        schema_version=1,
        source=source,
        kind="images",
        counts=counts,
        quarantine_reasons=reasons,
        shards=[],
        params={},
        seconds=0.1,
    )
    inference = InferenceResult(
        run_dir="/out/runs/x",
        run_parts=("runs", "ds", "m", "g"),
        accepted=counts.accepted,
        captioned=counts.accepted,
        failed=0,
        resumed_from=0,
        passes=[],
        timings_s={},
    )
    return manifest, inference


def test_report_shows_counts_metrics_and_best_and_worst_captions():
    counts = Counts(listed=5, accepted=4, quarantined=1, duplicates=0)
    manifest, inference = _manifest_and_inference("/data/golden", counts, {"empty_file": 1})
    metrics = {
        "stats": {
            "words": {"mean": 5.0},
            "truncated_rate": 0.25,
            "empty_rate": 0.0,
            "repetition_rate": 0.1,
            "vocabulary_size": 12,
            "failure_rate": 0.0,
        },
        "reference": {"bleu_1": 0.4, "bleu_4": 0.1, "rouge_l": 0.3, "cider": 0.5},
        "comparison": {
            "previous": {
                "model": "old",
                "run_dir": "/r",
                "bleu_4": 0.01,
                "rouge_l": None,
                "cider": -0.25,
                "meteor": None,
                "judge_mean": None,
            }
        },
    }
    scores = [
        {"source": f"img{i}.jpg", "caption": f"a | cat {i}", "references": ["a cat"], "cider": i / 10} for i in range(4)
    ]
    text = render_report("ckpt-9", manifest, inference, metrics, scores)
    assert "- inputs: 5 listed, 4 accepted, 1 quarantined, 0 duplicates" in text
    assert "| cider | 0.5000 |" in text and "| truncated at max_tokens | 25.0% |" in text
    assert "| previous | old |" in text and "-0.2500" in text
    best = text[text.index("## Best captions") : text.index("## Worst captions")]
    assert best.index("img3.jpg") < best.index("img2.jpg") and "a \\| cat 3" in best
    assert "no reference metric" not in text and "None to compare" not in text
    alone = {**metrics, "reference": {}, "comparison": {"previous": None, "best_so_far": None, "runs_on_dataset": 1}}
    text = render_report("ckpt-9", manifest, inference, alone, [])
    assert "no reference metric: the dataset has no reference captions" in text  # says why, and what to do
    assert "None to compare: no earlier run on this dataset with the same generation settings" in text


def test_report_lists_caption_health_with_examples():
    from captionflow.evaluation.caption_health import caption_health
    from captionflow.report.markdown import _health_lines

    rows = [
        {"image_id": "a", "caption": "I'm sorry, I cannot | describe this."},
        {"image_id": "b", "caption": "A dog on a beach."},
    ]
    text = "\n".join(_health_lines(caption_health(rows, ["Describe this image."])))
    assert "## Caption health" in text
    assert "| refusal | 1 | 50.0% | a: " in text and "cannot \\| describe" in text  # the pipe cannot break the table
    assert "| prompt echo | 0 | 0.0% | - |" in text
    assert _health_lines(None) == [] and _health_lines(caption_health([], [])) == []


HOSTILE = [
    "two\r\nlines | and a pipe",
    "a <b>bold</b> <img src=x onerror=alert(1)> tag",
    "carriage\rreturn and *stars* and _under_ and `ticks`",
    "# not a heading\n| not | a | row |",
]


def test_captions_and_file_names_cannot_break_the_markdown():
    """Captions and file names with \\r, newlines, pipes and HTML: every table row of the rendered report keeps its
    cells, no tag from the data becomes an element, and the text is still there to read (a real CommonMark + GFM
    renderer: markdown-it)."""
    from markdown_it import MarkdownIt

    from captionflow.report.markdown import md_text

    counts = Counts(listed=4, accepted=4, quarantined=0, duplicates=0)
    manifest, inference = _manifest_and_inference("/data/<golden>|set", counts, {})
    stats = {"words": {"mean": 5.0}, "truncated_rate": 0, "empty_rate": 0, "repetition_rate": 0, "failure_rate": 0}
    metrics = {
        "stats": {**stats, "vocabulary_size": 9},
        "reference": {"cider": 0.5},
        "comparison": {"previous": {"model": "ckpt|<i>old</i>", "run_dir": "/r", "cider": -0.1}},
    }
    scores = [
        {"source": f"{h[:12]}.jpg", "caption": h, "references": [h], "cider": i / 10} for i, h in enumerate(HOSTILE)
    ]
    text = render_report("model\n<script>x</script>", manifest, inference, metrics, scores)
    html = MarkdownIt("commonmark").enable("table").render(text)
    assert "<script" not in html and "<b>" not in html and "<img" not in html and "<i>" not in html
    assert "&lt;b&gt;bold&lt;/b&gt;" in html  # shown as text
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    rows, cells, widths = 0, 0, []
    for t in tokens:
        if t.type == "thead_open":
            widths.append(None)
        elif t.type == "tr_open":
            rows, cells = rows + 1, 0
        elif t.type in ("th_open", "td_open"):
            cells += 1
        elif t.type == "tr_close":
            widths[-1] = widths[-1] or cells
            assert cells == widths[-1], text  # no row gained or lost a cell
    best = text[text.index("## Best captions") : text.index("## Worst captions")]
    assert len([line for line in best.splitlines() if line.startswith("| ")]) == 1 + 3  # header + 3 rows, none split
    assert md_text("a\r\nb\rc\nd") == "a b c d" and md_text("x" * 10, 5) == "xxxx…"
