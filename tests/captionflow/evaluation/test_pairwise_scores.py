"""Length bias beside the judges' results: simulated judges that prefer length, and one that does not."""

from __future__ import annotations

import random

from captionflow.evaluation.pairwise_scores import length_bias, score_by_length


def test_a_judge_that_prefers_longer_captions_shows_in_the_win_rate_by_length():
    rng = random.Random(0)
    mine, theirs, score = {}, {}, {}
    for k in range(600):
        a, b = rng.randint(3, 15), rng.randint(3, 15)
        mine[f"i{k}"], theirs[f"i{k}"] = " ".join(["w"] * a), " ".join(["v"] * b)
        score[f"i{k}"] = 1.0 if a > b else 0.0 if a < b else 0.5  # this judge only counts words
    lb = length_bias(mine, theirs, score)
    by = lb["win_rate_by_length"]
    assert by["longer"]["win_rate"] == 1.0 and by["shorter"]["win_rate"] == 0.0
    assert 0.0 < by["about the same"]["win_rate"] < 1.0
    assert sum(g["images"] for g in by.values()) == 600 and abs(lb["mean_words"] - 9) < 0.6
    fair = {i: rng.choice([0.0, 0.5, 1.0]) for i in score}  # a judge blind to length: flat by length
    flat = length_bias(mine, theirs, fair)["win_rate_by_length"]
    assert max(g["win_rate"] for g in flat.values()) - min(g["win_rate"] for g in flat.values()) < 0.15
    assert length_bias({}, theirs, score) == {}


def test_the_judges_score_by_length_thirds():
    captions = {f"i{k}": " ".join(["w"] * (k % 12 + 1)) for k in range(90)}
    score = {i: float(len(c.split())) / 3 for i, c in captions.items()}  # grows with length
    t = score_by_length(captions, score)["mean_score_by_length"]
    assert t["shortest third"]["mean_score"] < t["middle third"]["mean_score"] < t["longest third"]["mean_score"]
    assert score_by_length({"a": "x"}, {"a": 1.0}) == {}
