"""Captions produced elsewhere, written as a run of their own on the dataset (``captionflow evaluate``)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from captionflow.config import RunConfig
from captionflow.evaluation.external import import_captions
from captionflow.results import InferenceResult, Manifest
from tasks.policy import TIMEOUT_S
from tasks.results import record_stage


@task(
    name="import-captions",
    timeout_seconds=TIMEOUT_S["import-captions"],
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def import_captions_task(cfg: RunConfig, manifest: Manifest, captions: str) -> InferenceResult:
    result, unmatched = import_captions(cfg.output, manifest, captions)
    log = get_run_logger()
    log.info("%d captions of %s match images of the dataset: %s", result.captioned, captions, result.run_dir)
    if unmatched:
        log.warning(
            "%d rows of %s name no image of the dataset (not evaluated), e.g. %s",
            len(unmatched),
            captions,
            ", ".join(unmatched[:3]),
        )
    if result.failed:
        log.warning("%d images of the dataset have no caption in %s (counted as failed)", result.failed, captions)
    return result
