"""The inference stage's progress artifact, with a real Prefect API (the session's test harness): its API calls run
on a thread of their own in the task's context; what the UI ends up showing is the attempt's last progress, or why
the attempt ended."""

from __future__ import annotations

import contextlib
import threading

from prefect import flow, task

from tasks.inference import ENDED, ProgressArtifact

SENT_FROM: list[str] = []


class _Recorded(ProgressArtifact):
    def _send(self, *progress) -> None:
        SENT_FROM.append(threading.current_thread().name)
        super()._send(*progress)


@task
def _caption(folder: str, fail: bool) -> tuple[str, str]:
    progress = _Recorded(folder)
    with contextlib.suppress(RuntimeError), progress:  # the attempt's end: closed, or failed with its error
        progress(0, 0, 10, 0.0)
        for seen in range(1, 8):
            progress(seen, seen, 10, 5.0)
        if fail:
            raise RuntimeError("the engine went away")
        progress(10, 10, 10, 5.0)
    return progress.key, str(progress.id)


@flow
def _run(folder: str, fail: bool) -> tuple[str, str]:
    return _caption(folder, fail)


def _artifact(artifact_id: str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterId

    with get_client(sync_client=True) as client:
        (found,) = client.read_artifacts(artifact_filter=ArtifactFilter(id=ArtifactFilterId(any_=[artifact_id])))
        return found


def test_progress_reaches_the_api_from_its_own_thread(prefect_api, tmp_path):
    SENT_FROM.clear()
    key, artifact_id = _run(str(tmp_path / "run-a"), fail=False)
    assert key.startswith("inference-progress-")
    done = _artifact(artifact_id)
    assert float(done.data) == 100
    assert done.description.startswith("captioned 10/10 (10 committed)")
    assert done.task_run_id is not None  # created in the task's context, though not on its thread
    assert SENT_FROM and set(SENT_FROM) == {"captionflow-progress"}
    # the newest progress, not every call: the first (creation), then what had come in meanwhile, and the last
    assert len(SENT_FROM) < 9


def test_a_failed_attempt_says_where_and_why(prefect_api, tmp_path):
    _, artifact_id = _run(str(tmp_path / "run-b"), fail=True)
    ended = _artifact(artifact_id)
    assert ended.description.startswith(f"{ENDED} at 7/10 (7 committed, kept)")
    assert "RuntimeError: the engine went away" in ended.description
    assert float(ended.data) == 70
