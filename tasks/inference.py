"""Stage 3, inference: caption every accepted row (cached per dataset, checkpoint and generation settings)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import threading
import time
from typing import Optional

from prefect import task
from prefect.logging import get_run_logger
from prefect.runtime import flow_run

from captionflow.config import RunConfig
from captionflow.data.fingerprint import digest
from captionflow.data.layout import CAPTIONS, missing_rows, shard_paths
from captionflow.data.storage import Store
from captionflow.deadline import EVENT as DEADLINE_EVENT
from captionflow.deadline import for_run, human
from captionflow.results import InferenceResult, Manifest, PreflightResult
from captionflow.stages.inference import caption_run_parts, run_inference
from tasks.policy import TIMEOUT_S, retry_transient
from tasks.results import record_stage, validated

log = logging.getLogger("captionflow.inference")


def _key(cfg: RunConfig, manifest: Manifest, checked: PreflightResult) -> Optional[str]:
    """None for a sequential verdict: its baseline ('previous', 'best') moves as runs land, and a run whose
    captions are all committed decides from them without captioning (no engines start)."""
    if cfg.verdict == "sequential":
        return None
    return "-".join(caption_run_parts(cfg, manifest, checked.model, checked.engine)[1:])


def _missing(cfg: RunConfig, manifest: Manifest, checked: PreflightResult):
    """Rows without a committed caption: a cached result whose captions are incomplete (rows that failed
    every pass, a deleted run folder) is not reused, so the next run captions what is missing."""
    store = Store(cfg.output)
    run = caption_run_parts(cfg, manifest, checked.model, checked.engine)
    return missing_rows(store, run, CAPTIONS, store.ids(shard_paths(store, manifest)))


ENDED = "attempt ended"  # how an attempt's artifact starts once it is over without finishing


class ProgressArtifact:
    """The caption run folder's progress artifact (key ``inference-progress-<digest of the folder's URI>``, the
    output root included, so that its versions are the attempts on that folder and no other): rows captioned /
    total as engine batches arrive, how many are committed, the captioning rate and an ETA from that rate (engine
    start-up is not in it); one log line every ``log_every_s``. An attempt that fails says so on its artifact; one
    that died without a word (SIGKILL, a lost node) is marked by the next attempt, once that holds the folder's
    lease (so never while it lives).

    The API calls run on a thread of their own, in the task's context, with the newest progress at most once a
    second: the stage never waits for them (the first one, which also reads the folder's earlier attempts, came
    before the run's first request). ``close`` waits for the last one; ``failed`` ends the attempt's artifact."""

    def __init__(self, folder: str, log_every_s: float = 30.0, deadline=None, at_risk=None):
        self.key = f"inference-progress-{digest(folder, 12)}"
        # the run's Deadline (deadline.py) and what to call, once, when the projection is late by more
        # than its margin: at_risk(slack_s, eta_s, rate, remaining rows)
        self.deadline, self._at_risk, self.at_risk_sent = deadline, at_risk, False
        self.id = None
        self.last_log = 0.0
        self.log_every_s = log_every_s
        self.state = (0, 0, 1)
        self._context = contextvars.copy_context()  # the task run's: the artifact and log lines are its own
        self._wanted: Optional[tuple[int, int, int, float]] = None
        self._first: Optional[tuple[int, int, int, float]] = None  # the rows done before this attempt
        self._changed = threading.Condition()
        self._closing = False
        self._sender: Optional[threading.Thread] = None

    def __call__(self, seen: int, committed: int, total: int, rate: float) -> None:
        with self._changed:
            self.state = (seen, committed, total)
            self._wanted = (seen, committed, total, rate)
            if self._first is None:
                self._first = self._wanted
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._context.run, args=(self._send_loop,), name="captionflow-progress", daemon=True
                )
                self._sender.start()
            self._changed.notify()

    def _send_loop(self) -> None:
        last = 0.0
        while True:
            with self._changed:
                # at most one update a second; the last (all rows in) and the one on closing go at once
                while not self._closing and (
                    self._wanted is None
                    or (self.id is not None and self._wanted[0] < self._wanted[2] and time.monotonic() - last < 1.0)
                ):
                    self._changed.wait(None if self._wanted is None else max(0.0, 1.0 - (time.monotonic() - last)))
                wanted, self._wanted = self._wanted, None
            if wanted is None:
                return  # closing, nothing left to send
            last = time.monotonic()
            try:
                self._send(*wanted)
            except Exception as e:  # the progress display is not the stage's result
                log.warning("inference progress artifact: %s: %s", type(e).__name__, str(e)[:300])

    def _send(self, seen: int, committed: int, total: int, rate: float) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        if self.id is None:
            before, _, of, _ = self._first
            self._end_unfinished(before)
            self.id = create_progress_artifact(
                progress=100.0 * before / max(of, 1),
                key=self.key,
                description=f"captioned {before}/{of} (committed before this attempt)",
            )
            if (seen, committed, total, rate) == self._first:
                return
        pct = 100.0 * seen / max(total, 1)
        eta = (total - seen) / rate if rate > 0 else float("inf")
        line = f"captioned {seen}/{total} ({committed} committed), {rate:.2f} rows/s, ETA {eta:.0f} s"
        late = False
        if self.deadline is not None and rate > 0 and seen < total:
            slack = self.deadline.slack_s(eta)
            line += f"; deadline {self.deadline.at:%Y-%m-%d %H:%M:%S} UTC: {self.deadline.line(slack)}"
            if self.deadline.at_risk(slack) and not self.at_risk_sent and self._at_risk is not None:
                self.at_risk_sent = True
                late = self._at_risk(slack, eta, rate, total - seen)
        update_progress_artifact(artifact_id=self.id, progress=pct, description=line)
        now = time.monotonic()
        if late:
            get_run_logger().warning("inference: %s: event %s", line, DEADLINE_EVENT)
        elif now - self.last_log >= self.log_every_s or seen >= total:
            self.last_log = now
            get_run_logger().info("inference: %s", line)

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is left and stop the thread."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        if self._sender is not None:
            self._sender.join(timeout_s)

    def __enter__(self) -> ProgressArtifact:
        return self

    def __exit__(self, kind, e, tb) -> None:
        """The attempt's end: what is left sent, or (an error) its artifact says where and why."""
        if e is None:
            self.close()
        else:
            self.failed(e)

    def failed(self, e: BaseException) -> None:
        """This attempt ends with ``e``: its artifact says where and why."""
        from prefect.artifacts import update_progress_artifact

        self.close()
        if self.id is None:
            return
        seen, committed, total = self.state
        with contextlib.suppress(Exception):  # the task's own error is the one to report
            update_progress_artifact(
                artifact_id=self.id,
                progress=100.0 * seen / max(total, 1),
                description=f"{ENDED} at {seen}/{total} ({committed} committed, kept): "
                f"{type(e).__name__}: {str(e)[:300]}",
            )

    def _end_unfinished(self, committed: int) -> None:
        from prefect.artifacts import update_progress_artifact
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        with get_client(sync_client=True) as client:
            earlier = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[self.key])))
        for a in earlier:
            if float(a.data) < 100 and not (a.description or "").startswith(ENDED):
                update_progress_artifact(
                    artifact_id=a.id,
                    progress=float(a.data),
                    description=f"{ENDED} without finishing (the process died or lost its lease): "
                    f"{a.description}; a later attempt resumed from {committed} committed rows",
                )


