"""Is a difference between two checkpoints real? A paired bootstrap over images, per metric.

Both runs scored the same images (same dataset); each image gives a pair of per-image scores. For each
metric the statistic is the mean of the per-image scores over the images both runs scored:

- CIDEr and ROUGE-L: exactly the corpus metric (CIDEr's IDF held at the full reference set's, as scored;
  resampling does not recompute it);
- BLEU-4: the mean sentence-level BLEU-4, an approximation of corpus BLEU (which pools n-gram counts);
- judge: the mean 1-5 score;
- CLIPScore: the mean per-image score (reference-free).

The bootstrap draws ``n`` resamples of the images with replacement (fixed seed), the same draw for every
metric, and takes the delta's percentile interval. The two-sided p-value is the share of resampled
deltas on the other side of zero (doubled, +1 smoothed). Verdicts use Holm's step-down correction over the
metrics compared, at ``alpha``: "better", "worse" or "no detectable difference"; the intervals shown are the
unadjusted (1 - alpha) ones.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

# leaderboard metric -> per-image column of scores.parquet
PER_IMAGE = {
    "cider": "cider",
    "bleu_4": "bleu_4",
    "rouge_l": "rouge_l",
    "judge_mean": "judge_score",
    "clip_score": "clip_score",
}
BETTER, WORSE, SAME = "better", "worse", "no detectable difference"


def holm(p_values: dict[str, float]) -> dict[str, float]:
    """Holm-adjusted p-values (monotone, capped at 1)."""
    order = sorted(p_values, key=p_values.get)
    m, adjusted, running = len(order), {}, 0.0
    for rank, k in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[k]))
        adjusted[k] = running
    return adjusted


def paired_bootstrap(
    a: dict[str, dict[str, Any]],
    b: dict[str, dict[str, Any]],
    metrics: tuple[str, ...] = tuple(PER_IMAGE),
    n_resamples: int = 1000,
    seed: int = 0,
    alpha: float = 0.05,
) -> dict[str, dict[str, Any]]:
    """Per metric, run ``a`` against run ``b`` (each image id -> its per-image scores, leaderboard names):
    delta (a - b), its interval, p-value, Holm-adjusted p-value, verdict and the number of paired images.
    Metrics neither run scored on common images are left out."""
    ids = sorted(set(a) & set(b))
    diffs: dict[str, np.ndarray] = {}
    for m in metrics:
        pairs = [(a[i].get(m), b[i].get(m)) for i in ids]
        pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
        if pairs:
            arr = np.asarray(pairs, dtype=np.float64)
            diffs[m] = arr[:, 0] - arr[:, 1]
    out: dict[str, dict[str, Any]] = {}
    p_values: dict[str, float] = {}
    for m, d in diffs.items():
        n = len(d)
        means = _resampled_means(d, n_resamples, seed) if n_resamples else np.full(1, d.mean())
        delta = float(d.mean())
        lo, hi = (float(x) for x in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
        below, above = int((means <= 0).sum()), int((means >= 0).sum())
        p = min(1.0, 2 * (min(below, above) + 1) / (n_resamples + 1)) if n_resamples else 1.0
        if not d.any():
            p = 1.0  # identical scores: nothing to detect
        p_values[m] = p
        out[m] = {"delta": delta, "ci_low": lo, "ci_high": hi, "p_value": p, "n_images": n}
    for m, adj in holm(p_values).items():
        out[m]["p_holm"] = adj
        out[m]["verdict"] = SAME if adj >= alpha else BETTER if out[m]["delta"] > 0 else WORSE
    return out


def _resampled_means(d: np.ndarray, n_resamples: int, seed: int) -> np.ndarray:
    """Means of ``n_resamples`` resamples of ``d``, drawn a chunk at a time (at most ~20 M indices in memory):
    the same seed and length give the same resamples, so every metric sees the same draws."""
    rng = np.random.default_rng(seed)
    n = len(d)
    chunk = max(1, min(n_resamples, 20_000_000 // max(n, 1)))
    out = []
    for start in range(0, n_resamples, chunk):
        idx = rng.integers(
            0, n, size=(min(chunk, n_resamples - start), n), dtype=np.int64 if n > 2**31 - 1 else np.int32
        )
        out.append(d[idx].mean(axis=1))
    return np.concatenate(out)


def win_rate(
    scores: list[float], n_resamples: int = 1000, seed: int = 0, alpha: float = 0.05
) -> Optional[dict[str, Any]]:
    """The pairwise judge's verdict: ``scores`` holds one value per image, this run's share of that image's
    judgements (1 won both orders, 0.5 split or tied, 0 lost both). The win rate is their mean; its interval
    is a bootstrap over images as above, and the p-value tests a win rate of 0.5 (no preference)."""
    if not scores:
        return None
    d = np.asarray(scores, dtype=np.float64)
    rate = float(d.mean())
    means = _resampled_means(d, n_resamples, seed) if n_resamples else np.full(1, rate)
    lo, hi = (float(x) for x in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
    below, above = int((means <= 0.5).sum()), int((means >= 0.5).sum())
    p = min(1.0, 2 * (min(below, above) + 1) / (n_resamples + 1)) if n_resamples else 1.0
    if (d == 0.5).all():
        p = 1.0
    verdict = SAME if p >= alpha else BETTER if rate > 0.5 else WORSE
    return {"win_rate": rate, "ci_low": lo, "ci_high": hi, "p_value": p, "n_images": len(d), "verdict": verdict}
