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
