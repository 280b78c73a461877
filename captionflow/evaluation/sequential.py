"""An anytime-valid confidence sequence for the mean paired difference over a finite golden set.

A comparison against a baseline captions the golden set in a seeded random order; after each committed batch the
per-image differences of a primary score (this checkpoint's minus the baseline's) so far feed
``ConfidenceSequence``. Its interval for the mean difference over the *whole* set holds at every sample size at
once with probability >= 1 - alpha, so the run may look after every batch and stop as soon as the interval says
"better" (above 0), "worse" (below 0) or "equivalent" (inside [-delta, delta]) - unlike a bootstrap interval
recomputed after each batch, whose false verdicts grow with every look (tests/captionflow/evaluation/
test_sequential.py shows both).

The method is betting (Waudby-Smith & Ramdas, "Estimating means of bounded random variables by betting", JRSSB
2024, sections 4 and 6): the differences are mapped to [0, 1] through the score's bounds; for each candidate mean
m a gambler bets on the next value being above (and another below) what m implies for the images *not yet seen*
- the sampling-without-replacement form, so that the interval shrinks to the set's exact mean as the order runs
out - with predictable plug-in bets, truncated at ``TRUNCATION``; the hedged capital max(K+/2, K-/2) is below
1/alpha for every m in the interval (Ville's inequality). Candidates are a grid of ``GRID`` points; the interval
is the running intersection of the sets.

Assumptions: the order is a uniformly random permutation of the set, fixed before any caption is seen (seeded
by the dataset and the baseline), and the sample is the order's prefix - never "whichever captions finished
first"; the per-image scores lie within the declared bounds (``bounds``: values outside are clipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

GRID = 2001  # candidate means on [0, 1]
TRUNCATION = 0.5  # the largest fraction of its capital a gambler bets
CHUNK = 256  # differences taken at once


@dataclass
class Verdict:
    decision: str  # "better", "worse", "equivalent", or "continue"
    n: int  # images seen
    lower: float  # the interval for the mean difference over the whole set
    upper: float
    mean: float  # of the differences seen


@dataclass
class ConfidenceSequence:
    """The interval for the mean of ``n_total`` paired differences, each within ``bounds`` (the score's range
    minus itself: (lo - hi, hi - lo)), updated as differences arrive in the order's sequence."""

    n_total: int
    bounds: tuple[float, float]
    alpha: float = 0.05
    delta: float = 0.0  # the equivalence margin (0: no equivalence verdict)
    grid: int = GRID
    trajectory: list[tuple[int, float, float]] = field(default_factory=list)  # (n, lower, upper) after each update

    def __post_init__(self) -> None:
        if self.n_total < 1:
            raise ValueError("a confidence sequence needs at least one image")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), not {self.alpha}")
        lo, hi = self.bounds
        if not hi > lo:
            raise ValueError(f"bounds must be (low, high) with low < high, not {self.bounds}")
        self._m = np.linspace(0.0, 1.0, self.grid)
        self._log_plus = np.zeros(self.grid)
        self._log_minus = np.zeros(self.grid)
        self._alive = np.ones(self.grid, dtype=bool)
        self.n, self._sum, self._sum_sq_dev, self._mean_hat = 0, 0.0, 0.25, 0.5  # the plug-in's priors
        self._raw_sum = 0.0

    # ---------------------------------------------------------------- mapping to [0, 1] and back
    def _to_unit(self, d: np.ndarray) -> np.ndarray:
        lo, hi = self.bounds
        return (np.clip(d, lo, hi) - lo) / (hi - lo)

    def _from_unit(self, x: float) -> float:
        lo, hi = self.bounds
        return lo + x * (hi - lo)

    # ---------------------------------------------------------------- updating
    def update(self, differences) -> Verdict:
        """Take the next differences of the order (a batch, in order); the verdict after the last of them."""
        d = np.asarray(differences, dtype=float).ravel()
        if self.n + len(d) > self.n_total:
            raise ValueError(f"{self.n + len(d)} differences for a set of {self.n_total}")
        for start in range(0, len(d), CHUNK):  # bounded (rows x grid) arrays, whatever the batch
            self._update(d[start : start + CHUNK])
        return self.verdict()

    def _update(self, d: np.ndarray) -> None:
        x = self._to_unit(d)
        k = len(x)
        t = self.n + np.arange(1, k + 1)  # the 1-based index of each new value
        # predictable plug-in bets: from the values before each one (their running mean and variance)
        sums_before = self._sum + np.concatenate(([0.0], np.cumsum(x)[:-1]))
        mean_hat = np.empty(k)
        var_hat = np.empty(k)
        m_hat, ss = self._mean_hat, self._sum_sq_dev
        for i in range(k):  # sequential by nature (each uses the estimates before it); k is a chunk, cheap
            mean_hat[i], var_hat[i] = m_hat, ss / t[i]
            m_hat = (0.5 + sums_before[i] + x[i]) / (t[i] + 1)
            ss += (x[i] - m_hat) ** 2
        self._mean_hat, self._sum_sq_dev = m_hat, ss
        lam = np.sqrt(2 * math.log(2 / self.alpha) / (var_hat * t * np.log1p(t)))
        # what each candidate mean m implies for the mean of the values not yet seen, before each new one
        remaining = self.n_total - (t - 1)
        mu = (self.n_total * self._m[None, :] - sums_before[:, None]) / remaining[:, None]  # (k, grid)
        feasible = (mu >= 0) & (mu <= 1)
        mu_c = np.clip(mu, 1e-9, 1 - 1e-9)
        lam_plus = np.minimum(lam[:, None], TRUNCATION / mu_c)
        lam_minus = np.minimum(lam[:, None], TRUNCATION / (1 - mu_c))
        step = x[:, None] - mu_c
        log_plus = self._log_plus + np.cumsum(np.log1p(lam_plus * step), axis=0)
        log_minus = self._log_minus + np.cumsum(np.log1p(-lam_minus * step), axis=0)
        threshold = math.log(1 / self.alpha)
        hedged = np.maximum(log_plus, log_minus) + math.log(0.5)
        inside = np.logical_and.accumulate((hedged < threshold) & feasible, axis=0) & self._alive[None, :]
        self._log_plus, self._log_minus, self._alive = log_plus[-1], log_minus[-1], inside[-1].copy()
        self._raw_sum += float(d.sum())
        # each image's interval at once: the first and last candidate still in, widened by the grid's step
        any_in = inside.any(axis=1)
        first = np.argmax(inside, axis=1)
        last = self.grid - 1 - np.argmax(inside[:, ::-1], axis=1)
        step = 1.0 / (self.grid - 1)
        lower = np.where(any_in, np.maximum(0.0, self._m[first] - step), (sums_before + x) / t)
        upper = np.where(any_in, np.minimum(1.0, self._m[last] + step), (sums_before + x) / t)
        self.trajectory.extend(
            zip(t.tolist(), [self._from_unit(v) for v in lower.tolist()], [self._from_unit(v) for v in upper.tolist()])
        )
        self.n += k
        self._sum += float(x.sum())

    def _interval(self, alive: np.ndarray, n: int, unit_sum: float) -> tuple[float, float]:
        if not alive.any():  # numerically empty (only where the bets over-shot): the running mean's point
            mid = self._from_unit(unit_sum / max(n, 1))
            return mid, mid
        idx = np.flatnonzero(alive)
        step = 1.0 / (self.grid - 1)  # the grid's resolution widens the interval by one step each side
        return self._from_unit(max(0.0, self._m[idx[0]] - step)), self._from_unit(min(1.0, self._m[idx[-1]] + step))

    # ---------------------------------------------------------------- reading it
    def interval(self) -> tuple[float, float]:
        if self.n == self.n_total:  # every image seen: the set's mean is known
            exact = self._raw_sum / self.n_total
            return exact, exact
        return self._interval(self._alive, self.n, self._sum) if self.n else self.bounds

    def verdict(self) -> Verdict:
        lower, upper = self.interval()
        mean = self._raw_sum / self.n if self.n else 0.0
        if lower > 0:
            decision = "better"
        elif upper < 0:
            decision = "worse"
        elif self.delta > 0 and -self.delta <= lower and upper <= self.delta:
            decision = "equivalent"
        elif self.n == self.n_total:
            decision = "no difference" if lower == upper == 0 else ("better" if mean > 0 else "worse")
        else:
            decision = "continue"
        return Verdict(decision=decision, n=self.n, lower=lower, upper=upper, mean=mean)


