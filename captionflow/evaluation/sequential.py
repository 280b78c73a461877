"""The sequential verdict: is this checkpoint better than the baseline, and how soon can that be said?

**What it is about.** Each image of the golden set gives a paired difference of one primary score (this
checkpoint's minus the baseline's). The golden set is a sample of the images the checkpoints are for, so the
verdict is about the checkpoints, not about these particular images: its subject is mu, the *expected* per-image
difference on images like the golden set's (the set's own mean is one draw around it). Two equally good
checkpoints have mu = 0 however their captions happen to fall on these images.

**What it says**, each at most alpha/2 of the time when it is wrong (so equally good checkpoints get "better" or
"worse" in at most alpha of runs, counting every look and the last):

- "better" (mu > 0) or "worse" (mu < 0);
- "equivalent": mu within +/- the margin (differences that small do not matter: ``Score.margin``);
- "no detectable difference": every image seen, and none of the above.

**How**, alpha split in two (``FINAL_SHARE``):

1. While the captions come (1 - FINAL_SHARE of alpha), in a seeded uniformly random order (so that the order's
   prefix is a random sample of the set, and so of the images it stands for), a confidence sequence for mu by
   betting (Waudby-Smith & Ramdas,
   "Estimating means of bounded random variables by betting", JRSSB 2024, the with-replacement form): for each
   candidate mean m, one gambler bets that the next difference is above m and one that it is below, each with
   predictable stakes; if m were the truth, neither's capital reaches 2/alpha_s with probability above alpha_s/2,
   at any image, however often it is looked at (Ville's inequality). The verdict is read off the gamblers at
   m = 0 (better, worse) and m = +/- margin (equivalent), which are always among the candidates; the interval is
   every m no gambler has beaten, its ends found by bisection on the capital. The stakes are tuned for an effect
   of the margin's size (``Score.margin`` where none is given) and grow with the running mean's distance from m
   (the Kelly stake for the larger of the two), capped at ``TRUNCATION`` of the capital in the worst case: in
   simulations of realistic scores (bench/verdict_sim.py) this stops at +0.05 CIDEr-D after a median 2,500 of
   5,000 images where the generic stake (the predictable plug-in of the paper's section 3) needs about 4,500.
2. Once every image is seen and the sequence has said nothing, the paired t interval at 1 - FINAL_SHARE * alpha
   decides: a verdict never comes from running out of images.

Assumptions: the order is fixed before any caption is seen (``seeded_order``), the sample is its prefix - never
"whichever captions finished first" (``PrefixVerdict``) - and each difference lies within the score's bounds.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from captionflow.evaluation.cider import BOUNDS as CIDER
from captionflow.workers.clip_rows import BOUNDS as CLIP

FINAL_SHARE = 0.3  # the part of alpha kept for the paired t test once every image is seen
TRUNCATION = 0.75  # the most of its capital a gambler can lose on one image
PRIOR_IMAGES = 10  # the stakes' prior (a mean difference of 0, the score's typical SD) weighs as this many images
COARSE = 401  # candidate means across the bounds; the interval's ends are then found by bisection
BISECTIONS = 30
CHUNK = 256  # differences taken at once (bounded rows x candidates arrays)
TRAJECTORY_STEP = 1.03  # the trajectory keeps a look once the count has grown by this factor


@dataclass(frozen=True)
class Score:
    """A primary score a verdict compares: its name in the verdict line, its per-image column in scores.parquet,
    the bounds of one image's difference, the score's range, its default margin and a typical per-image
    difference's SD (the stakes' prior)."""

    name: str
    metric: str
    bounds: tuple[float, float]
    span: float  # the score's range (its highest minus its lowest value): a margin is below half of it
    margin: float  # differences of the mean smaller than this do not matter (the default; the stakes' design)
    sd: float

    def check_margin(self, margin: Optional[float]) -> float:
        """The margin a run asked for (None: the default), or ValueError in one line where it means nothing:
        negative, or at half the score's range or more (every checkpoint "equivalent" before any image)."""
        if margin is None:
            return self.margin
        if not 0 <= margin < self.span / 2:
            raise ValueError(
                f"verdict_margin {margin:g} for the {self.name} must be at least 0 and below half its range "
                f"({self.span / 2:g}); sensible: about {self.margin:g} (docs/evaluation.md)"
            )
        return float(margin)


