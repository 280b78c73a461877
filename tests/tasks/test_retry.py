"""What is worth a retry: transient faults, never bad input or captionflow's own verdicts."""

from __future__ import annotations

import pytest

from captionflow.errors import DatasetError, EngineFailed, ModelError, RowsFailed
from tasks.retry import retry_transient


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
