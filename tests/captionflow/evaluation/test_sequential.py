"""The sequential verdict, tested by simulation against what users read it to promise, at the scale they ship: golden
sets of 5,000 images drawn afresh for every run (so each set's own mean difference is not the checkpoints'), a look
after every committed batch of 64 and the final test once every image is seen, on realistic per-image scores
(bench/verdict_sim.py: CIDEr-D with zeros, a long tail and identical captions; a judge's 1-5 with half the images
scored alike; a pairwise judge with ties and a position bias).

- Equally good checkpoints get "better" or "worse" in at most alpha of runs, counting every look and the last; while
  the images come, each side errs in at most its share; a sequence at twice its alpha fails that check.
- Real differences get the right answer, and how soon is held to what the issue asked where it is reachable.
- The per-batch path a run takes (``observe``) gives the simulation's verdicts, stream by stream.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.verdict_sim import differences, effect_theta, verdicts
from captionflow.evaluation.sequential import (
    DECISIONS,
    FINAL_SHARE,
    VERDICT_SCORES,
    ConfidenceSequence,
    PrefixVerdict,
    final_test,
    meaning,
    paired_differences,
    seeded_order,
    verdict_line,
)

ALPHA = 0.05
N = 5000
NULL_STREAMS = 8000
STREAMS = 4000
BETTER, WORSE, EQUIVALENT, NONE = (DECISIONS.index(d) for d in ("better", "worse", "equivalent",
                                                                  "no detectable difference"))  # fmt: skip


def _bound(rate: float, streams: int) -> float:
    """A promised rate plus three simulation standard errors."""
    return rate + 3 * math.sqrt(rate * (1 - rate) / streams)


@pytest.fixture(scope="module")
def null_runs():
    """Equally good checkpoints, no margin (nothing but better, worse or no detectable difference): per score, each
    run's decision, images used and whether the final test gave it."""
    return {
        score: verdicts(score, 0.0, NULL_STREAMS, N, seed=7, margin=0.0) for score in VERDICT_SCORES if score != "clip"
    }


@pytest.mark.parametrize("score", ["cider", "judge", "pairwise"])
def test_equally_good_checkpoints_get_better_or_worse_in_at_most_alpha_of_runs_counting_the_end(null_runs, score):
    codes, used, final = null_runs[score]
    wrong = np.isin(codes, [BETTER, WORSE]).mean()
    assert wrong <= _bound(ALPHA, NULL_STREAMS), (score, wrong)
    assert (used == N).mean() > 0.9 and final.mean() > 0.9  # most runs go to the end: its test is counted
    assert not ((codes == NONE) & ~final).any()  # "no detectable difference" only from the final test, never before


def test_the_null_sets_are_realistic_their_own_mean_is_not_zero():
    d = differences("cider", np.random.default_rng(7), 200, N)
    means = d.mean(axis=1)
    assert (means != 0).all() and 0.005 < np.abs(means).mean() < 0.03  # ~SD / sqrt(N) = 0.013
    assert 0.15 < (d == 0).mean() < 0.25 and 0.85 < d.std() < 1.05  # identical scores; per-image difference SD


@pytest.mark.parametrize("score", ["cider", "judge", "pairwise"])
def test_while_the_images_come_each_side_errs_in_at_most_its_share_of_alpha(null_runs, score):
    codes, _, final = null_runs[score]
    share = ALPHA * (1 - FINAL_SHARE) / 2
    for side in (BETTER, WORSE):
        assert ((codes == side) & ~final).mean() <= _bound(share, NULL_STREAMS), (score, DECISIONS[side])
    # and the final test, once every image is seen, in at most its share
    assert (np.isin(codes, [BETTER, WORSE]) & final).mean() <= _bound(ALPHA * FINAL_SHARE, NULL_STREAMS)


def test_a_sequence_that_spends_twice_its_alpha_fails_the_per_side_check():
    """The check above can fail: the same gamblers with each side at the whole sequence's alpha (unhedged)."""
    pv = PrefixVerdict(["-"], dict, VERDICT_SCORES["judge"], ALPHA, 0.0)
    pv.cs._threshold = math.log(1 / pv.cs.alpha)
    x = differences("judge", np.random.default_rng(7), NULL_STREAMS, N)
    codes, _, final = pv.simulate(x)
    share = ALPHA * (1 - FINAL_SHARE) / 2
    assert ((codes == BETTER) & ~final).mean() > _bound(share, NULL_STREAMS)