def paired(name: str, metric: str, score_bounds: tuple[float, float], margin: float, sd: float) -> Score:
    """A score of each side's captions within ``score_bounds``: one image's difference within (lo - hi, hi - lo)."""
    lo, hi = score_bounds
    return Score(name, metric, (lo - hi, hi - lo), hi - lo, margin, sd)


VERDICT_SCORES = {
    "cider": paired("CIDEr-D", "cider", CIDER, 0.05, 1.0),
    "clip": paired("CLIPScore", "clip_score", CLIP, 0.01, 0.1),
    "judge": paired("judge score", "judge_mean", (1.0, 5.0), 0.1, 1.0),
    # an image's share of its two judgements minus 0.5; the margin is on the win rate (0 to 1)
    "pairwise": Score("pairwise win rate", "pairwise_score", (-0.5, 0.5), 1.0, 0.03, 0.3),
}


DECISIONS = ("continue", "better", "worse", "equivalent", "no detectable difference")


@dataclass
class Verdict:
    decision: str  # "better", "worse", "equivalent", "no detectable difference", or "continue"
    n: int  # images seen
    lower: float  # the interval for the expected per-image difference
    upper: float
    mean: float  # of the differences seen
    by: str = ""  # "sequence" (while the images came) or "final test" (every image seen), "" while undecided


