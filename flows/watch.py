"""A run's deadline from its start. The sla-at-risk event once the deadline has passed before any caption (in
preflight, preprocess or while the engines start: the projection from the captioning rate needs captions), checked
every ``OVERDUE_EVERY_S``; from the first captions on, the inference stage projects (``tasks/inference.py``), and
either says it once a run.

What the deadline backstop watches (``deployments/deploy.ensure_automations``): a run whose deadline is a duration
says so when it starts, in an event on its own flow run (``captionflow.run.watched.<seconds>``, sent before the
run goes on). The backstop fires for a run that said so with the deployments' deadline and reached no final state
(Completed, Failed, Crashed, Cancelled, TimedOut: Prefect's own events, sent by the server) within it: a run that
is late, or whose process is gone (killed, lost with its node) and so never ends. A run that failed reached a final
state: its alert is the failure's alone. A run with no deadline (a CLI run), another duration or a wall-clock time
is not the backstop's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Optional

from captionflow.deadline import duration_s

WATCHED = "captionflow.run.watched"  # + "." + the deadline in whole seconds
FINAL_STATES = ("Completed", "Failed", "Crashed", "Cancelled", "TimedOut")

OVERDUE_EVERY_S = 5.0


def watched_event(deadline: Optional[str]) -> Optional[str]:
    """The event a run with ``deadline`` sends when it starts: ``captionflow.run.watched.28800`` for ``8h``; None
    for no deadline or a wall-clock time."""
    seconds = duration_s(deadline) if deadline else None
    return f"{WATCHED}.{int(round(seconds))}" if seconds else None


@contextlib.contextmanager
def watching(config) -> Iterator[None]:
    """Around the flow's body: a run whose deadline is a duration says it is watched, and a run with a deadline
    checks, until its body ends, whether the deadline passed before its captions could project anything."""
    from prefect import runtime

    deadline = config.deadline
    run_id = runtime.flow_run.id
    if not (deadline and run_id):
        yield
        return
    stop = _watch_overdue(config)
    event = watched_event(deadline)
    if event:
        from prefect.events import emit_event
        from prefect.events.worker import EventsWorker

        resource = {"prefect.resource.id": f"prefect.flow-run.{run_id}", "prefect.resource.name": runtime.flow_run.name}
        emit_event(event=event, resource=resource, payload={"deadline": deadline})
        EventsWorker.drain_all()  # out before the run goes on: a run killed later is still watched
    try:
        yield
    finally:
        stop.set()


def _watch_overdue(config) -> threading.Event:
    """A thread that emits the sla-at-risk event (``tasks.inference.emit_at_risk``, once a run) as soon as the
    deadline is more than its margin past, until the returned event is set."""
    import contextvars

    from prefect import runtime

    from captionflow.deadline import for_run
    from tasks.inference import emit_at_risk

    due = for_run(config.deadline, config.deadline_margin_s, runtime.flow_run.scheduled_start_time)
    stop = threading.Event()

    def check() -> None:
        while not stop.wait(OVERDUE_EVERY_S):
            slack = due.slack_s(0.0)
            if due.at_risk(slack):
                emit_at_risk(config, "", due, slack, 0.0, 0.0, None, stage="before its captions")
                return

    threading.Thread(target=contextvars.copy_context().run, args=(check,), name="captionflow-overdue",
                     daemon=True).start()  # fmt: skip
    return stop