_AT_RISK_SENT: set[str] = set()  # the flow runs (of this process) whose sla-at-risk event is out: once a run


def emit_at_risk(
    cfg: RunConfig, run_dir: str, deadline, slack_s: float, eta_s: float, rate: float, left: Optional[int],
    stage: str = "inference",
) -> bool:  # fmt: skip
    """The Prefect event ``captionflow.run.sla-at-risk`` of this flow run, once a run (False: it was out already):
    the projection and the rate, or (``stage`` before the captions: no rate yet) how late it is already."""
    from prefect.events import emit_event

    run_id = str(flow_run.id or "local")
    if run_id in _AT_RISK_SENT:
        return False
    _AT_RISK_SENT.add(run_id)
    emit_event(
        event=DEADLINE_EVENT,
        resource={
            "prefect.resource.id": f"captionflow.run.{run_id}",
            "prefect.resource.name": flow_run.name or cfg.model,
        },
        payload={
            "model": cfg.model,
            "run_dir": run_dir,
            "stage": stage,
            "deadline": deadline.at.isoformat(),
            "projected_late_s": round(-slack_s, 1),
            "projected_late": human(slack_s),
            "eta_s": round(eta_s, 1),
            "rows_per_s": round(rate, 3),
            "rows_left": left,
        },
    )
    return True


def release_early_hold(task, task_run, state) -> None:
    """A hold on the warm engines that preflight took for this run and this stage did not use (its result was
    cached, or it failed before) goes back now, not when it lapses."""
    from captionflow.data.lease import _default_owner
    from captionflow.service import hold as service

    service.end_early(_default_owner())


@task(
    name="inference",
    timeout_seconds=TIMEOUT_S["inference"],
    retries=1,
    retry_delay_seconds=[10],
    retry_condition_fn=retry_transient,
    cache_key_fn=validated("inference", _key, _missing),
    persist_result=True,
    on_completion=[record_stage, release_early_hold],
    on_failure=[record_stage, release_early_hold],
)
def inference_task(cfg: RunConfig, manifest: Manifest, checked: PreflightResult) -> InferenceResult:
    """Rows that still fail after every pass are counted (the next run's cache check sees them missing and
    tries them again); more than ``max_failure_rate`` of them fails the task and the run."""
    run = caption_run_parts(cfg, manifest, checked.model, checked.engine)
    store = Store(cfg.output)
    deadline = for_run(cfg.deadline, cfg.deadline_margin_s, flow_run.scheduled_start_time)
    at_risk = functools.partial(emit_at_risk, cfg, store.url(*run), deadline) if deadline else None
    with ProgressArtifact(store.path(*run), deadline=deadline, at_risk=at_risk) as progress:
        return run_inference(
            cfg, manifest, checked.model, checked.engine, progress, checked.clip, checked.judge, checked.judge_engine
        )