def test_equally_good_checkpoints_with_a_margin_stop_early_as_equivalent():
    for score, share, median in (("judge", 0.95, 1100), ("pairwise", 0.95, 1300), ("cider", 0.8, 4000)):
        codes, used, _ = verdicts(score, 0.0, STREAMS, N, seed=3)  # the score's default margin
        assert (codes == EQUIVALENT).mean() >= share and np.median(used) <= median, score
        assert np.isin(codes, [BETTER, WORSE]).mean() <= _bound(ALPHA, STREAMS)


def test_plus_0_05_cider_is_called_better_in_90_percent_within_2500_images_at_the_median():
    """A fixed t test on all 5,000 images has ~95% power here; the sequence gives up a little of it for speed."""
    codes, used, _ = verdicts("cider", 0.05, STREAMS, N, seed=5)
    assert (codes == BETTER).mean() >= 0.90 and np.median(used) <= 2500
    assert (codes == WORSE).mean() <= _bound(ALPHA / 2, STREAMS)


def test_minus_0_05_cider_is_called_worse_as_often_and_as_soon():
    codes, used, _ = verdicts("cider", -0.05, STREAMS, N, seed=6, margin=0.0)
    assert (codes == WORSE).mean() >= 0.90 and np.median(used) <= 2500
    assert (codes == BETTER).mean() <= _bound(ALPHA / 2, STREAMS)


def test_plus_0_10_cider_is_always_called_better_within_about_800_images_at_the_median():
    """The issue asked for a median of 700: a test told the effect in advance needs 704 only when it risks 99% of its
    capital on an image's worst possible difference (-10); the stakes here risk at most 75% (docs/evaluation.md)."""
    codes, used, _ = verdicts("cider", 0.10, STREAMS, N, seed=8)
    assert (codes == BETTER).mean() >= 0.999 and np.median(used) <= 832  # 13 looks


def test_a_pairwise_win_rate_of_0_55_is_called_better_within_about_320_images():
    """The issue asked for a median of 250: with a look every 64 images that is 192, and a test told the effect in
    advance needs 256 at these error rates for this judge's spread; 320 here (docs/evaluation.md)."""
    codes, used, _ = verdicts("pairwise", 0.05, STREAMS, N, seed=9)
    assert (codes == BETTER).mean() >= 0.99 and np.median(used) <= 320
    assert (codes == WORSE).mean() <= _bound(ALPHA / 2, STREAMS)


@pytest.mark.parametrize(("score", "effect", "margin"), [("cider", 0.0, 0.0), ("cider", 0.1, None),
                                                         ("pairwise", 0.0, None), ("judge", 0.15, None)])  # fmt: skip
def test_a_run_taking_its_captions_batch_by_batch_gives_the_simulated_verdict(score, effect, margin):
    """``observe`` (what a run does, batch by batch, with the interval's ends by bisection) against ``simulate``
    (what the checks above run) on the same streams: the same decision after the same number of images, and an
    interval that says the same."""
    rng = np.random.default_rng(21)
    x = differences(score, rng, 24, 1200, effect_theta(score, effect) if effect else 0.0)
    ids = [f"i{k}" for k in range(x.shape[1])]
    sim = PrefixVerdict(ids, dict, VERDICT_SCORES[score], ALPHA, margin)
    codes, used, _ = sim.simulate(x)
    for row, code, n in zip(x, codes, used):
        pv = PrefixVerdict(ids, lambda v: v, VERDICT_SCORES[score], ALPHA, margin)
        values = dict(zip(ids, row))
        for start in range(0, len(ids), 64):
            if pv.observe({i: values[i] for i in ids[start : start + 64]}):
                break
        v = pv.verdict
        assert (DECISIONS.index(v.decision), v.n) == (code, n)
        if v.by == "sequence" and v.decision == "better":
            assert 0 <= v.lower < v.mean
        if v.by == "sequence" and v.decision == "worse":
            assert v.mean < v.upper <= 0
        if v.decision == "equivalent":
            assert -pv.margin <= v.lower <= v.upper <= pv.margin
        assert v.lower < v.upper  # never collapsed to a point


def test_the_intervals_ends_are_where_a_gambler_first_wins_found_by_bisection():
    x = differences("cider", np.random.default_rng(4), 1, 3000, effect_theta("cider", 0.05))[0]
    cs = ConfidenceSequence(VERDICT_SCORES["cider"].bounds, 0.035, 0.05, 0.05, 1.0)
    cs.update(x)
    lower, upper = cs.interval()
    assert -1 < lower < x.mean() < upper < 1 and upper - lower > 0.05
    eps = 1e-6
    assert cs._beaten(lower - eps, up=True) and not cs._beaten(lower + eps, up=True)
    assert cs._beaten(upper + eps, up=False) and not cs._beaten(upper - eps, up=False)


