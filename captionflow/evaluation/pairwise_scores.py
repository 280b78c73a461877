"""The pairwise judge's committed judgements as per-image scores (rows keyed ``<image_id>#ab`` / ``#ba``)."""

from __future__ import annotations

from captionflow.data.layout import SCORES
from captionflow.data.storage import Store
from captionflow.workers.llm_rows import ORDERS, split_pair_id


def per_image_scores(rows: list[dict]) -> dict[str, dict[str, float]]:
    """image id -> {order: this run's share of that judgement (1 won, 0.5 tie, 0 lost)}."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        image_id, order = split_pair_id(r["image_id"])
        out.setdefault(image_id, {})[order] = r["candidate_score"]
    return out


def pairwise_per_image(pairwise_dir: str) -> dict[str, float]:
    """image id -> this run's share of its two judgements, for the images judged in both orders."""
    folder = Store(pairwise_dir)
    t = folder.read_unique(folder.ls(SCORES, suffix=".parquet"))
    scores = per_image_scores(t.to_pylist() if t is not None else [])
    return {i: sum(s.values()) / len(ORDERS) for i, s in scores.items() if len(s) == len(ORDERS)}


def length_bias(mine: dict[str, str], theirs: dict[str, str], score: dict[str, float], near: int = 1) -> dict:
    """How the pairwise verdict goes with caption length (judges prefer longer captions): the mean words of both
    sides over the judged images, and this run's win rate where its caption is longer than the baseline's by more
    than ``near`` words, within ``near`` words of it, and shorter."""
    from statistics import fmean

    from captionflow.evaluation.tokens import caption_words

    ids = [i for i in score if i in mine and i in theirs]
    if not ids:
        return {}
    a = {i: len(caption_words(mine[i])) for i in ids}
    b = {i: len(caption_words(theirs[i])) for i in ids}
    groups = {"longer": [], "about the same": [], "shorter": []}
    for i in ids:
        d = a[i] - b[i]
        groups["longer" if d > near else "shorter" if d < -near else "about the same"].append(score[i])
    return {
        "mean_words": round(fmean(a.values()), 2),
        "baseline_mean_words": round(fmean(b.values()), 2),
        "win_rate_by_length": {
            k: {"images": len(v), "win_rate": round(fmean(v), 4) if v else None} for k, v in groups.items()
        },
    }


def score_by_length(captions: dict[str, str], score: dict[str, float]) -> dict:
    """The judge's mean score of the shortest, middle and longest third of the captions (by words), and the
    captions' mean words: a score that climbs with length is the judge's length preference as much as quality."""
    from statistics import fmean

    from captionflow.evaluation.tokens import caption_words

    rows = sorted((len(caption_words(captions[i])), s) for i, s in score.items() if i in captions and s is not None)
    if len(rows) < 3:
        return {}
    k = len(rows) // 3
    thirds = {
        "shortest third": rows[:k],
        "middle third": rows[k : len(rows) - k],
        "longest third": rows[len(rows) - k :],
    }
    return {
        "mean_words": round(fmean(w for w, _ in rows), 2),
        "mean_score_by_length": {
            name: {"mean_words": round(fmean(w for w, _ in part), 2), "mean_score": round(fmean(s for _, s in part), 4)}
            for name, part in thirds.items()
        },
    }
