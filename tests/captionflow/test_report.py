"""The leaderboard (upserts, deltas against earlier runs) and the markdown report, without a flow."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from captionflow.layout import LEADERBOARD
from captionflow.report import render_report, update_leaderboard
from captionflow.results import Counts, InferenceResult, Manifest
from captionflow.storage import Store


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


def test_report_shows_counts_metrics_and_best_and_worst_captions():
    manifest = Manifest(
        dataset_fingerprint="ds",
        schema_version=1,
        source="/data/golden",
        kind="images",
        counts=Counts(listed=5, accepted=4, quarantined=1, duplicates=0),
        quarantine_reasons={"empty_file": 1},
        shards=[],
        params={},
        seconds=0.1,
    )
    inference = InferenceResult(
        run_dir="/out/runs/x",
        run_parts=("runs", "ds", "m", "g"),
        accepted=4,
        captioned=4,
        failed=0,
        resumed_from=0,
        passes=[],
        timings_s={},
    )
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
    assert "| previous | `old` |" in text and "-0.2500" in text
    best = text[text.index("## Best captions") : text.index("## Worst captions")]
    assert best.index("img3.jpg") < best.index("img2.jpg") and "a \\| cat 3" in best
