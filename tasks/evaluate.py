"""Stage 4, evaluate: metrics, per-image scores, the report and the leaderboard row (published by tasks/publish.py)."""

from __future__ import annotations

from typing import Optional

from prefect import task
from prefect.runtime import flow_run

from captionflow.config import RunConfig
from captionflow.data.fingerprint import digest
from captionflow.data.layout import missing_files
from captionflow.data.storage import Store
from captionflow.deadline import for_run
from captionflow.evaluation.evaluate import evaluate
from captionflow.results import ClipResult, EvalResult, InferenceResult, JudgeResult, Manifest, PairwiseResult
from tasks.policy import TIMEOUT_S, retry_transient
from tasks.results import record_stage, validated


def _key(
    cfg: RunConfig,
    manifest: Manifest,
    inference: InferenceResult,
    judge: Optional[JudgeResult],
    pairwise: Optional[PairwiseResult] = None,
    clip: Optional[ClipResult] = None,
) -> str:
    return digest(
        [
            list(inference.run_parts),
            inference.captioned,
            inference.failed,
            inference.verdict,  # a sequential verdict's record (its baseline or score may change on a rerun)
            judge and [judge.judged, judge.verdict],
            pairwise and [pairwise.pairwise_dir, pairwise.judged, pairwise.verdict],
            clip and [clip.clip_dir, clip.scored],
            cfg.coco_java,
            cfg.bootstrap_resamples,
            cfg.report_images,
        ]
    )


def _missing(cfg: RunConfig, manifest: Manifest, inference: InferenceResult, judge, pairwise=None, clip=None):
    return missing_files(
        Store(cfg.output), tuple(inference.run_parts), ("scores.parquet", "metrics.json", "report.md", "report.html")
    )


@task(
    name="evaluate",
    timeout_seconds=TIMEOUT_S["evaluate"],
    retries=2,
    retry_delay_seconds=[2, 10],
    retry_condition_fn=retry_transient,
    cache_key_fn=validated("evaluate", _key, _missing),
    persist_result=True,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def evaluate_task(
    cfg: RunConfig,
    manifest: Manifest,
    inference: InferenceResult,
    judge: Optional[JudgeResult],
    pairwise: Optional[PairwiseResult] = None,
    clip: Optional[ClipResult] = None,
) -> EvalResult:
    due = for_run(cfg.deadline, cfg.deadline_margin_s, flow_run.scheduled_start_time)
    return evaluate(
        cfg.output,
        manifest,
        inference,
        cfg.model,
        judge,
        cfg.coco_java,
        cfg.bootstrap_resamples,
        prompts=(cfg.prompt, cfg.system_prompt),
        report_images=cfg.report_images,
        pairwise=pairwise,
        clip=clip,
        deadline=due.outcome() if due else None,  # met or missed when the verdict is in (the leaderboard row)
    )