def test_the_order_is_a_seeded_permutation_independent_of_the_listing():
    ids = [f"img-{i}" for i in range(50)]
    order = seeded_order(ids, "dataset-fp/baseline-fp/candidate-fp")
    assert sorted(order) == sorted(ids) and order != sorted(ids)
    assert seeded_order(list(reversed(ids)), "dataset-fp/baseline-fp/candidate-fp") == order
    assert seeded_order(ids, "dataset-fp/baseline-fp/other-candidate") != order  # not a reused holdout


def test_the_verdict_sees_the_orders_prefix_not_whichever_captions_came_first():
    """Captions that arrive out of order wait until every image before them in the order is in."""
    ids = [f"i{k}" for k in range(50)]
    order = seeded_order(ids, "prefix")
    baseline = dict.fromkeys(ids, "1")  # the baseline's captions, scored as the prefix reaches them
    seen_scored = []

    def score(captions):
        seen_scored.extend(captions)
        return {i: 5.0 * float(c) for i, c in captions.items()}

    judge = VERDICT_SCORES["judge"]
    pv = PrefixVerdict(order, paired_differences(score, baseline), judge, ALPHA)
    assert pv.observe({order[k]: "0" for k in range(1, 40)}) is False  # the order's first image is missing
    assert pv.cs.n == 0 and seen_scored == []  # nothing scored while the prefix has a gap at its start
    decided = pv.observe({order[0]: "0"})  # now the prefix runs to 40 images at once, each 5 below the baseline
    assert pv.cs.n == 40 and decided and pv.verdict.decision == "worse" and pv.verdict.by == "sequence"
    assert sorted(seen_scored) == sorted(order[:40] * 2)  # the prefix, each image once on each side
    record = pv.record()
    assert record["images_used"] == 40 and record["images_total"] == 50 and record["upper"] < 0
    assert record["trajectory"][-1][0] == 40 and record["decided_by"] == "sequence"
    assert pv.observe({order[k]: "1" for k in range(40, 50)}) is True  # decided stays decided: no more updates
    assert pv.cs.n == 40 and len(seen_scored) == 80  # nor scored
    # values of images outside the population (the order) are never taken
    pv = PrefixVerdict(order[:20], paired_differences(score, baseline), judge)
    assert pv.observe(dict.fromkeys(order[20:], "0")) is False and not pv.waiting and pv.cs.n == 0


def test_at_the_end_the_final_test_decides_and_undecided_is_no_detectable_difference():
    ids = [f"i{k}" for k in range(200)]
    rng = np.random.default_rng(2)
    z = rng.normal(0, 1, 200)
    noise = dict(zip(ids, (z - z.mean()) / z.std(ddof=1)))  # mean 0, SD 1 exactly
    pv = PrefixVerdict(ids, lambda v: v, VERDICT_SCORES["judge"], ALPHA, 0.0)
    assert pv.observe(noise) is True
    v = pv.verdict
    assert v.decision == "no detectable difference" and v.by == "final test" and v.n == 200
    assert v.lower < 0 < v.upper and v.upper - v.lower > 0.2  # the t interval, not a point
    r = pv.record()
    assert r["decided_by"] == "final test" and "at the final test" in verdict_line(r)
    assert "could not tell it from the baseline" in meaning(r)
    # a small real difference the sequence did not catch in 200 images, the final test does
    shifted = {i: x + 0.2 for i, x in noise.items()}  # t = 2.83 on 200 images
    pv = PrefixVerdict(ids, lambda v: v, VERDICT_SCORES["judge"], ALPHA, 0.0)
    pv.observe(shifted)
    assert pv.verdict.decision == "better" and pv.verdict.by == "final test"
    # the same captions everywhere, with a margin: equivalent (the sequence, or the final test)
    pv = PrefixVerdict(ids, lambda v: v, VERDICT_SCORES["pairwise"], ALPHA)
    pv.observe(dict.fromkeys(ids, 0.0))
    assert pv.verdict.decision == "equivalent" and -0.03 <= pv.verdict.lower <= pv.verdict.upper <= 0.03


