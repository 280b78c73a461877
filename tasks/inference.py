"""Stage 3, inference: caption every accepted row (cached per dataset, checkpoint and generation settings)."""

from __future__ import annotations

import time

from prefect import task

from captionflow.config import RunConfig
from captionflow.layout import CAPTIONS, missing_rows, shard_paths
from captionflow.pipeline.inference import caption_run_parts, run_inference
from captionflow.results import InferenceResult, Manifest, PreflightResult
from captionflow.storage import Store
from tasks.policy import TIMEOUT_S, retry_transient
from tasks.results import record_stage, validated


def _key(cfg: RunConfig, manifest: Manifest, checked: PreflightResult) -> str:
    return "-".join(caption_run_parts(cfg, manifest, checked.model, checked.engine)[1:])


def _missing(cfg: RunConfig, manifest: Manifest, checked: PreflightResult):
    """Rows without a committed caption: a cached result whose captions are incomplete (rows that failed
    every pass, a deleted run folder) is not reused, so the next run captions what is missing."""
    store = Store(cfg.output)
    run = caption_run_parts(cfg, manifest, checked.model, checked.engine)
    return missing_rows(store, run, CAPTIONS, store.ids(shard_paths(store, manifest)))


class ProgressArtifact:
    """The ``inference-progress`` Prefect artifact: rows captioned / total, the captioning rate and an ETA
    from that rate (engine start-up is not in it)."""

    def __init__(self, total: int, done: int):
        from prefect.artifacts import create_progress_artifact

        self.id = create_progress_artifact(
            progress=100.0 * done / max(total, 1), key="inference-progress", description=f"captioned {done}/{total}"
        )
        self.last = 0.0

    def __call__(self, done: int, total: int, rate: float) -> None:
        from prefect.artifacts import update_progress_artifact

        now = time.monotonic()
        if done < total and now - self.last < 1.0:  # at most one API call a second
            return
        self.last = now
        eta = (total - done) / rate if rate > 0 else float("inf")
        update_progress_artifact(
            artifact_id=self.id,
            progress=100.0 * done / max(total, 1),
            description=f"captioned {done}/{total}, {rate:.2f} rows/s, ETA {eta:.0f} s",
        )


@task(
    name="inference",
    timeout_seconds=TIMEOUT_S["inference"],
    retries=1,
    retry_delay_seconds=[10],
    retry_condition_fn=retry_transient,
    cache_key_fn=validated("inference", _key, _missing),
    persist_result=True,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def inference_task(cfg: RunConfig, manifest: Manifest, checked: PreflightResult) -> InferenceResult:
    """Rows that still fail after every pass are counted (the next run's cache check sees them missing and
    tries them again); more than ``max_failure_rate`` of them fails the task and the run."""
    store = Store(cfg.output)
    total = manifest.counts.accepted
    run = caption_run_parts(cfg, manifest, checked.model, checked.engine)
    done = len(store.ids(store.ls(*run, CAPTIONS, suffix=".parquet")))
    return run_inference(cfg, manifest, checked.model, checked.engine, ProgressArtifact(total, min(done, total)))
