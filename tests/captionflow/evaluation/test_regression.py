"""The regression alert's decision: the primary metric against the best comparable run's."""

from __future__ import annotations

from captionflow.evaluation.regression import regression


def _summary(cider, best_delta, previous_delta=None, verdict=None):
    best = {"model": "best", "run_dir": "runs/best", "cider": best_delta}
    if verdict:
        best["significance"] = {"cider": {"verdict": verdict, "delta": best_delta}}
    comparison = {
        "best_so_far": None if best_delta is None else best,
        "previous": None
        if previous_delta is None
        else {"model": "prev", "run_dir": "runs/prev", "cider": previous_delta},
    }
    return {"run_dir": "runs/this", "metrics": {"reference": {"cider": cider}, "comparison": comparison}}


def test_a_drop_beyond_the_threshold_is_a_regression_with_its_deltas():
    r = regression(_summary(0.80, -0.20, -0.05), threshold=0.05)  # best 1.0, this 0.8: 20% below
    assert r["metric"] == "cider" and r["best_value"] == 1.0 and abs(r["relative_drop"] - 0.2) < 1e-9
    assert r["best_model"] == "best" and r["deltas_vs_best"] == {"cider": -0.20}
    assert r["deltas_vs_previous"] == {"cider": -0.05} and r["previous_model"] == "prev"


def test_small_drops_gains_and_runs_without_a_comparison_are_not():
    assert regression(_summary(0.98, -0.02), threshold=0.05) is None  # 2% below: within the threshold
    assert regression(_summary(1.2, 0.2), threshold=0.0) is None  # better than the best
    assert regression(_summary(1.0, None), threshold=0.0) is None  # the first run on this dataset and settings
    assert regression(_summary(None, -0.5), threshold=0.0) is None  # no references: no primary metric
    assert regression(_summary(0.98, -0.02), threshold=0.0) is not None  # threshold 0: any drop


def test_a_drop_the_runs_own_paired_bootstrap_calls_noise_is_not_a_regression():
    """The alert fired on drops its own bootstrap called "no detectable difference": a false alarm for teams."""
    assert regression(_summary(0.80, -0.20, verdict="no detectable difference"), threshold=0.05) is None
    worse = regression(_summary(0.80, -0.20, verdict="worse"), threshold=0.05)
    assert worse is not None and worse["verdict_vs_best"] == "worse"
    assert regression(_summary(0.80, -0.20), threshold=0.05)["verdict_vs_best"] is None  # not computed: the threshold
