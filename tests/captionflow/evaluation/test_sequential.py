"""The sequential verdict's confidence sequence, tested by simulation against what it promises: under no difference
it says "better" or "worse" in at most alpha of the streams, however often it is looked at; the whole set's mean is
inside its interval at every look in >= 1 - alpha of the streams; a clear difference stops it early. A naive
interval recomputed after every batch fails the same false-verdict check (the check can fail)."""

from __future__ import annotations

import numpy as np
import pytest

from captionflow.evaluation.sequential import ConfidenceSequence, seeded_order

ALPHA = 0.05
STREAMS = 2000
N = 200  # images in each simulated golden set
BATCH = 20  # differences per committed batch: a look after each
GRID = 201


def _cider_like(rng, n):
    """Per-image CIDEr-D-like scores: a mass of zeros and a long right tail, clipped to the score's bounds."""
    s = rng.gamma(0.8, 0.7, n) * (rng.random(n) > 0.25)
    return np.clip(s, 0, 10)


def _judge_like(rng, n):
    return rng.choice([1, 2, 3, 4, 5], size=n, p=[0.1, 0.2, 0.3, 0.25, 0.15]).astype(float)


def _clip_like(rng, n):
    """Per-image CLIPScores as a real CLIP gives them: 2.5 x a cosine near 0.3, narrow beside the score's bounds."""
    return np.clip(2.5 * rng.normal(0.31, 0.04, n), 0, 2.5)


# primary scores and their bounds: (score lo, score hi) -> differences within (lo - hi, hi - lo)
SCORES = {"cider": (_cider_like, (0.0, 10.0)), "judge": (_judge_like, (1.0, 5.0)), "clip": (_clip_like, (0.0, 2.5))}


def _null_population(rng, make, n):
    """Paired differences whose mean over the set is exactly 0: the baseline's scores are a permutation of this
    checkpoint's (the same distribution, image by image unrelated)."""
    a = make(rng, n)
    return a - rng.permutation(a)


def _run(differences, bounds, method="cs", delta=0.0, paired=True):
    """Look after every batch of the order's prefix: (the first decisive look's verdict or None, its n, whether the
    set's mean was ever outside the interval at a look). ``bounds``: the score's (``paired``: the differences are
    within (lo - hi, hi - lo)) or the differences' own."""
    n = len(differences)
    truth = differences.mean()
    missed = False
    if method == "cs":
        lo, hi = (bounds[0] - bounds[1], bounds[1] - bounds[0]) if paired else bounds
        cs = ConfidenceSequence(n, (lo, hi), ALPHA, delta=delta, grid=GRID)
    for end in range(BATCH, n + 1, BATCH):
        if method == "cs":
            v = cs.update(differences[end - BATCH : end])
            decision, lower, upper = v.decision, v.lower, v.upper
        else:  # the naive look: a 95% normal interval over what has been seen, recomputed each time
            seen = differences[:end]
            half = 1.96 * seen.std(ddof=1) / np.sqrt(end)
            lower, upper = seen.mean() - half, seen.mean() + half
            decision = "better" if lower > 0 else "worse" if upper < 0 else "continue"
        missed = missed or not (lower - 1e-12 <= truth <= upper + 1e-12)
        if decision != "continue" and end < n:
            return decision, end, missed
    return None, n, missed


@pytest.mark.parametrize("score", sorted(SCORES))
def test_under_no_difference_it_says_better_or_worse_in_at_most_alpha_of_the_streams(score):
    make, bounds = SCORES[score]
    rng = np.random.default_rng(7)
    false = 0
    for _ in range(STREAMS):
        d = _null_population(rng, make, N)
        decision, _, _ = _run(d[rng.permutation(N)], bounds)
        false += decision in ("better", "worse")
    assert false / STREAMS <= ALPHA, (score, false)