@dataclass
class ConfidenceSequence:
    """The anytime-valid interval for the expected value of differences within ``bounds``, each side at
    ``alpha``/2, updated as the differences arrive. ``margin``: the equivalence margin (0: none); ``design``: the
    effect the stakes are tuned for (the margin where there is one); ``sd``: the stakes' prior SD."""

    bounds: tuple[float, float]
    alpha: float = 0.025
    margin: float = 0.0
    design: float = 0.05
    sd: float = 1.0
    trajectory: list[tuple[int, float, float]] = field(default_factory=list)  # (n, lower, upper) at looks

    def __post_init__(self) -> None:
        lo, hi = self.bounds
        if not hi > lo:
            raise ValueError(f"bounds must be (low, high) with low < high, not {self.bounds}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), not {self.alpha}")
        if not 0 <= self.margin < (hi - lo) / 2 or not self.design > 0:
            raise ValueError(f"margin {self.margin} and design {self.design} do not fit the bounds {self.bounds}")
        # the decisions' own candidates (0 and +/- the margin) among the coarse ones, strictly inside the bounds
        points = [0.0, -self.margin, self.margin] if self.margin else [0.0]
        self._m = np.unique(np.concatenate([np.linspace(lo, hi, COARSE)[1:-1], points]))
        self._zero = int(np.searchsorted(self._m, 0.0))
        self._low_m = int(np.searchsorted(self._m, -self.margin))
        self._high_m = int(np.searchsorted(self._m, self.margin))
        self._log_up = np.zeros(len(self._m))  # the gambler betting above m
        self._log_down = np.zeros(len(self._m))  # ... and below
        self._out_up = np.zeros(len(self._m), dtype=bool)  # m ever beaten from above: the truth is above it
        self._out_down = np.zeros(len(self._m), dtype=bool)
        self._threshold = math.log(2 / self.alpha)
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # differences, the stakes' estimates
        self._history: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None
        self.n, self._sum, self._sum_sq = 0, 0.0, 0.0
        self._interval: Optional[tuple[int, float, float]] = None

    @property
    def x(self) -> np.ndarray:
        """The differences so far, in order."""
        return self._arrays()[0]

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The differences and the stakes' estimates before each (``_estimates``), in order."""
        if self._history is None or len(self._history[0]) != self.n:
            self._history = tuple(np.concatenate(a) for a in zip(*self._chunks)) if self._chunks else (np.empty(0),) * 3
            self._chunks = [self._history] if self._chunks else []
        return self._history

    # ---------------------------------------------------------------- stakes
    def _estimates(self, d: np.ndarray, n0: int = 0, sum0: float = 0.0, sum_sq0: float = 0.0):
        """The running mean and variance before each difference of ``d`` (along its last axis), after ``n0``
        earlier ones summing to ``sum0`` (squares: ``sum_sq0``), with the prior."""
        w = PRIOR_IMAGES
        zero = np.zeros(d.shape[:-1] + (1,))
        s = sum0 + np.concatenate([zero, np.cumsum(d, axis=-1)[..., :-1]], axis=-1)
        s2 = sum_sq0 + np.concatenate([zero, np.cumsum(d * d, axis=-1)[..., :-1]], axis=-1)
        t = n0 + np.arange(d.shape[-1], dtype=float)  # values before each
        mean = s / (w + t)
        spread = np.maximum(s2 - np.where(t > 0, s * s / np.maximum(t, 1), 0.0), 0.0)  # sum of squares about their mean
        return mean, (w * self.sd**2 + spread) / (w + t)

    def _stakes(self, m, mean, var) -> tuple[np.ndarray, np.ndarray]:
        """The stakes on and against ``m`` (candidates, broadcast against the estimates): the Kelly stake for an
        effect of the larger of ``design`` and the running mean's distance from m, capped so that the worst
        difference within the bounds loses at most TRUNCATION of the capital."""
        lo, hi = self.bounds
        up = np.maximum(self.design, mean - m)
        down = np.maximum(self.design, m - mean)
        stake_up = np.minimum(up / (var + up * up), TRUNCATION / np.maximum(m - lo, 1e-12))
        stake_down = np.minimum(down / (var + down * down), TRUNCATION / np.maximum(hi - m, 1e-12))
        return stake_up, stake_down

    # ---------------------------------------------------------------- updating
    def update(self, differences) -> None:
        """Take the next differences of the order (a batch, in order); a look after the last of them, kept in the
        trajectory while the count has grown by TRAJECTORY_STEP since the last one kept (each costs a bisection
        over every difference so far)."""
        d = np.clip(np.asarray(differences, dtype=float).ravel(), *self.bounds)
        for start in range(0, len(d), CHUNK):
            self._update(d[start : start + CHUNK])
        if len(d) and (not self.trajectory or self.n >= self.trajectory[-1][0] * TRAJECTORY_STEP):
            self.look()

    def look(self) -> None:
        """The interval now, in the trajectory."""
        if self.n and (not self.trajectory or self.trajectory[-1][0] != self.n):
            self.trajectory.append((self.n, *self.interval()))

    def _gamble(self, d, mean, var, m, log_up0=0.0, log_down0=0.0) -> tuple[np.ndarray, np.ndarray]:
        """The gamblers' log capitals on and against each candidate ``m`` (the last axis) after each difference of
        ``d`` (the axis before it; ``mean``, ``var``: the stakes' estimates before each), from ``log_up0`` and
        ``log_down0``."""
        stake_up, stake_down = self._stakes(m, mean, var)
        step = d - m
        log_up = log_up0 + np.cumsum(np.log1p(stake_up * step), axis=-2)
        log_down = log_down0 + np.cumsum(np.log1p(-stake_down * step), axis=-2)
        return log_up, log_down

    def _update(self, d: np.ndarray) -> None:
        mean, var = self._estimates(d, self.n, self._sum, self._sum_sq)
        log_up, log_down = self._gamble(d[:, None], mean[:, None], var[:, None], self._m, self._log_up, self._log_down)
        self._out_up |= (log_up >= self._threshold).any(axis=0)
        self._out_down |= (log_down >= self._threshold).any(axis=0)
        self._log_up, self._log_down = log_up[-1], log_down[-1]
        self._chunks.append((d, mean, var))
        self.n, self._sum, self._sum_sq = self.n + len(d), self._sum + float(d.sum()), self._sum_sq + float(d @ d)

    def decisions_at_looks(self, differences: np.ndarray, looks: np.ndarray) -> np.ndarray:
        """What ``decision`` says at each look for many streams at once: ``differences`` (streams x images, each
        row an order's differences) from the start, the looks after the image counts ``looks``; an array of
        DECISIONS indices (streams x looks). The same gamblers as ``update``'s, at 0 and +/- the margin only:
        how the verdict's error rates and stopping times are simulated (tests, bench)."""
        d = np.clip(np.asarray(differences, dtype=float), *self.bounds)
        points = np.array([0.0, -self.margin, self.margin] if self.margin else [0.0])
        mean, var = self._estimates(d)
        log_up, log_down = self._gamble(d[..., None], mean[..., None], var[..., None], points)
        ever_up = np.maximum.accumulate(log_up >= self._threshold, axis=1)[:, looks - 1]  # streams x looks x points
        ever_down = np.maximum.accumulate(log_down >= self._threshold, axis=1)[:, looks - 1]
        better, worse = ever_up[..., 0], ever_down[..., 0]
        both = better & worse  # the side of the mean so far, as decision() takes it
        positive = np.cumsum(d, axis=1)[:, looks - 1] > 0
        better, worse = np.where(both, positive, better), np.where(both, ~positive, worse)
        equivalent = ever_up[..., 1] & ever_down[..., 2] if self.margin else np.zeros_like(better)
        return np.select([better, worse, equivalent], [1, 2, 3], 0)

    # ---------------------------------------------------------------- reading it
    def _beaten(self, m: float, up: bool) -> bool:
        """Whether the gambler on (``up``) or against m has ever reached the threshold, over every image so far."""
        x, mean, var = self._arrays()
        log_up, log_down = self._gamble(x[:, None], mean[:, None], var[:, None], np.array([m]))
        return bool((log_up if up else log_down).max(initial=-np.inf) >= self._threshold)

    def _end(self, up: bool) -> float:
        """The interval's lower (``up``: the largest m beaten from above) or upper end, between the last coarse
        candidate beaten and the next, by bisection."""
        lo, hi = self.bounds
        out = self._out_up if up else self._out_down
        if up:
            k = np.flatnonzero(out)
            if not len(k):
                return lo
            a, b = self._m[k[-1]], (self._m[k[-1] + 1] if k[-1] + 1 < len(self._m) else hi)
        else:
            k = np.flatnonzero(out)
            if not len(k):
                return hi
            a, b = (self._m[k[0] - 1] if k[0] > 0 else lo), self._m[k[0]]
        for _ in range(BISECTIONS):  # up: a beaten, b not; down: a not, b beaten
            mid = (a + b) / 2
            if self._beaten(mid, up) == up:
                a = mid
            else:
                b = mid
        return float(a if up else b)

    def interval(self) -> tuple[float, float]:
        if self._interval is None or self._interval[0] != self.n:
            self._interval = (self.n, *((self._end(True), self._end(False)) if self.n else self.bounds))
        return self._interval[1:]

    def decision(self) -> str:
        """What the gamblers at 0 and +/- the margin say: better, worse, equivalent, or continue."""
        better, worse = self._out_up[self._zero], self._out_down[self._zero]
        if better and worse:  # both at once (a chance below alpha): the side of the mean
            better = self._sum > 0
            worse = not better
        if better:
            return "better"
        if worse:
            return "worse"
        if self.margin and self._out_up[self._low_m] and self._out_down[self._high_m]:
            return "equivalent"
        return "continue"


