"""A run's deadline: durations and times, from Prefect's start times, and what the run ended with."""

from __future__ import annotations


def test_a_deadline_from_a_pendulum_start_compares_with_plain_times():
    """Prefect gives the flow run's start as a pendulum DateTime: the deadline and its outcome are plain UTC."""
    from datetime import UTC, datetime

    import pendulum

    from captionflow.deadline import for_run

    start = pendulum.now("UTC").subtract(minutes=30)
    due = for_run("1h", 60, start)
    assert type(due.at) is datetime and due.at.tzinfo is not None
    out = due.outcome(datetime.now(UTC))
    assert out["met"] and 29 * 60 < out["spare_s"] <= 30 * 60 + 5 and "to spare" in out["line"]
    assert due.slack_s(eta_s=3600) < 0 and not for_run("1h", 0, None).at_risk(for_run("1h", 0, None).slack_s(60))
    assert for_run("2026-11-29T06:00:00", 0, start).at == datetime(2026, 11, 29, 6, tzinfo=UTC)
    assert for_run(None, 0, start) is None
