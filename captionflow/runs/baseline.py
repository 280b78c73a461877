"""The run a comparison is against (``pairwise_against``, ``verdict_against``): ``previous`` or ``best`` of the
comparable runs on the leaderboard that captioned the whole set, a checkpoint evaluated on this dataset, or a run
folder."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Optional

from captionflow.data.layout import CAPTIONS
from captionflow.data.storage import Store
from captionflow.errors import BaselineError
from captionflow.evaluation.sequential import PrefixVerdict, Score, seeded_order
from captionflow.report.markdown import read_leaderboard

LATEST, BEST = "previous", "best"
log = logging.getLogger("captionflow.baseline")


def resolve_baseline(
    store: Store, run: tuple[str, ...], against: str, what: str = "pairwise_against"
) -> Optional[dict]:
    """The leaderboard row (or a row-like dict for a run folder) of the baseline run; None for ``previous`` or
    ``best`` when no comparable run exists yet. ``previous`` and ``best`` are among the runs that captioned the whole
    set: a run the sequential verdict stopped early (``partial``) holds only its order's prefix, and a verdict
    against it would be about that prefix, each run of a chain a smaller one. Raises BaselineError (naming the
    parameter ``what``) for a baseline that cannot be found."""
    ds_fp, model_fp, gen_fp = run[1], run[2], run[3]
    board = [
        r for r in read_leaderboard(store) if r["dataset_fingerprint"] == ds_fp and r["model_fingerprint"] != model_fp
    ]
    same = [r for r in board if r["generation_fingerprint"] == gen_fp]
    whole = [r for r in same if not r.get("partial")]
    if against in (LATEST, BEST) and len(whole) < len(same):
        stopped = sorted({r["model"] for r in same if r.get("partial")})
        log.info("%s: comparable runs stopped early (their verdict was in) are not baselines: %s", what, stopped)
    if against == LATEST:
        return max(whole, key=lambda r: r["evaluated_at"], default=None)
    if against == BEST:
        return best_run(whole)
    named = [r for r in same if against in (r["model"], r["run_dir"]) or r["model_fingerprint"].startswith(against)]
    if named:
        return max(named, key=lambda r: r["evaluated_at"])
    folder = Store(against)
    if folder.exists(CAPTIONS):
        if f"/runs/{ds_fp}/" not in "/" + folder.url().strip("/") + "/":
            raise BaselineError(f"{what}: {against} is a run on another dataset (this one is {ds_fp})")
        row = next((r for r in board if r["run_dir"].rstrip("/") == folder.url().rstrip("/")), None)
        if row:  # a run folder on the leaderboard (external captions, other generation settings): by its name
            return row
        return {"model": against, "run_dir": folder.url(), "model_fingerprint": folder.url().rstrip("/").split("/")[-2]}
    known = ", ".join(sorted({r["model"] for r in same})) or "none"
    raise BaselineError(
        f"{what}: {against!r} is neither 'previous', 'best', a checkpoint evaluated on this dataset with "
        f"these generation settings (known: {known}) nor a run folder with captions/"
    )


def best_run(rows: list[dict]) -> Optional[dict]:
    """The best of comparable leaderboard rows: the highest CIDEr-D, else (no references) the highest judge mean."""
    return max((r for r in rows if r.get("cider") is not None), key=lambda r: r["cider"], default=None) or max(
        (r for r in rows if r.get("judge_mean") is not None), key=lambda r: r["judge_mean"], default=None
    )


def baseline_order(
    run: tuple[str, ...], base: dict, images: Iterable[str], universe: Optional[Iterable[str]] = None
) -> list[str]:
    """A sequential verdict's order of ``images`` against the baseline run ``base``: seeded by the dataset, the
    baseline run folder and the candidate checkpoint (``run``'s model fingerprint), so that a rerun or a resume
    continues the same sample, while each candidate against one baseline is judged on a sample of its own (not
    every candidate on the same first images). ``universe`` (a superset of ``images``): the order is its order with
    the others left out, so that images left out later (a caption that failed for good) keep the committed prefix
    a prefix; a random order's restriction to a set chosen without looking at it is a random order of that set."""
    keep = set(images)
    seed = f"{run[1]}:{base['run_dir'].rstrip('/')}:{run[2]}"
    order = seeded_order(sorted(keep if universe is None else universe), seed)
    return [i for i in order if i in keep]


def baseline_verdict(
    cfg,
    base: dict,
    order: list[str],
    differences: Callable[[dict], dict[str, float]],
    score: Score,
    extra: Optional[dict] = None,
) -> PrefixVerdict:
    """The sequential verdict against ``base`` in ``order`` (``baseline_order``), with the run's alpha and margin."""
    return PrefixVerdict(
        order, differences, score, cfg.verdict_alpha, cfg.verdict_margin,
        against=base["model"], against_run=base["run_dir"], extra=extra,
    )  # fmt: skip
