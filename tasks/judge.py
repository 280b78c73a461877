"""The optional LLM-as-judge stage (cached per run, judge checkpoint and captions)."""

from __future__ import annotations

from prefect import task

from captionflow.config import RunConfig
from captionflow.data.fingerprint import digest
from captionflow.data.layout import CAPTIONS, SCORES, missing_rows
from captionflow.data.storage import Store
from captionflow.results import InferenceResult, JudgeResult, Manifest, PreflightResult
from captionflow.stages.judge import judge_run_parts, run_judge
from tasks.policy import TIMEOUT_S, retry_transient
from tasks.results import record_stage, validated


def _parts(inference: InferenceResult, checked: PreflightResult) -> tuple[str, ...]:
    return judge_run_parts(tuple(inference.run_parts), checked.judge, checked.judge_engine)


def _key(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, checked: PreflightResult) -> str:
    return digest([list(_parts(inference, checked)), inference.captioned])


def _missing(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, checked: PreflightResult):
    store = Store(cfg.output)
    captions = store.ids(store.ls(*inference.run_parts, CAPTIONS, suffix=".parquet"))
    return missing_rows(store, _parts(inference, checked), SCORES, captions)


@task(
    name="judge",
    timeout_seconds=TIMEOUT_S["judge"],
    retries=1,
    retry_delay_seconds=[10],
    retry_condition_fn=retry_transient,
    cache_key_fn=validated("judge", _key, _missing),
    persist_result=True,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def judge_task(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, checked: PreflightResult) -> JudgeResult:
    return run_judge(cfg, manifest, inference, checked.judge, checked.judge_engine)
