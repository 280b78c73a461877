"""Preflight: every check that can fail cheaply, before Ray, a decoder or an engine starts."""

from __future__ import annotations

from prefect import task

from captionflow.config import RunConfig
from captionflow.preflight import PreflightResult, preflight
from tasks.policy import TIMEOUT_S, retry_transient


@task(
    name="preflight",
    persist_result=False,  # never cached
    timeout_seconds=TIMEOUT_S["preflight"],
    retries=1,
    retry_delay_seconds=[5],
    retry_condition_fn=retry_transient,
)
def preflight_task(cfg: RunConfig) -> PreflightResult:
    return preflight(cfg)
