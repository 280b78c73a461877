"""The optional pairwise judge stage: this run's captions against a baseline run's, in both orders.

Not cached by Prefect: its baseline ("previous", "best") is resolved from the leaderboard when it runs. A
rerun still judges nothing twice - every judgement is committed under a fingerprint of the judge, its prompt
and the baseline run folder (captionflow/stages/pairwise.py) - and starts no engine when none is missing.
"""

from __future__ import annotations

from prefect import task

from captionflow.config import RunConfig
from captionflow.results import InferenceResult, Manifest, PairwiseResult, PreflightResult
from captionflow.stages.pairwise import run_pairwise
from tasks.policy import TIMEOUT_S, retry_transient
from tasks.results import record_stage


@task(
    name="pairwise",
    timeout_seconds=TIMEOUT_S["pairwise"],
    retries=1,
    retry_delay_seconds=[10],
    retry_condition_fn=retry_transient,
    on_completion=[record_stage],
    on_failure=[record_stage],
)
def pairwise_task(
    cfg: RunConfig, manifest: Manifest, inference: InferenceResult, checked: PreflightResult
) -> PairwiseResult:
    return run_pairwise(cfg, manifest, inference, checked.judge, checked.judge_engine)