def final_test(x: np.ndarray, alpha: float, margin: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The paired t interval at 1 - ``alpha`` over every image's difference (``x``'s last axis; several streams
    at once along the others): the DECISIONS index of better, worse, equivalent (inside +/- ``margin``) or no
    detectable difference, and the interval's ends."""
    from scipy import stats

    x = np.asarray(x, dtype=float)
    n = x.shape[-1]
    mean = x.mean(axis=-1) if n else np.zeros(x.shape[:-1])
    if n < 2:
        inf = np.full(mean.shape, np.inf)
        return np.full(mean.shape, 4), -inf, inf
    half = stats.t.ppf(1 - alpha / 2, n - 1) * x.std(axis=-1, ddof=1) / math.sqrt(n)
    lower, upper = mean - half, mean + half
    equivalent = (-margin < lower) & (upper < margin) if margin else np.zeros(mean.shape, dtype=bool)
    return np.select([lower > 0, upper < 0, equivalent], [1, 2, 3], 4), lower, upper


def seeded_order(image_ids: list[str], seed: str) -> list[str]:
    """The golden set's captioning order: a uniformly random permutation fixed by ``seed`` (the dataset, the
    baseline run and the candidate checkpoint), so that a rerun or a resume continues the same sample while each
    candidate is judged on a sample of its own. Sorted first: the listing's order does not matter."""
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big"))
    ids = sorted(image_ids)
    return [ids[i] for i in rng.permutation(len(ids))]


