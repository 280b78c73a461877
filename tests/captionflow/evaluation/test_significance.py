"""The paired bootstrap: differences by construction are found, identical runs and noise are not."""

from __future__ import annotations

import numpy as np
import pytest

from captionflow.evaluation.significance import BETTER, SAME, WORSE, holm, paired_bootstrap, win_rate


def _run(n: int, seed: int, shift: float = 0.0, noise: float = 0.0, base=None) -> dict:
    rng = np.random.default_rng(seed)
    if base is None:
        return {
            f"img{i}": {"cider": float(rng.random()), "bleu_4": float(rng.random()), "rouge_l": float(rng.random())}
            for i in range(n)
        }
    return {k: {m: v + shift + float(rng.normal(0, noise)) for m, v in d.items()} for k, d in base.items()}


def test_a_difference_by_construction_is_better_or_worse_with_an_interval_excluding_zero():
    base = _run(500, 0)
    up = _run(0, 1, shift=0.03, noise=0.05, base=base)
    res = paired_bootstrap(up, base, n_resamples=1000)
    for m in ("cider", "bleu_4", "rouge_l"):
        assert res[m]["verdict"] == BETTER and 0 < res[m]["ci_low"] < res[m]["delta"] < res[m]["ci_high"]
        assert res[m]["n_images"] == 500 and res[m]["p_holm"] < 0.05
    down = paired_bootstrap(base, up, n_resamples=1000)
    assert down["cider"]["verdict"] == WORSE and down["cider"]["ci_high"] < 0
    assert down["cider"]["delta"] == pytest.approx(-res["cider"]["delta"])


def test_identical_runs_and_pure_noise_show_no_detectable_difference():
    base = _run(500, 0)
    same = paired_bootstrap(base, base)
    assert all(v["verdict"] == SAME and v["delta"] == 0 and v["p_value"] == 1.0 for v in same.values())
    # no shift: any verdict but SAME is a false alarm; Holm keeps the chance of any per comparison <= 5%
    trials = 60
    alarms = sum(
        any(v["verdict"] != SAME for v in paired_bootstrap(_run(0, s, noise=0.05, base=base), base, seed=s).values())
        for s in range(1, trials + 1)
    )
    assert alarms <= 8, alarms  # expected <= 3; P(> 8 | 5%) < 0.2%


def test_only_images_both_runs_scored_are_paired_and_missing_metrics_are_left_out():
    a = {"x": {"cider": 1.0, "judge_mean": None}, "y": {"cider": 0.5, "judge_mean": None}, "z": {"cider": 0.0}}
    b = {"x": {"cider": 0.5, "judge_mean": 3}, "y": {"cider": 0.5, "judge_mean": 4}}
    res = paired_bootstrap(a, b, n_resamples=200)
    assert set(res) == {"cider"} and res["cider"]["n_images"] == 2 and res["cider"]["delta"] == 0.25


def test_the_same_seed_gives_the_same_answer_and_holm_adjusts_in_order():
    base, up = _run(200, 0), _run(0, 1, shift=0.01, noise=0.1, base=_run(200, 0))
    assert paired_bootstrap(up, base, seed=3) == paired_bootstrap(up, base, seed=3)
    adj = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert adj == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})  # 3 x 0.01, 2 x 0.03, max(0.06, 1 x 0.04)
    assert holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}


def test_the_pairwise_win_rate_and_its_interval():
    rng = np.random.default_rng(3)
    wins = list(rng.choice([1.0, 0.5, 0.0], size=300, p=[0.6, 0.25, 0.15]))  # better by construction
    w = win_rate(wins, n_resamples=1000)
    assert w["verdict"] == BETTER and 0.5 < w["ci_low"] <= w["win_rate"] <= w["ci_high"]
    assert w["win_rate"] == pytest.approx(float(np.mean(wins))) and w["n_images"] == 300
    assert win_rate([1.0 - x for x in wins])["verdict"] == WORSE
    assert win_rate([0.5] * 50)["verdict"] == SAME  # every image split or tied
    coin = list(rng.choice([1.0, 0.0], size=300))
    assert win_rate(coin)["verdict"] == SAME and win_rate(coin)["ci_low"] < 0.5 < win_rate(coin)["ci_high"]
    assert win_rate([]) is None
