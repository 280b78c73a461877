"""Metrics per slice of a dataset: a folder of images is sliced by its sub-folders, a Parquet dataset by the
column ``slice_column`` names (carried into the shards by preprocess).

Each slice's value of a metric is the mean of its images' per-image scores: for CIDEr exactly the corpus
metric restricted to the slice with the IDF of the whole reference set (as scored); for BLEU-4 the mean
sentence-level BLEU-4 (an approximation of corpus BLEU, as in the paired bootstrap).
"""

from __future__ import annotations

from typing import Any, Optional

TOP_LEVEL = "(top level)"
NO_SLICE = "(none)"
# slice metric -> per-image column of scores.parquet
SLICED = (
    ("cider", "cider"),
    ("bleu_4", "bleu_4"),
    ("rouge_l", "rouge_l"),
    ("judge_mean", "judge_score"),
    ("pairwise_win_rate", "pairwise_score"),
    ("clip_score", "clip_score"),
)


def folder_slice(source: str) -> str:
    """The sub-folder an image file is in, relative to the dataset (``TOP_LEVEL`` for the dataset's own)."""
    return source.rsplit("/", 1)[0] if "/" in source else TOP_LEVEL


def slices_of(kind: str, sources: dict[str, str], values: Optional[dict[str, Any]]) -> dict[str, str]:
    """image id -> its slice: the slice column's value (``values``), else for images the sub-folder."""
    if values is not None:
        return {i: NO_SLICE if v is None else str(v) for i, v in values.items()}
    if kind == "images":
        return {i: folder_slice(s) for i, s in sources.items()}
    return {}


def slice_metrics(rows: list[dict], slices: dict[str, str]) -> Optional[list[dict[str, Any]]]:
    """One row per slice (sorted by name): its image count and the mean of each per-image score any image
    has. None when the dataset has fewer than two slices."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(slices.get(r["image_id"], NO_SLICE), []).append(r)
    if len(groups) < 2:
        return None
    out = []
    for name, members in sorted(groups.items()):
        row: dict[str, Any] = {"slice": name, "n": len(members)}
        for metric, col in SLICED:
            vals = [r[col] for r in members if r.get(col) is not None]
            row[metric] = sum(vals) / len(vals) if vals else None
        out.append(row)
    present = [m for m, _ in SLICED if any(r[m] is not None for r in out)]
    return [{k: v for k, v in r.items() if k in ("slice", "n", *present)} for r in out]