class PrefixVerdict:
    """The sequential verdict of one run as its results commit: the population's images in ``seeded_order``;
    ``observe`` takes newly committed values (captions, or judgements) in any order and feeds the confidence
    sequence the per-image differences (``differences``: a prefix's values -> image id -> this run's score minus
    the baseline's) of the order's *prefix* only - the images up to the first one not yet in - never whichever
    results finished first (caption length and completion time go together: an early sample would be biased).
    Values beyond the prefix's first gap wait, unscored. Once the prefix is the whole order, the final test
    decides what the sequence has not. ``finish`` leaves out the images that failed for good.
    ``paired_differences`` makes ``differences`` for a score of both sides' captions."""

    def __init__(
        self,
        order: list[str],
        differences,
        score: Score,
        alpha: float = 0.05,
        margin: Optional[float] = None,
        against: str = "",
        against_run: str = "",
        extra: dict | None = None,
    ):
        self.order = list(order)
        self._population = set(self.order)
        self.differences, self.score, self.against = differences, score, against
        self.against_run = against_run  # the baseline's run folder
        self.extra = extra or {}  # more of the record (a CLIPScore verdict's checkpoint and its baseline's scores)
        self.alpha, self.margin = alpha, score.check_margin(margin)
        self.cs = ConfidenceSequence(
            score.bounds, alpha * (1 - FINAL_SHARE), self.margin, self.margin or score.margin, score.sd
        )
        self.waiting: dict = {}  # values after the prefix's first gap, scored once the prefix reaches them
        self._decision, self._by, self._final = "continue", "", None
        self._advance()

    @property
    def decided(self) -> bool:
        return self._decision != "continue"

    @property
    def stopped_early(self) -> bool:
        """Decided before every image of the order was seen: what it did not look at was not needed."""
        return self._by == "sequence" and self.cs.n < len(self.order)

    @property
    def verdict(self) -> Verdict:
        """The decision and the interval now: the final test's once it decided, else the sequence's."""
        n = self.cs.n
        lower, upper = self._final if self._final else self.cs.interval()
        return Verdict(self._decision, n, lower, upper, self.cs._sum / n if n else 0.0, self._by)

    def observe(self, values: dict) -> bool:
        """Only the prefix's values are scored, as it grows: a value beyond its first gap waits unscored, and none
        is scored once the verdict is in. The driver calls this with every row it pulls, between pulls; it
        scored every row (~2-3 ms each), and on 4 H200s it pulled 1,327 rows for a verdict after 84."""
        if self.decided:
            return True
        self.waiting.update((i, v) for i, v in values.items() if i in self._population)
        return self._advance()

    def finish(self, missing) -> bool:
        """The pass is over and ``missing`` (images without a value: captions or judgements that failed for
        good) will not come: they leave the order, where the prefix has not reached them, so that the rest is
        scored and, the order done, the final test decides. A random order's restriction to the images that
        have a value is a random order of them; the verdict is then about the images the checkpoint captions."""
        if self.decided:
            return True
        gone = set(missing) & self._population - set(self.order[: self.cs.n])
        if gone:
            self.order = [i for i in self.order if i not in gone]
            self._population -= gone
        return self._advance()

    def _advance(self) -> bool:
        k, prefix = self.cs.n, []
        while k + len(prefix) < len(self.order) and self.order[k + len(prefix)] in self.waiting:
            prefix.append(self.order[k + len(prefix)])
        if prefix:
            d = self.differences({i: self.waiting.pop(i) for i in prefix})
            self.cs.update([d[i] for i in prefix])
        if not self.cs.n:
            return False
        self._decision, self._by = self.cs.decision(), "sequence"
        if self._decision == "continue" and self.cs.n == len(self.order):
            code, lower, upper = final_test(self.cs.x, self.alpha * FINAL_SHARE, self.margin)
            self._decision, self._final, self._by = DECISIONS[int(code)], (float(lower), float(upper)), "final test"
        if self.decided:
            self.cs.look()  # the stop, in the trajectory
        else:
            self._by = ""
        return self.decided

    def simulate(self, differences, look: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The verdicts this one's settings give on many simulated streams (``differences``: streams x images,
        each row the differences in an order, the whole set), looking every ``look`` images and at the end as
        ``observe`` does, the final test included: per stream, its DECISIONS index, the images used and whether
        the final test gave it."""
        x = np.asarray(differences, dtype=float)
        n = x.shape[1]
        looks = np.unique(np.append(np.arange(look, n + 1, look), n))
        codes = self.cs.decisions_at_looks(x, looks)
        decided = codes.any(axis=1)
        first = np.where(decided, (codes > 0).argmax(axis=1), len(looks) - 1)
        final, _, _ = final_test(x, self.alpha * FINAL_SHARE, self.margin)
        return np.where(decided, codes[np.arange(len(x)), first], final), np.where(decided, looks[first], n), ~decided

    def record(self, points: int = 200) -> dict:
        """What metrics.json, the leaderboard and the report say of it: the decision and how it was reached, the
        images it used, alpha, the margin, the score, and the interval's trajectory (at most ``points`` of it,
        the stop included)."""
        v = self.verdict
        self.cs.look()
        traj = self.cs.trajectory
        step = max(1, len(traj) // points)
        kept = traj[::step] + ([traj[-1]] if traj and (len(traj) - 1) % step else [])
        return {
            "decision": v.decision,
            "decided_by": v.by,
            "images_used": v.n,
            "images_total": len(self.order),
            "alpha": self.alpha,
            "margin": self.margin,
            "score": self.score.name,
            "metric": self.score.metric,
            **self.extra,
            "against": self.against,
            "against_run": self.against_run,
            "mean_difference": round(float(v.mean), 6),
            "lower": _finite(v.lower),
            "upper": _finite(v.upper),
            "trajectory": [[int(n), round(float(lo), 5), round(float(hi), 5)] for n, lo, hi in kept],
        }


def _finite(x: float) -> Optional[float]:
    return round(float(x), 6) if math.isfinite(x) else None


def paired_differences(score, baseline: dict[str, str]):
    """``PrefixVerdict``'s ``differences`` for a score of captions (``score``: captions -> per-image scores) against
    the baseline's captions (``baseline``: image id -> caption), scored as the prefix reaches them, not up front:
    scoring 5,000 of them took ~5 s on 2 cores before the run's first request could go out."""

    def differences(mine: dict[str, str]) -> dict[str, float]:
        a, b = score(mine), score({i: baseline[i] for i in mine})
        return {i: a[i] - b[i] for i in mine}

    return differences