def seeded_order(image_ids: list[str], seed: str) -> list[str]:
    """The golden set's captioning order: a uniformly random permutation fixed by ``seed`` (the dataset's and the
    baseline's fingerprints), so that a rerun or a resume continues the same sample. Sorted first: the listing's
    order does not matter."""
    import hashlib

    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big"))
    ids = sorted(image_ids)
    return [ids[i] for i in rng.permutation(len(ids))]


class PrefixVerdict:
    """The sequential verdict of one run as its results commit: the population's images in ``seeded_order``;
    ``observe`` takes newly committed values (captions, or judgements) in any order and feeds the confidence
    sequence the per-image differences (``differences``: a prefix's values -> image id -> this run's score minus
    the baseline's, within ``bounds``) of the order's *prefix* only - the images up to the first one not yet in -
    never whichever results finished first (caption length and completion time go together: an early sample
    would be biased). Values beyond the prefix's first gap wait, unscored. True once the verdict is in.
    ``paired_differences`` makes ``differences`` for a score of both sides' captions."""

    def __init__(
        self,
        order: list[str],
        differences,
        bounds: tuple[float, float],
        alpha: float = 0.05,
        delta: float = 0.0,
        score_name: str = "cider",
        against: str = "",
        against_run: str = "",
        metric: str = "cider",
        extra: dict | None = None,
    ):
        self.order = list(order)
        self._population = set(self.order)
        self.differences, self.score_name, self.against = differences, score_name, against
        self.against_run = against_run  # the baseline's run folder
        self.metric = metric  # the score's per-image column (scores.parquet), for the bootstrap beside the verdict
        self.extra = extra or {}  # more of the record (a CLIPScore verdict's checkpoint and its baseline's scores)
        self.cs = ConfidenceSequence(len(self.order), bounds, alpha, delta)
        self.waiting: dict = {}  # values after the prefix's first gap, scored once the prefix reaches them
        self.verdict = self.cs.verdict()

    @property
    def decided(self) -> bool:
        return self.verdict.decision != "continue"

    def observe(self, values: dict) -> bool:
        """Only the prefix's values are scored, as it grows: a value beyond its first gap waits unscored, and none
        is scored once the verdict is in. The driver calls this with every row it pulls, between pulls; it
        scored every row (~2-3 ms each), and on 4 H200s it pulled 1,327 rows for a verdict after 84."""
        if self.decided:
            return True
        self.waiting.update((i, v) for i, v in values.items() if i in self._population)
        k, prefix = self.cs.n, []
        while k + len(prefix) < len(self.order) and self.order[k + len(prefix)] in self.waiting:
            prefix.append(self.order[k + len(prefix)])
        if prefix:
            d = self.differences({i: self.waiting.pop(i) for i in prefix})
            self.verdict = self.cs.update([d[i] for i in prefix])
        return self.decided

    def record(self, points: int = 200) -> dict:
        """What metrics.json, the leaderboard and the report say of it: the decision, the images it used, alpha,
        delta, the score, and the interval's trajectory (at most ``points`` of it, the stop included)."""
        v, traj = self.verdict, self.cs.trajectory
        step = max(1, len(traj) // points)
        kept = traj[::step] + ([traj[-1]] if traj and (len(traj) - 1) % step else [])
        return {
            "decision": v.decision,
            "images_used": v.n,
            "images_total": len(self.order),
            "alpha": self.cs.alpha,
            "delta": self.cs.delta,
            "score": self.score_name,
            "metric": self.metric,
            **self.extra,
            "against": self.against,
            "against_run": self.against_run,
            "mean_difference": round(float(v.mean), 6),
            "lower": round(float(v.lower), 6),
            "upper": round(float(v.upper), 6),
            "trajectory": [[int(n), round(float(lo), 5), round(float(hi), 5)] for n, lo, hi in kept],
        }


def paired_differences(score, baseline: dict[str, str]):
    """``PrefixVerdict``'s ``differences`` for a score of captions (``score``: captions -> per-image scores) against
    the baseline's captions (``baseline``: image id -> caption), scored as the prefix reaches them, not up front:
    scoring 5,000 of them took ~5 s on 2 cores before the run's first request could go out. Its bounds are
    ``paired_bounds`` of the score's."""

    def differences(mine: dict[str, str]) -> dict[str, float]:
        a, b = score(mine), score({i: baseline[i] for i in mine})
        return {i: a[i] - b[i] for i in mine}

    return differences


def paired_bounds(bounds: tuple[float, float]) -> tuple[float, float]:
    """A score within (lo, hi) minus another: within (lo - hi, hi - lo)."""
    lo, hi = bounds
    return (lo - hi, hi - lo)


def verdict_line(record: dict) -> str:
    """'worse after 612 of 5,000 images (alpha 0.05, CIDEr-D difference -0.41, interval [-0.62, -0.18] against
    ...)'; a pairwise verdict gives the win rate and its interval (the differences are the shares minus 0.5)."""
    r = record
    what = {"continue": "undecided", "no difference": "no difference"}.get(r["decision"], r["decision"])
    if r.get("metric") == "pairwise_score":
        lo, mean, hi = (0.5 + r[k] for k in ("lower", "mean_difference", "upper"))
        how = f"{r['score']} {mean:.3f}, interval [{lo:.3f}, {hi:.3f}]"
    else:
        how = f"{r['score']} difference {r['mean_difference']:+.3f}, interval [{r['lower']:+.3f}, {r['upper']:+.3f}]"
    return (
        f"{what} after {r['images_used']:,} of {r['images_total']:,} images (alpha {r['alpha']:g}, {how}"
        f" against {r['against']})"
    )


def reconcile(record: dict, bootstrap: dict) -> dict:
    """The fixed-sample paired bootstrap's answer (``significance.paired_bootstrap``'s entry for the verdict's score,
    on the images this run captioned, against the same baseline) beside the sequential verdict ``record``: whether
    they agree, and a line that says so. They can disagree: the bootstrap's interval holds for a sample fixed in
    advance and is narrower; the sequence's holds at every stop, so near the edge one detects what the other does
    not."""
    decision = record["decision"]
    expected = decision if decision in ("better", "worse") else "no detectable difference"
    agrees = bootstrap["verdict"] == expected
    done = "judged" if record.get("metric") in ("judge_mean", "pairwise_score") else "captioned"
    line = (
        f"paired bootstrap on the {bootstrap['n_images']:,} images {done}: {bootstrap['verdict']} "
        f"({record['score']} difference {bootstrap['delta']:+.3f}, 95% [{bootstrap['ci_low']:+.3f}, "
        f"{bootstrap['ci_high']:+.3f}])"
    )
    if agrees:
        line += f", as the sequential verdict ({decision})"
    else:
        line += (
            f", which DISAGREES with the sequential verdict ({decision}): the bootstrap holds only for a sample fixed "
            "in advance, the sequential interval at every stop"
        )
    return {**{k: bootstrap[k] for k in ("verdict", "delta", "ci_low", "ci_high", "n_images")}, "agrees": agrees,
            "line": line}  # fmt: skip


def bootstrap_line(record: dict | None) -> str:
    """The line of the bootstrap beside a sequential verdict ``record`` (``reconcile``), or why there is none
    (its ``error``); '' for a record without one."""
    b = (record or {}).get("bootstrap")
    return (b.get("line") or b.get("error", "")) if b else ""
