"""The optional reference-free score stage: CLIPScore per caption (cached per run, CLIP checkpoint and captions)."""

from __future__ import annotations

from prefect import task

from captionflow.config import RunConfig
from captionflow.data.fingerprint import digest
from captionflow.data.layout import CAPTIONS, SCORES, missing_rows
from captionflow.data.storage import Store
from captionflow.results import ClipResult, InferenceResult, Manifest, PreflightResult
from captionflow.stages.clip_score import clip_parts, run_clip
from tasks.policy import TIMEOUT_S, retry_transient
from tasks.results import record_stage, validated


def _key(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, checked: PreflightResult) -> str:
    return digest([list(clip_parts(tuple(inference.run_parts), checked.clip)), inference.captioned])


def _missing(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, checked: PreflightResult):
    store = Store(cfg.output)
    captions = store.ids(store.ls(*inference.run_parts, CAPTIONS, suffix=".parquet"))
    return missing_rows(store, clip_parts(tuple(inference.run_parts), checked.clip), SCORES, captions)


@task(
    name="clip-score",
    timeout_seconds=TIMEOUT_S["clip-score"],
    retries=1,
    retry_delay_seconds=[10],
    retry_condition_fn=retry_transient,
    cache_key_fn=validated("clip-score", _key, _missing),
    persist_result=True,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def clip_task(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, checked: PreflightResult) -> ClipResult:
    return run_clip(cfg, manifest, inference, checked.clip, checked.engine)