MEANING = {
    "better": "its expected {score} per image is above the baseline's",
    "worse": "its expected {score} per image is below the baseline's",
    "equivalent": "its expected {score} per image is within +/- {margin:g} of the baseline's",
    "no detectable difference": "all {total:,} images could not tell it from the baseline, nor show it within "
    "+/- {margin:g}",
    "continue": "the verdict was not reached",
}


def meaning(record: dict) -> str:
    """What the verdict says, in one sentence a user reads: about the checkpoint on images like the golden set's,
    with its error rate."""
    r = record
    said = MEANING[r["decision"]].format(score=r["score"], margin=r.get("margin", 0), total=r["images_total"])
    if r["decision"] in ("better", "worse", "equivalent"):
        said += (
            f" on images like these (a wrong '{r['decision']}' has at most a {r['alpha'] / 2:g} chance"
            ", however early it stopped)"
        )
    return said[0].upper() + said[1:] + "."


def verdict_line(record: dict) -> str:
    """'worse after 612 of 5,000 images (CIDEr-D difference -0.041, interval [-0.072, -0.008]; alpha 0.05,
    margin 0.05, against ...)'; a pairwise verdict gives the win rate and its interval (the differences are the
    shares minus 0.5)."""
    r = record
    what = "undecided" if r["decision"] == "continue" else r["decision"]
    lo, hi = (r[k] if r[k] is not None else math.nan for k in ("lower", "upper"))
    if r.get("metric") == "pairwise_score":
        how = f"{r['score']} {0.5 + r['mean_difference']:.3f}, interval [{0.5 + lo:.3f}, {0.5 + hi:.3f}]"
    else:
        how = f"{r['score']} difference {r['mean_difference']:+.3f}, interval [{lo:+.3f}, {hi:+.3f}]"
    by = " at the final test" if r.get("decided_by") == "final test" else ""
    return (
        f"{what} after {r['images_used']:,} of {r['images_total']:,} images{by} ({how}; alpha {r['alpha']:g}, "
        f"margin {r.get('margin', 0):g}, against {r['against']})"
    )


def reconcile(record: dict, bootstrap: dict) -> dict:
    """The fixed-sample paired bootstrap's answer (``significance.paired_bootstrap``'s entry for the verdict's score,
    on the images this run captioned, against the same baseline) beside the sequential verdict ``record``: whether
    they agree, and a line that says so. They can disagree near the edge: the bootstrap's interval holds for a
    sample fixed in advance and is narrower; the sequence's holds at every stop."""
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
