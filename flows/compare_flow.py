"""Evaluate a list of checkpoints on one dataset and return the leaderboard.

``parallel`` 1 (the default): the caption flow for each checkpoint in training order; on one GPU host each run
uses the GPUs in turn, and the other runs hit the first one's preprocess cache.

``parallel`` K > 1: the dataset is listed and preprocessed once, here; then the checkpoints are evaluated K at a
time through prefect-ray's ``RayTaskRunner``, each a caption flow inside one Ray task, the cluster's GPUs split
between them (``captionflow/runs/fanout.py``). Each evaluation has its task, its flow run, its stages' task
runs and artifacts in Prefect, and its own leaderboard row (row files: overlapping writers lose nothing). The Ray
workers reach the Prefect API through the task's runtime environment (prefect-ray's open issue: they do not
inherit ``PREFECT_API_URL``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

from prefect import flow, get_run_logger, task
from prefect.futures import wait
from prefect.utilities.annotations import opaque
from prefect_ray import RayTaskRunner
from prefect_ray.context import remote_options
from pydantic import Field

from captionflow.config import RunConfig
from captionflow.data.storage import Store
from captionflow.model_source import resolve_model
from captionflow.report.markdown import read_leaderboard
from captionflow.runs.fanout import EVALUATION_TASK_CPUS
from captionflow.stages.shared_pass import shareable
from flows.caption_flow import caption_flow
from flows.parameters import flow_parameters, with_config_parameters
from tasks.ingest import ingest_task
from tasks.preflight import preflight_task
from tasks.preprocess import preprocess_task
from tasks.results import stage_results
from tasks.shared_pass import shared_pass_task

MODELS = inspect.Parameter("models", inspect.Parameter.KEYWORD_ONLY, default=("builtin",), annotation=tuple[str, ...])
PARALLEL = inspect.Parameter(
    "parallel",
    inspect.Parameter.KEYWORD_ONLY,
    default=Field(
        1,
        ge=1,
        description="Checkpoints evaluated at once through prefect-ray's RayTaskRunner, the Ray cluster's GPUs "
        "split between them (at most one per GPU); 1: one after another.",
    ),
    annotation=int,
)


@flow(name="captionflow-compare")
@with_config_parameters(MODELS, PARALLEL)
def compare_checkpoints(config: RunConfig, models: tuple[str, ...] = ("builtin",), parallel: int = 1) -> dict:
    """Run the caption flow for each checkpoint (training order; ``parallel`` at a time through Ray) and return
    their leaderboard rows."""
    # every checkpoint checked before any run starts
    resolved = [resolve_model(m, dummy_weights=config.dummy_weights()) for m in models]
    configs = [config.model_copy(update={"model": m}) for m in models]
    shared = None
    if config.verdict == "full" and shareable(resolved) is None:
        # adapters of one base: captioned in one pass first, each run then scores its own captions
        shared = _shared_pass(config, configs[0], resolved)
    if parallel > 1 and len(models) > 1 and not shared:
        runs = _in_parallel(config, configs, resolved, parallel)
    else:
        runs = [caption_flow(**flow_parameters(c)) for c in configs]
    store = Store(config.output)
    board = read_leaderboard(store)
    wanted = {r["run_dir"] for r in runs}
    order = [r["run_dir"] for r in runs]
    rows = sorted((r for r in board if r["run_dir"] in wanted), key=lambda r: order.index(r["run_dir"]))
    return {"runs": runs, "leaderboard": rows, "models": [m.fingerprint for m in resolved], "shared_pass": shared}


def _shared_pass(config: RunConfig, first: RunConfig, resolved) -> Optional[dict]:
    """The checkpoints' captions, all in one pass (``stages/shared_pass.py``), after the first one's preflight
    (every check but the model's: each run's own preflight checks it again); what the pass did (None: no shared
    pass, a warm engine service runs)."""
    # warm_engines off: no hold on a warm service taken at preflight, which no inference stage here would take over
    preflight_task(first.model_copy(update={"warm_engines": "off"}))
    with stage_results(config.output):  # once: every run finds it done (Cached)
        manifest = preprocess_task(opaque(ingest_task(config)), config)
    results = shared_pass_task(config, manifest, resolved)
    if results is None:
        return None
    get_run_logger().info(
        "captioned %d checkpoints of one base in one pass: %s", len(results),
        ", ".join(f"{m.source} {r.captioned}/{r.accepted}" for m, r in zip(resolved, results)),
    )  # fmt: skip
    return {
        "checkpoints": [m.source for m in resolved],
        "captioned": [r.captioned for r in results],
        "resumed_from": [r.resumed_from for r in results],
        "passes": [dataclasses.asdict(p) for p in results[0].passes],
        "seconds": results[0].timings_s.get("inference_s"),
    }


@task(name="evaluate-checkpoint")
def evaluate_checkpoint(config: RunConfig) -> dict:
    """One checkpoint's caption flow, in the Ray worker this task runs in (its pipeline joins that worker's Ray)."""
    return caption_flow(**flow_parameters(config))


@flow(name="captionflow-compare-parallel")
def evaluate_in_parallel(configs: list[RunConfig], slots: int, env: dict[str, str]) -> list[dict]:
    """``configs`` evaluated ``slots`` at a time, each in a Ray task spread over the cluster's nodes."""
    runs: list[dict] = []
    with remote_options(
        num_cpus=EVALUATION_TASK_CPUS, scheduling_strategy="SPREAD", runtime_env={"env_vars": env}, max_retries=0
    ):
        for start in range(0, len(configs), slots):
            futures = [evaluate_checkpoint.submit(c) for c in configs[start : start + slots]]
            wait(futures)  # the whole wave ends before one failure ends the flow
            runs += [f.result() for f in futures]
    return runs


def _in_parallel(config: RunConfig, configs: list[RunConfig], resolved, parallel: int) -> list[dict]:
    from captionflow.engines.engine import resolve_engine
    from captionflow.engines.session import ray_session
    from captionflow.runs.fanout import fan_out, worker_env

    session = ray_session(config, pipelines=min(parallel, len(configs)))
    with stage_results(config.output):  # once, before the fan-out: every evaluation finds it done (Cached)
        preprocess_task(opaque(ingest_task(config)), config)
    engine = resolve_engine(config, resolved[0], session.preset(config.device), session.gpus(), session.started_here)
    plan = fan_out(config, len(configs), parallel, session.gpus(), engine.engines_per_gpu)
    get_run_logger().info("evaluating %d checkpoints, %s", len(configs), plan.describe())
    if plan.concurrency:
        configs = [c.model_copy(update={"concurrency": plan.concurrency}) for c in configs]
    runner = RayTaskRunner(address=session.address or "auto")  # adopts the Ray this process is connected to
    return evaluate_in_parallel.with_options(task_runner=runner)(configs, plan.slots, worker_env())
