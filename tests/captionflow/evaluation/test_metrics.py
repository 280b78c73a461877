from __future__ import annotations

import pytest

from captionflow.evaluation.metrics import length_stats, reference_metrics, repetition, simple_tokenize


def test_tokenizer_drops_ptb_punctuation():
    assert simple_tokenize("A cat, on a Mat!") == "a cat on a mat"


def test_perfect_caption_scores_one_and_matches_pycocoevalcap():
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    refs = {
        "a": ["a cat sits on a red mat", "the cat is on the mat"],
        "b": ["a dog runs in the green park", "a brown dog running on grass"],
        "c": ["two people ride bikes down the street", "cyclists on a city road"],
    }
    caps = {"a": "A cat sits on a red mat.", "b": "a dog in a park", "c": "a car on the road"}
    agg, per = reference_metrics(caps, refs)
    assert per["a"]["bleu_4"] == pytest.approx(1.0, abs=1e-6)
    assert per["a"]["rouge_l"] == pytest.approx(1.0)
    gts = {k: [simple_tokenize(r) for r in v] for k, v in refs.items()}
    res = {k: [simple_tokenize(v)] for k, v in caps.items()}
    bleu, _ = Bleu(4).compute_score(gts, res)
    assert agg["bleu_4"] == bleu[3] and agg["bleu_1"] == bleu[0]
    assert agg["rouge_l"] == Rouge().compute_score(gts, res)[0]
    assert agg["cider"] == Cider().compute_score(gts, res)[0]
    assert agg["n_scored"] == 3


def test_scored_by_several_processes_the_numbers_are_one_processs():
    import random

    words = ["a", "the", "dog", "cat", "red", "car", "street", "tree", "sits", "runs", "on", "near", "two"]
    r = random.Random(7)
    refs = {f"img{k:03d}": [" ".join(r.choices(words, k=r.randint(4, 12))) for _ in range(5)] for k in range(90)}
    caps = {k: " ".join(r.choices(words, k=r.randint(1, 30))) for k in list(refs)[:85]}  # 5 images not captioned
    caps["img000"] = refs["img000"][0]  # and one exact
    refs["no-refs"], caps["no-refs"] = [], "a caption without references"
    one = reference_metrics(caps, refs, processes=1)
    assert reference_metrics(caps, refs, processes=4) == one  # aggregates and every image's scores, exactly
    assert one[0]["n_scored"] == 85 and "no-refs" not in one[1] and one[1]["img000"]["bleu_4"] > 0.99


def test_length_stats_and_repetition():
    s = length_stats(["one two three", "", "x x x x x"], ["stop", "stop", "length"], n_failed=1)
    assert s["n_captions"] == 3 and s["empty_rate"] == pytest.approx(1 / 3)
    assert s["truncated_rate"] == pytest.approx(1 / 3) and s["failure_rate"] == pytest.approx(1 / 4)
    assert repetition("x x x x x") == pytest.approx(2 / 3)
    assert repetition("a b c d") == 0.0


@pytest.mark.slow
def test_java_ptb_tokenizer_and_meteor_match_pycocoevalcap():
    import shutil

    if not shutil.which("java"):
        pytest.skip("no Java on this machine")
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    refs = {
        "a": ["A cat sits on a red mat.", "The cat is on the mat!"],
        "b": ["A dog runs in the park.", "Dog, running."],
    }
    caps = {"a": "a cat on a mat", "b": "a dog in a park"}
    agg, per = reference_metrics(caps, refs, java=True)
    tok = PTBTokenizer()
    gts = tok.tokenize({k: [{"caption": c} for c in v] for k, v in refs.items()})
    res = tok.tokenize({k: [{"caption": v}] for k, v in caps.items()})
    assert agg["meteor"] == Meteor().compute_score(gts, res)[0]
    assert agg["cider"] == Cider().compute_score(gts, res)[0]
    assert 0 < agg["meteor"] < 1 and set(per["a"]) >= {"meteor", "cider", "bleu_4"}