def test_a_pairwise_verdict_under_an_even_split_says_better_or_worse_in_at_most_alpha_of_the_streams():
    """The pairwise judge's shares (0, 0.5 or 1 per image) of a set whose win rate is exactly 0.5, minus 0.5: the
    differences a pairwise verdict takes, within (-0.5, 0.5)."""
    rng = np.random.default_rng(11)
    false = 0
    for _ in range(STREAMS):
        half = rng.choice([0.0, 0.5, 1.0], size=N // 2, p=[0.35, 0.3, 0.35])
        shares = np.concatenate([half, 1.0 - half])  # mirrored: the set's win rate is 0.5 exactly
        decision, _, _ = _run(shares[rng.permutation(N)] - 0.5, (-0.5, 0.5), paired=False)
        false += decision in ("better", "worse")
    assert false / STREAMS <= ALPHA, false


def test_a_naive_interval_recomputed_after_every_batch_does_not_hold_alpha():
    """The same check on a bootstrap-style interval peeked at after every batch: its false verdicts exceed alpha,
    so the check above can fail."""
    make, bounds = SCORES["cider"]
    rng = np.random.default_rng(7)
    false = sum(
        _run(_null_population(rng, make, N)[rng.permutation(N)], bounds, method="naive")[0] in ("better", "worse")
        for _ in range(STREAMS)
    )
    assert false / STREAMS > 1.4 * ALPHA  # ~0.08 with 10 looks at 200 images; the standard error is ~0.005


def test_the_sets_mean_stays_inside_the_interval_at_every_look_in_at_least_1_minus_alpha():
    make, bounds = SCORES["cider"]
    rng = np.random.default_rng(11)
    missed = 0
    for _ in range(STREAMS):
        a = make(rng, N)
        b = np.clip(make(rng, N) + rng.normal(0.1, 0.3, N), 0, 10)  # a small, real difference
        _, _, miss = _run((a - b)[rng.permutation(N)], bounds)
        missed += miss
    assert missed / STREAMS <= ALPHA


def test_a_planted_clear_difference_is_called_within_1000_of_5000_images():
    """A baseline whose captions are the references for a third of the images (CIDEr-D near its top there)."""
    rng = np.random.default_rng(3)
    n = 5000
    ours = _cider_like(rng, n)
    baseline = _cider_like(rng, n)
    planted = rng.random(n) < 1 / 3
    baseline[planted] = np.clip(rng.normal(6.0, 1.5, planted.sum()), 0, 10)
    d = ours - baseline
    cs = ConfidenceSequence(n, (-10.0, 10.0), ALPHA)
    order = rng.permutation(n)
    for end in range(32, n + 1, 32):
        v = cs.update(d[order[end - 32 : end]])
        if v.decision != "continue":
            break
    assert v.decision == "worse" and v.n <= 1000, v
    assert v.lower <= d.mean() <= v.upper
    assert cs.trajectory[-1][0] == v.n and len(cs.trajectory) == v.n  # an interval after every image


def test_the_same_captions_are_called_equivalent_within_the_margin_and_the_set_end_is_exact():
    d = np.zeros(400)
    cs = ConfidenceSequence(400, (-1.0, 1.0), ALPHA, delta=0.05)
    v = None
    for end in range(50, 401, 50):
        v = cs.update(d[end - 50 : end])
        if v.decision != "continue":
            break
    assert v.decision == "equivalent" and v.n < 400 and -0.05 <= v.lower <= v.upper <= 0.05
    full = ConfidenceSequence(3, (-1.0, 1.0), ALPHA)
    assert full.update([0.5, -0.25, 0.5]).decision == "better"  # every image seen: the set's mean, exactly
    assert full.interval() == pytest.approx((0.25, 0.25))


def test_bad_input_is_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="at least one image"):
        ConfidenceSequence(0, (-1.0, 1.0))
    with pytest.raises(ValueError, match="alpha"):
        ConfidenceSequence(10, (-1.0, 1.0), alpha=1.5)
    cs = ConfidenceSequence(2, (-1.0, 1.0))
    with pytest.raises(ValueError, match="3 differences for a set of 2"):
        cs.update([0.1, 0.2, 0.3])


def test_the_order_is_a_seeded_permutation_independent_of_the_listing():
    ids = [f"img-{i}" for i in range(50)]
    order = seeded_order(ids, "dataset-fp/baseline-fp")
    assert sorted(order) == sorted(ids) and order != sorted(ids)
    assert seeded_order(list(reversed(ids)), "dataset-fp/baseline-fp") == order  # the listing's order: irrelevant
    assert seeded_order(ids, "dataset-fp/other-baseline") != order


def test_the_verdict_sees_the_orders_prefix_not_whichever_captions_came_first():
    """Captions that arrive out of order wait until every image before them in the order is in."""
    from captionflow.evaluation.sequential import PrefixVerdict, paired_bounds, paired_differences

    ids = [f"i{k}" for k in range(50)]
    order = seeded_order(ids, "prefix")
    baseline = dict.fromkeys(ids, "1")  # the baseline's captions, scored as the prefix reaches them
    seen_scored = []

    def score(captions):
        seen_scored.extend(captions)
        return {i: float(c) for i, c in captions.items()}

    pv = PrefixVerdict(order, paired_differences(score, baseline), paired_bounds((0.0, 1.0)), alpha=0.05)
    assert pv.observe({order[k]: "0" for k in range(1, 30)}) is False  # the order's first image is missing
    assert pv.cs.n == 0 and seen_scored == []  # nothing scored while the prefix has a gap at its start
    decided = pv.observe({order[0]: "0"})  # now the prefix runs to 30 images at once, each 1 below the baseline
    assert pv.cs.n == 30 and decided and pv.verdict.decision == "worse"
    assert sorted(seen_scored) == sorted(order[:30] * 2)  # the prefix, each image once on each side
    record = pv.record()
    assert record["images_used"] == 30 and record["images_total"] == 50 and record["upper"] < 0
    assert record["trajectory"][-1][0] == 30
    assert pv.observe({order[k]: "1" for k in range(30, 50)}) is True  # decided stays decided: no more updates
    assert pv.cs.n == 30 and len(seen_scored) == 60  # nor scored
    # values of images outside the population (the order) are never taken
    pv = PrefixVerdict(order[:20], paired_differences(score, baseline), (-1.0, 1.0))
    assert pv.observe(dict.fromkeys(order[20:], "0")) is False and not pv.waiting and pv.cs.n == 0


def test_the_fixed_sample_bootstrap_is_said_beside_the_verdict_and_a_disagreement_is_named():
    from captionflow.evaluation.sequential import reconcile
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
    for decision in ("better", "equivalent", "continue"):
        other = reconcile({**record, "decision": decision}, boot)
        assert not other["agrees"] and f"DISAGREES with the sequential verdict ({decision})" in other["line"]
    flat = paired_bootstrap(theirs, theirs, metrics=("cider",))["cider"]  # no difference at all
    assert reconcile({**record, "decision": "equivalent"}, flat)["agrees"]
    assert not reconcile(record, flat)["agrees"]
    # what the reports and the artifact say of it: its line, or why there is none
    from captionflow.evaluation.sequential import bootstrap_line

    assert bootstrap_line({**record, "bootstrap": same}) == same["line"]
    assert bootstrap_line({**record, "bootstrap": {"error": "no image scored by both"}}) == "no image scored by both"
    assert bootstrap_line(record) == bootstrap_line(None) == ""
