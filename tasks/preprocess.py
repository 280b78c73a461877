"""Stage 2, preprocess: decode, check and normalise the inputs into Parquet shards (cached per dataset)."""

from __future__ import annotations

from prefect import task

from captionflow.config import RunConfig
from captionflow.data.layout import missing_dataset
from captionflow.data.storage import Store
from captionflow.results import IngestResult, Manifest
from captionflow.stages.preprocess import preprocess
from tasks.policy import TIMEOUT_S, retry_transient
from tasks.results import record_stage, validated


def _key(ing: IngestResult, cfg: RunConfig) -> str:
    return ing.dataset_fingerprint


def _missing(ing: IngestResult, cfg: RunConfig):
    if cfg.force_preprocess:
        return "force_preprocess is set"
    return missing_dataset(Store(cfg.output), ing.dataset_fingerprint)


@task(
    name="preprocess",
    timeout_seconds=TIMEOUT_S["preprocess"],
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_transient,
    cache_key_fn=validated("preprocess", _key, _missing),
    persist_result=True,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def preprocess_task(ing: IngestResult, cfg: RunConfig) -> Manifest:
    return preprocess(ing, cfg)
