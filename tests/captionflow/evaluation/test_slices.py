"""Slices: which slice an image is in, and the metrics of each."""

from __future__ import annotations

import pytest

from captionflow.evaluation.slices import NO_SLICE, TOP_LEVEL, folder_slice, slice_metrics, slices_of


def test_the_slice_of_an_image():
    assert folder_slice("cats/indoor/1.jpg") == "cats/indoor" and folder_slice("1.jpg") == TOP_LEVEL
    sources = {"i1": "cats/1.jpg", "i2": "2.jpg"}
    assert slices_of("images", sources, None) == {"i1": "cats", "i2": TOP_LEVEL}
    assert slices_of("parquet", {"i1": "a.parquet#0"}, None) == {}  # a Parquet dataset needs its column
    assert slices_of("parquet", {"i1": "a.parquet#0", "i2": "a.parquet#1"}, {"i1": 3, "i2": None}) == {
        "i1": "3",
        "i2": NO_SLICE,
    }


def test_slice_metrics_are_means_of_per_image_scores_with_counts():
    rows = [
        {"image_id": "a", "cider": 1.0, "judge_score": None},
        {"image_id": "b", "cider": 0.5, "judge_score": None},
        {"image_id": "c", "cider": 0.0, "judge_score": None},
    ]
    out = slice_metrics(rows, {"a": "x", "b": "x", "c": "y"})
    assert out == [{"slice": "x", "n": 2, "cider": pytest.approx(0.75)}, {"slice": "y", "n": 1, "cider": 0.0}]
    assert slice_metrics(rows, {"a": "x", "b": "x", "c": "x"}) is None  # one slice: nothing to break down
    assert [r["slice"] for r in slice_metrics(rows, {"a": "x"})] == [NO_SLICE, "x"]
