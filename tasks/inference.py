"""Stage 3, inference: caption every accepted row (cached per dataset, model and generation settings)."""

from __future__ import annotations

import time

from prefect import get_run_logger, task

from captionflow.config import RunConfig
from captionflow.errors import RowsFailed
from captionflow.layout import CAPTIONS, missing_rows, shard_paths
from captionflow.model_source import ResolvedModel
from captionflow.pipeline.inference import caption_run_parts, run_inference
from captionflow.results import InferenceResult, Manifest
from captionflow.storage import Store
from tasks.results import record_stage, validated
from tasks.retry import retry_transient


def _key(cfg: RunConfig, manifest: Manifest, model: ResolvedModel) -> str:
    return "-".join(caption_run_parts(cfg, manifest, model)[1:])


def _missing(cfg: RunConfig, manifest: Manifest, model: ResolvedModel):
    """Rows without a committed caption: a cached result whose captions are incomplete (rows that failed
    every pass, a deleted run folder) is not reused, so the next run captions what is missing."""
    store = Store(cfg.output)
    return missing_rows(
        store, caption_run_parts(cfg, manifest, model), CAPTIONS, store.ids(shard_paths(store, manifest))
    )


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
    retries=1,
    retry_delay_seconds=[10],
    retry_condition_fn=retry_transient,
    cache_key_fn=validated("inference", _key, _missing),
    persist_result=True,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def inference_task(cfg: RunConfig, manifest: Manifest, model: ResolvedModel) -> InferenceResult:
    """Rows that still fail after every pass are counted, not fatal: the flow evaluates what was captioned,
    and the next run (its cache check sees the missing rows) tries them again."""
    store = Store(cfg.output)
    total = manifest.counts.accepted
    done = len(store.ids(store.ls(*caption_run_parts(cfg, manifest, model), CAPTIONS, suffix=".parquet")))
    try:
        return run_inference(cfg, manifest, model, progress=ProgressArtifact(total, min(done, total)))
    except RowsFailed as e:
        get_run_logger().warning("%s", e)
        return e.result