def test_images_that_failed_for_good_leave_the_order_and_the_rest_decides():
    ids = [f"i{k}" for k in range(100)]
    order = seeded_order(ids, "failed")
    values = dict(zip(order, np.random.default_rng(1).normal(0, 1, 100)))
    pv = PrefixVerdict(order, lambda v: v, VERDICT_SCORES["judge"], ALPHA, 0.0)
    failed = set(order[10:13])
    assert pv.observe({i: x for i, x in values.items() if i not in failed}) is False
    assert pv.cs.n == 10  # stalled at the first image that has no caption
    assert pv.finish(failed) is True  # the pass is over: they leave the order, the rest is scored and tested
    assert pv.cs.n == 97 and pv.verdict.by == "final test" and pv.record()["images_total"] == 97


def test_final_test_over_many_streams_matches_one_at_a_time():
    x = np.random.default_rng(3).normal(0.1, 1, (5, 300))
    codes, lo, hi = final_test(x, 0.015, 0.05)
    for row, c, a, b in zip(x, codes, lo, hi):
        one = final_test(row, 0.015, 0.05)
        assert (int(one[0]), float(one[1]), float(one[2])) == (int(c), pytest.approx(a), pytest.approx(b))
    assert int(final_test(np.array([0.3]), 0.015, 0.05)[0]) == NONE  # one image decides nothing


def test_margins_are_validated_per_score():
    for score in VERDICT_SCORES.values():
        assert score.check_margin(None) == score.margin and 0 < score.margin < score.span / 2
        with pytest.raises(ValueError, match=f"below half its range \\({score.span / 2:g}\\)"):
            score.check_margin(score.span / 2)
        with pytest.raises(ValueError, match="at least 0"):
            score.check_margin(-0.01)
    assert VERDICT_SCORES["pairwise"].check_margin(0.45) == 0.45  # valid, if wide: the docs say what is sensible
    with pytest.raises(ValueError, match="verdict_margin 0.5 for the pairwise win rate"):
        PrefixVerdict(["a"], dict, VERDICT_SCORES["pairwise"], ALPHA, 0.5)


def test_bad_input_is_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="alpha"):
        ConfidenceSequence((-1.0, 1.0), alpha=1.5)
    with pytest.raises(ValueError, match="low < high"):
        ConfidenceSequence((1.0, -1.0))


def test_the_lines_say_what_was_tested():
    pv = PrefixVerdict([f"i{k}" for k in range(5000)], lambda v: v, VERDICT_SCORES["cider"], ALPHA, against="ckpt-1")
    rng = np.random.default_rng(0)
    pv.observe({f"i{k}": x for k, x in enumerate(rng.normal(-1.0, 1.0, 5000))})
    r = pv.record()
    assert verdict_line(r).startswith("worse after ") and "margin 0.05, against ckpt-1)" in verdict_line(r)
    said = meaning(r)
    assert said.startswith("Its expected CIDEr-D per image is below the baseline's on images like these")
    assert "at most a 0.025 chance" in said


def test_the_fixed_sample_bootstrap_is_said_beside_the_verdict_and_a_disagreement_is_named():
    from captionflow.evaluation.sequential import bootstrap_line, reconcile
    from captionflow.evaluation.significance import paired_bootstrap

    rng = np.random.default_rng(3)
    ids = [f"i{k}" for k in range(400)]
    theirs = {i: {"cider": float(x)} for i, x in zip(ids, rng.uniform(0, 2, len(ids)))}
    worse = {i: {"cider": theirs[i]["cider"] - 0.5 + float(rng.normal(0, 0.1))} for i in ids}
    boot = paired_bootstrap(worse, theirs, metrics=("cider",))["cider"]
    assert boot["verdict"] == "worse" and boot["n_images"] == 400
    record = {"decision": "worse", "score": "CIDEr-D"}
    same = reconcile(record, boot)
    assert same["agrees"] and "as the sequential verdict (worse)" in same["line"] and "400 images" in same["line"]
    for decision in ("better", "equivalent", "continue", "no detectable difference"):
        other = reconcile({**record, "decision": decision}, boot)
        assert not other["agrees"] and f"DISAGREES with the sequential verdict ({decision})" in other["line"]
    flat = paired_bootstrap(theirs, theirs, metrics=("cider",))["cider"]  # no difference at all
    assert reconcile({**record, "decision": "equivalent"}, flat)["agrees"]
    assert reconcile({**record, "decision": "no detectable difference"}, flat)["agrees"]
    assert not reconcile(record, flat)["agrees"]
    assert bootstrap_line({**record, "bootstrap": same}) == same["line"]
    assert bootstrap_line({**record, "bootstrap": {"error": "no image scored by both"}}) == "no image scored by both"
    assert bootstrap_line(record) == bootstrap_line(None) == ""
