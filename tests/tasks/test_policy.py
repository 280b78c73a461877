"""What is worth a retry: transient faults, never bad input or captionflow's own verdicts."""

from __future__ import annotations

import pytest

from captionflow.errors import DatasetError, EngineFailed, ModelError, RowsFailed
from tasks.policy import retry_transient


class _State:
    def __init__(self, exc: BaseException | None):
        self.exc = exc

    def result(self):
        if self.exc:
            raise self.exc
        return 1


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionError("reset"),
        TimeoutError("slow"),
        OSError(5, "I/O error"),
        RuntimeError("engine died"),
        EngineFailed("inference: RuntimeError: CUDA error: an illegal memory access"),
    ],
)
def test_transient_faults_are_retried(exc):
    assert retry_transient(None, None, _State(exc)) is True


@pytest.mark.parametrize(
    "exc",
    [
        DatasetError("no such folder"),
        ModelError("no config.json"),
        RowsFailed("2 rows failed", None),
        ValueError("bad"),
        KeyError("k"),
        FileNotFoundError("gone"),
        PermissionError("denied"),
        AssertionError("broken"),
        OSError(28, "No space left on device"),
        OSError(30, "Read-only file system"),
    ],
)
def test_permanent_faults_are_not(exc):
    assert retry_transient(None, None, _State(exc)) is False


def test_every_stage_task_has_its_timeout():
    import importlib
    import pkgutil

    from prefect import Task

    import tasks
    from tasks.policy import TIMEOUT_S

    found = {}
    for mod in pkgutil.iter_modules(tasks.__path__):
        module = importlib.import_module(f"tasks.{mod.name}")
        found.update({t.name: t.timeout_seconds for t in vars(module).values() if isinstance(t, Task)})
    assert found == TIMEOUT_S  # every task named in the table, each with its limit


def test_an_attempt_that_times_out_fails_as_timed_out_and_is_not_retried(prefect_api):
    import time

    from prefect import flow, task

    attempts = []

    @task(timeout_seconds=1, retries=2, retry_delay_seconds=0, retry_condition_fn=retry_transient)
    def hangs():
        attempts.append(1)
        time.sleep(30)

    states = []

    @flow
    def runs_it():
        states.append(hangs(return_state=True))

    t0 = time.monotonic()
    runs_it()
    assert states[0].name == "TimedOut" and len(attempts) == 1
    assert time.monotonic() - t0 < 20
