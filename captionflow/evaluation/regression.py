"""Is this checkpoint worse than the best comparable one? The regression alert's decision and its payload.

Comparable: the same dataset and the same generation settings (``report.update_leaderboard`` never compares
across them). The primary metric is CIDEr; a dataset without references has none, and gets no alert.
"""

from __future__ import annotations

from typing import Any, Optional

EVENT = "captionflow.checkpoint.regressed"
PRIMARY = "cider"
NOT_DELTAS = ("model", "run_dir", "significance")


# The paired bootstrap's verdicts (evaluation/significance.py) under which a drop is not a regression: the run's own
# statistics say the difference could be noise, so an alert on it would be a false alarm.
NOT_A_REGRESSION = ("no detectable difference", "better")


def regression(summary: dict[str, Any], threshold: float) -> Optional[dict[str, Any]]:
    """The alert's payload when the run's primary metric is below the best comparable run's by more than
    ``threshold`` (a fraction of the best) and the paired bootstrap against that run, where it was computed, does
    not call the difference noise; else None. A run its sequential verdict stopped early (``partial``) gets none:
    its metric is its prefix's, and the verdict is its answer."""
    metrics = summary.get("metrics") or {}
    if metrics.get("partial"):
        return None
    value = (metrics.get("reference") or {}).get(PRIMARY)
    best = ((metrics.get("comparison") or {}).get("best_so_far")) or {}
    delta = best.get(PRIMARY)
    if value is None or delta is None or delta >= 0:
        return None
    best_value = value - delta
    relative = -delta / abs(best_value) if best_value else float("inf")
    if relative <= threshold:
        return None
    verdict = ((best.get("significance") or {}).get(PRIMARY) or {}).get("verdict")
    if verdict in NOT_A_REGRESSION:
        return None
    previous = (metrics.get("comparison") or {}).get("previous") or {}
    return {
        "metric": PRIMARY,
        "value": value,
        "best_value": best_value,
        "delta": delta,
        "relative_drop": round(relative, 6),
        "threshold": threshold,
        "run_dir": summary.get("run_dir"),
        "best_model": best.get("model"),
        "best_run_dir": best.get("run_dir"),
        "deltas_vs_best": {k: v for k, v in best.items() if k not in NOT_DELTAS},
        "deltas_vs_previous": {k: v for k, v in previous.items() if k not in NOT_DELTAS} or None,
        # the paired bootstrap's verdict on the primary metric: "worse", or None where it was not computed
        "verdict_vs_best": verdict,
        "previous_model": previous.get("model"),
    }
