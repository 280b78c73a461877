"""The optional LLM-as-judge stage (cached per run, judge checkpoint and captions)."""

from __future__ import annotations

from prefect import task

from captionflow.config import RunConfig
from captionflow.fingerprint import digest
from captionflow.layout import CAPTIONS, SCORES, missing_rows
from captionflow.model_source import ResolvedModel
from captionflow.pipeline.judge import judge_run_parts, run_judge
from captionflow.results import InferenceResult, JudgeResult, Manifest
from captionflow.storage import Store
from tasks.results import record_stage, validated
from tasks.retry import retry_transient


def _key(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, judge: ResolvedModel) -> str:
    return digest([list(judge_run_parts(tuple(inference.run_parts), judge)), inference.captioned])


def _missing(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, judge: ResolvedModel):
    store = Store(cfg.output)
    run = tuple(inference.run_parts)
    return missing_rows(
        store, judge_run_parts(run, judge), SCORES, store.ids(store.ls(*run, CAPTIONS, suffix=".parquet"))
    )


@task(
    name="judge",
    retries=1,
    retry_delay_seconds=[10],
    retry_condition_fn=retry_transient,
    cache_key_fn=validated("judge", _key, _missing),
    persist_result=True,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def judge_task(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, judge: ResolvedModel) -> JudgeResult:
    return run_judge(cfg, manifest, inference, judge)
