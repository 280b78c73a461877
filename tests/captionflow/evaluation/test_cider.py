"""Per-image CIDEr-D with the whole set's IDF: the same numbers as the COCO scorer on the whole set, whatever
subset is scored."""

from __future__ import annotations

import random

from captionflow.evaluation.cider import BOUNDS, FixedIdfCider
from captionflow.evaluation.metrics import reference_metrics

WORDS = [
    "a",
    "the",
    "dog",
    "cat",
    "red",
    "blue",
    "runs",
    "sits",
    "on",
    "mat",
    "grass",
    "ball",
    "big",
    "small",
    "man",
    "woman",
    "near",
]


def _set(n: int, seed: int = 0):
    rng = random.Random(seed)
    refs = {f"i{k}": [" ".join(rng.choices(WORDS, k=rng.randint(4, 9))) for _ in range(3)] for k in range(n)}
    caps = {k: " ".join(rng.choices(WORDS, k=rng.randint(3, 10))) for k in refs}
    return refs, caps


def test_the_whole_set_scores_as_the_coco_scorer_does_and_a_subset_scores_the_same():
    refs, caps = _set(60)
    _, per = reference_metrics(caps, refs)
    cider = FixedIdfCider(refs)
    whole = cider.scores(caps)
    assert all(abs(whole[i] - per[i]["cider"]) < 1e-12 for i in refs)
    few = list(refs)[5:12]
    part = cider.scores({i: caps[i] for i in few})
    assert all(abs(part[i] - whole[i]) < 1e-12 for i in few)
    # the subset alone as the whole set: the IDF from its references only, other numbers (why this class exists)
    _, alone = reference_metrics({i: caps[i] for i in few}, {i: refs[i] for i in few})
    assert any(abs(alone[i]["cider"] - whole[i]) > 1e-3 for i in few)
    # a run that captioned only the subset of the whole set (a verdict stopped it early): the whole set's scale, in
    # one process and in several
    for processes in (1, 2):
        agg, prefix = reference_metrics({i: caps[i] for i in few}, refs, processes=processes)
        assert all(abs(prefix[i]["cider"] - whole[i]) < 1e-12 for i in few) and agg["n_scored"] == len(few)
    assert all(BOUNDS[0] <= s <= BOUNDS[1] for s in whole.values())
    perfect = cider.scores({i: r[0] for i, r in refs.items()})  # a reference scores high, within the bounds
    assert min(perfect.values()) > 1.0 and max(perfect.values()) <= BOUNDS[1]
    assert cider.scores({"not-in-the-set": "a dog"}) == {}
