"""A sequential verdict's baseline and population: ``previous`` and ``best`` are runs that captioned the whole set, so a
chain of runs each against the previous one keeps its whole golden set however early each stops; the order's seed
covers the dataset, the baseline and the candidate. On a real leaderboard (row files and the compacted Parquet)."""

from __future__ import annotations

import logging

import numpy as np

from bench.verdict_sim import _cider, effect_theta
from captionflow.config import RunConfig
from captionflow.data.storage import Store
from captionflow.evaluation.regression import regression
from captionflow.evaluation.sequential import DECISIONS
from captionflow.report.markdown import leaderboard_table, read_leaderboard, update_leaderboard
from captionflow.runs.baseline import BEST, LATEST, baseline_order, baseline_verdict, resolve_baseline


def _row(store: Store, model: str, cider: float, partial: bool, n: int = 5000) -> dict:
    metrics = {"stats": {"n_captions": n, "failure_rate": 0.0}, "reference": {"cider": cider}, "partial": partial}
    return update_leaderboard(store, "ds", ("runs", "ds", f"fp-{model}", "g"), model, metrics)


def test_previous_and_best_are_runs_that_captioned_the_whole_set(tmp_path, caplog):
    store = Store(str(tmp_path))
    mine = ("runs", "ds", "fp-mine", "g")
    _row(store, "ckpt-1", 0.9, partial=False)
    comparison = _row(store, "ckpt-2", 1.4, partial=True, n=800)  # its verdict stopped it after 800 images
    assert comparison["previous"]["model"] == "ckpt-1"
    _row(store, "ckpt-3", 1.1, partial=True, n=640)
    with caplog.at_level(logging.INFO, logger="captionflow.baseline"):
        assert resolve_baseline(store, mine, LATEST)["model"] == "ckpt-1"  # not the newer, stopped ones
        assert resolve_baseline(store, mine, BEST)["model"] == "ckpt-1"  # not ckpt-2's prefix CIDEr-D of 1.4
    assert "stopped early (their verdict was in) are not baselines: ['ckpt-2', 'ckpt-3']" in caplog.text
    # named explicitly, a stopped run is still the baseline asked for
    assert resolve_baseline(store, mine, "ckpt-2")["model"] == "ckpt-2"
    # the leaderboard says which rows are a prefix's, and compares the next run with neither
    rows = {r["model"]: r for r in read_leaderboard(store)}
    assert rows["ckpt-2"]["partial"] and not rows["ckpt-1"]["partial"]
    assert "800 (partial)" in leaderboard_table(list(rows.values()))
    comparison = _row(store, "ckpt-4", 1.0, partial=False)
    assert comparison["previous"]["model"] == comparison["best_so_far"]["model"] == "ckpt-1"
    assert comparison["runs_on_dataset"] == 2


def test_a_run_stopped_early_raises_no_regression_alert():
    summary = {
        "metrics": {
            "reference": {"cider": 0.5},
            "comparison": {"best_so_far": {"model": "b", "run_dir": "/b", "cider": -0.5}},
        }
    }
    assert regression(summary, 0.05)["metric"] == "cider"
    summary["metrics"]["partial"] = True
    assert regression(summary, 0.05) is None


def test_the_order_is_seeded_by_the_dataset_the_baseline_and_the_candidate():
    base = {"model": "ckpt-1", "run_dir": "/out/runs/ds/fp-1/g"}
    ids = [f"i{k}" for k in range(100)]
    a = baseline_order(("runs", "ds", "fp-a", "g"), base, ids)
    assert a == baseline_order(("runs", "ds", "fp-a", "g"), base, reversed(ids))  # a rerun: the same sample
    assert a != baseline_order(("runs", "ds", "fp-b", "g"), base, ids)  # another candidate: another sample
    assert a[:10] != baseline_order(("runs", "ds", "fp-a", "g"), {**base, "run_dir": "/out/runs/ds/fp-2/g"}, ids)[:10]


def test_a_chain_of_six_runs_against_previous_keeps_the_whole_population_and_the_right_direction(tmp_path):
    """Six checkpoints, each +0.05 CIDEr-D per image above the one before, evaluated in turn with verdict_against
    previous on a golden set of 5,000 images, in 20 chains: every verdict's population is the whole set (its
    baseline captioned it all), and none says "worse" of a better checkpoint. Where the earlier version took the
    previous run's prefix, the populations shrank 5,000 -> 2,080 -> 1,280 -> 960 -> 768 -> 640."""
    n, steps = 5000, 6
    cfg = RunConfig(verdict="sequential", verdict_against="previous", verdict_margin=0.0)
    thetas = [effect_theta("cider", 0.05 * k) for k in range(steps)]
    populations, decisions, stopped = [], [], 0
    for chain in range(20):
        store = Store(str(tmp_path / f"chain-{chain}"))
        rng = np.random.default_rng(chain)
        z = rng.standard_normal(n)
        ids = [f"img-{k:05d}" for k in range(n)]
        scores = [dict(zip(ids, _cider(np.sqrt(0.6) * z + np.sqrt(0.4) * rng.standard_normal(n) + t))) for t in thetas]
        captioned = {}  # each checkpoint's captioned images: a run stopped early, its order's prefix
        for k in range(steps):
            run = ("runs", "ds", f"fp-ckpt-{k}", "g")
            base = resolve_baseline(store, run, cfg.verdict_against)
            partial = False
            if base is not None:
                b = int(base["model"].split("-")[1])
                order = baseline_order(run, base, captioned[b])  # the images the baseline captioned
                theirs = scores[b]
                verdict = baseline_verdict(cfg, base, order, lambda m, t=theirs: {i: m[i] - t[i] for i in m}, _score())
                for start in range(0, n, 64):
                    if verdict.observe({i: scores[k][i] for i in order[start : start + 64]}):
                        break
                populations.append(len(verdict.order))
                decisions.append(DECISIONS.index(verdict.verdict.decision))
                partial = verdict.stopped_early
                stopped += partial
            seen = verdict.order[: verdict.cs.n] if partial else ids
            captioned[k] = set(seen)
            update_leaderboard(store, "ds", run, f"ckpt-{k}", {
                "stats": {"n_captions": len(seen), "failure_rate": 0.0},
                "reference": {"cider": float(np.mean([scores[k][i] for i in seen]))},
                "partial": partial,
            })  # fmt: skip
    assert populations == [n] * len(populations) and len(populations) == 20 * (steps - 1)
    assert stopped > len(populations) // 4  # many runs did stop early: the chains were tested where it matters
    assert DECISIONS.index("worse") not in decisions
    assert sum(d == DECISIONS.index("better") for d in decisions) >= 0.9 * len(decisions)


def _score():
    from captionflow.evaluation.sequential import VERDICT_SCORES

    return VERDICT_SCORES["cider"]
