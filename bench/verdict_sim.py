"""The sequential verdict's operating characteristics, by simulation of realistic per-image scores: how often it says
"better"/"worse" of equally good checkpoints (every look, the last included), how often it is right about a real
difference, and after how many images. The models (``cider_pairs``, ``judge_pairs``, ``pairwise_shares``) are the
ones tests/captionflow/evaluation/test_sequential.py holds the verdict to.

python bench/verdict_sim.py [--streams 2000] [--n 5000] [--json bench/results/verdict_sim-cpu.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from scipy import special, stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from captionflow.evaluation.sequential import DECISIONS, VERDICT_SCORES, PrefixVerdict

LOOK = 64  # a look every committed batch (commit_rows' default)


# ---------------------------------------------------------------- per-image score models
CUTS = stats.norm.ppf(np.cumsum([0.1, 0.2, 0.3, 0.25]))  # a judge's 1-5 scale on the latent quality


def _cider(latent: np.ndarray) -> np.ndarray:
    """CIDEr-D from a standard-normal latent quality: 0 below its 15th percentile, a Weibull tail above (mean
    ~1.18, SD ~1.07), clipped at 10."""
    above = np.clip(special.ndtr(-latent) / 0.85, 1e-300, 1.0)  # 1 - the tail's quantile level
    return np.where(special.ndtr(latent) < 0.15, 0.0, np.minimum(1.219 * (-np.log(above)) ** (1 / 1.1), 10.0))


def cider_pairs(rng, streams: int, n: int, theta: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """CIDEr-D of the baseline's and the candidate's captions of ``n`` images (streams x n each): mean ~1.0, SD
    ~1.1, ~15% zeros, a long tail clipped at 10; the two checkpoints correlate ~0.6 through the image's difficulty,
    ~20% of images get the same score (the same caption, or both 0); per-image difference SD ~0.95. ``theta``
    shifts the candidate's latent quality (``effect_theta``: for a given expected difference)."""
    z = rng.standard_normal((streams, n))
    latent = lambda shift: np.sqrt(0.6) * z + np.sqrt(0.4) * rng.standard_normal((streams, n)) + shift
    base, mine = _cider(latent(0.0)), _cider(latent(theta))
    same = rng.random((streams, n)) < 0.15  # the candidate's caption is the baseline's
    return base, np.where(same, base, mine)


