"""Stage 1, ingest: list the dataset (never cached: the listing is what notices a changed dataset)."""

from __future__ import annotations

from prefect import task

from captionflow.config import RunConfig
from captionflow.data.sources import ingest
from captionflow.results import IngestResult
from tasks.policy import TIMEOUT_S, retry_transient
from tasks.results import record_stage


@task(
    name="ingest",
    persist_result=False,  # never cached: a run's listing is not kept (for millions of files, it is large)
    timeout_seconds=TIMEOUT_S["ingest"],
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_transient,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def ingest_task(cfg: RunConfig) -> IngestResult:
    return ingest(cfg)
