"""A run's deadline: when it is due, the projection against it while it captions, and what it ended with.

``deadline`` is a duration from the run's start (``8h``, ``90m``, ``1h30m``, ``45s``, ``2d``) or a wall-clock time
(ISO 8601, ``2026-11-29T06:00:00+00:00``; without a zone: UTC). During inference the projected completion is the
progress artifact's ETA (captioning only, from the live rate); the first time it is later than the deadline by more
than ``deadline_margin_s``, the run emits ``captionflow.run.sla-at-risk`` once (``captionflow deploy
--notify-block`` turns it into a notification). The summary says whether the run met its deadline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Optional

EVENT = "captionflow.run.sla-at-risk"
_DURATION = re.compile(
    r"^\s*(?:(\d+(?:\.\d+)?)\s*d)?\s*(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+(?:\.\d+)?)\s*m)?\s*"
    r"(?:(\d+(?:\.\d+)?)\s*s)?\s*$"
)


def duration_s(text: str) -> Optional[float]:
    """Seconds of a duration such as ``8h``, ``1h30m``, ``90m``, ``45s``, ``2d`` (None: not a duration)."""
    m = _DURATION.match(text.lower())
    if not m or not any(m.groups()):
        return None
    d, h, mi, s = (float(x) if x else 0.0 for x in m.groups())
    return d * 86400 + h * 3600 + mi * 60 + s


def parse(text: str, start: datetime) -> datetime:
    """The deadline's time (UTC) for a run that started at ``start``; ValueError with what is accepted."""
    seconds = duration_s(text)
    if seconds is not None:
        if seconds <= 0:
            raise ValueError(f"deadline {text!r}: a duration must be more than 0")
        return _utc(start) + timedelta(seconds=seconds)
    try:
        return _utc(datetime.fromisoformat(text.strip()))
    except ValueError:
        raise ValueError(
            f"deadline {text!r}: neither a duration (8h, 90m, 1h30m, 45s, 2d) nor a time (2026-11-29T06:00:00+00:00)"
        ) from None


def _utc(t: datetime) -> datetime:
    """``t`` as a plain datetime in UTC (no zone: UTC); Prefect's start times come as pendulum DateTimes, whose
    arithmetic with a plain datetime refused to mix them."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return datetime.fromtimestamp(t.timestamp(), UTC)


def human(seconds: float) -> str:
    """``2 h 10 min``, ``3 min 05 s``, ``42 s``."""
    s = int(round(abs(seconds)))
    if s >= 3600:
        return f"{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 60:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s} s"


@dataclass(frozen=True)
class Deadline:
    at: datetime  # UTC
    margin_s: float = 60.0

    def slack_s(self, eta_s: float, now: Optional[datetime] = None) -> float:
        """Seconds between the projected completion (``now`` + ``eta_s``) and the deadline: > 0 to spare, < 0 late."""
        return (self.at - (now or datetime.now(UTC))).total_seconds() - eta_s

    def at_risk(self, slack_s: float) -> bool:
        return slack_s < -self.margin_s

    @staticmethod
    def line(slack_s: float) -> str:
        return f"on track, {human(slack_s)} to spare" if slack_s >= 0 else f"projected {human(slack_s)} late"

    def outcome(self, finished: Optional[datetime] = None) -> dict:
        """What the run ended with: the deadline, when it finished, the seconds to spare (< 0: late), met or not."""
        end = _utc(finished or datetime.now(UTC))
        spare = (self.at - end).total_seconds()
        return {
            "deadline": self.at.isoformat(),
            "finished_at": end.isoformat(),
            "spare_s": round(spare, 1),
            "met": spare >= 0,
            "line": f"met with {human(spare)} to spare" if spare >= 0 else f"MISSED by {human(spare)}",
        }


def for_run(deadline: Optional[str], margin_s: float, start: Optional[datetime]) -> Optional[Deadline]:
    """The run's Deadline (None without one); ``start``: the flow run's start (None: now)."""
    if not deadline:
        return None
    return Deadline(parse(deadline, start or datetime.now(UTC)), margin_s)