def judge_pairs(rng, streams: int, n: int, theta: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """A judge's 1-5 scores of both checkpoints' captions: ~56% of images get the same score from both (30% the
    same caption, the rest by the scale's coarseness), correlation ~0.7, difference SD ~0.94."""
    z = rng.standard_normal((streams, n))
    latent = lambda shift: np.sqrt(0.6) * z + np.sqrt(0.4) * rng.standard_normal((streams, n)) + shift
    base, mine = (1.0 + (latent(s)[..., None] > CUTS).sum(axis=-1) for s in (0.0, theta))
    return base, np.where(rng.random((streams, n)) < 0.3, base, mine)


def _judged(q: np.ndarray, first: float) -> np.ndarray:
    """The chance a pairwise judge prefers the candidate (quality advantage ``q``; ``first``: +1 shown first)."""
    return special.expit(1.5 * q + first)


def pairwise_shares(rng, streams: int, n: int, theta: float = 0.0) -> np.ndarray:
    """The candidate's share of a pairwise judge's two judgements of each image (A/B and B/A; 1, 0.5 or 0 each):
    30% of images tied in both orders, 15% of single judgements ties, a position bias toward the caption shown
    first as strong as a two-thirds-SD quality difference; SD ~0.28. ``theta``: the candidate's mean advantage."""
    q = rng.standard_normal((streams, n)) + theta

    def judged(first):
        tie = rng.random((streams, n)) < 0.15
        return np.where(tie, 0.5, (rng.random((streams, n)) < _judged(q, first)).astype(float))

    share = (judged(1.0) + judged(-1.0)) / 2
    return np.where(rng.random((streams, n)) < 0.3, 0.5, share)


def differences(score: str, rng, streams: int, n: int, theta: float = 0.0) -> np.ndarray:
    """Per-image differences (streams x n) the verdict on ``score`` takes."""
    if score == "pairwise":
        return pairwise_shares(rng, streams, n, theta) - 0.5
    base, mine = (cider_pairs if score == "cider" else judge_pairs)(rng, streams, n, theta)
    return mine - base


def expected_difference(score: str, theta: float) -> float:
    """The models' expected per-image difference at ``theta``, by integration over the latent quality."""
    y = np.linspace(-9, 9, 36_001)
    at = lambda f, shift: float(np.trapezoid(f(y) * stats.norm.pdf(y - shift), y))
    if score == "cider":
        return 0.85 * (at(_cider, theta) - at(_cider, 0.0))
    if score == "judge":
        return 0.7 * float(np.sum(special.ndtr(theta - CUTS) - special.ndtr(-CUTS)))
    share = lambda q: 0.075 + 0.425 * (_judged(q, 1.0) + _judged(q, -1.0))  # an order's expected value, averaged
    return 0.7 * (at(share, theta) - 0.5)


@functools.cache
def effect_theta(score: str, effect: float) -> float:
    """The latent shift whose expected per-image difference is ``effect``."""
    from scipy.optimize import brentq

    return float(brentq(lambda t: expected_difference(score, t) - effect, -3.0, 3.0, xtol=1e-10))


# ---------------------------------------------------------------- the verdict on them
def verdicts(
    score: str,
    effect: float,
    streams: int,
    n: int = 5000,
    seed: int = 0,
    alpha: float = 0.05,
    margin=None,
    look: int = LOOK,
    chunk: int = 250,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The verdicts (DECISIONS indices), images used and whether the final test gave them, of ``streams`` runs on
    golden sets of ``n`` fresh images each (so each set's own mean differs from ``effect``, the expected
    difference), with the verdict's settings."""
    theta = effect_theta(score, effect) if effect else 0.0
    rng = np.random.default_rng(seed)
    pv = PrefixVerdict(["-"], dict, VERDICT_SCORES[score], alpha, margin)
    parts = [
        pv.simulate(differences(score, rng, min(chunk, streams - start), n, theta), look)
        for start in range(0, streams, chunk)
    ]
    return tuple(np.concatenate(p) for p in zip(*parts))


def summary(codes: np.ndarray, used: np.ndarray, truth: str) -> dict:
    """Shares of each decision, the share right (``truth``: better, worse, or equivalent for no difference) and
    wrong-direction, and the images used (median, mean, 90th percentile)."""
    out = {DECISIONS[k]: round(float((codes == k).mean()), 4) for k in range(1, 5)}
    right = DECISIONS.index(truth)
    out["right"] = round(float((codes == right).mean()), 4)
    out["better_or_worse"] = round(out["better"] + out["worse"], 4)
    out["images_median"] = float(np.median(used))
    out["images_mean"] = round(float(used.mean()), 1)
    out["images_p90"] = float(np.percentile(used, 90))
    return out


CASES = [  # (score, expected difference, margin: None for the score's default, what is right)
    ("cider", 0.0, None, "equivalent"),
    ("cider", 0.05, 0.0, "better"),
    ("cider", 0.05, None, "better"),
    ("cider", 0.10, None, "better"),
    ("cider", -0.05, 0.0, "worse"),
    ("cider", 0.05, 0.03, "better"),
    ("judge", 0.0, None, "equivalent"),
    ("judge", 0.15, None, "better"),
    ("pairwise", 0.0, None, "equivalent"),
    ("pairwise", 0.05, None, "better"),
    ("pairwise", 0.03, None, "better"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "verdict_sim-cpu.json"))
    a = ap.parse_args()
    rows = []
    heads = ("score", "effect", "margin", "right", "b/w", "equiv", "none", "median", "p90")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (9, 7, 6, 6, 6, 6, 6, 7, 6))))
    for score, effect, margin, truth in CASES:
        t0 = time.perf_counter()
        codes, used, _ = verdicts(score, effect, a.streams, a.n, seed=len(rows), margin=margin)
        s = summary(codes, used, truth)
        m = VERDICT_SCORES[score].margin if margin is None else margin
        rows.append({"score": score, "effect": effect, "margin": m, "truth": truth, **s,
                     "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
        print(
            f"{score:>9} {effect:>+7.3f} {m:>6.3f} {s['right']:>6.3f} {s['better_or_worse']:>6.3f} "
            f"{s['equivalent']:>6.3f} {s['no detectable difference']:>6.3f} {s['images_median']:>7.0f} "
            f"{s['images_p90']:>6.0f}",
            flush=True,
        )
    Path(a.json).write_text(
        json.dumps(
            {"cpus": os.cpu_count(), "streams": a.streams, "images": a.n, "look": LOOK, "alpha": 0.05, "cases": rows},
            indent=2,
        )
        + "\n"  # fmt: skip
    )
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
