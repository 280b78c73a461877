"""Evaluate captions produced elsewhere: ingest -> preprocess -> import-captions -> evaluate -> publish.

The same metrics, statistics, reports and leaderboard as a captionflow run; the captions file takes the place
of inference (captionflow/evaluation/external.py). No model is loaded.
"""

from __future__ import annotations

import inspect
from typing import Optional

from prefect import flow, runtime
from prefect.utilities.annotations import opaque

from captionflow.config import RunConfig
from captionflow.evaluation.external import external_name
from captionflow.results import RunSummary
from flows.parameters import with_config_parameters
from tasks.evaluate import evaluate_task
from tasks.import_captions import import_captions_task
from tasks.ingest import ingest_task
from tasks.preprocess import preprocess_task
from tasks.publish import publish_task
from tasks.results import stage_results

CAPTIONS = inspect.Parameter("captions", inspect.Parameter.KEYWORD_ONLY, default="", annotation=str)
NAME = inspect.Parameter("name", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Optional[str])


@flow(name="captionflow-evaluate", persist_result=True)
@with_config_parameters(CAPTIONS, NAME)
def evaluate_captions(config: RunConfig, captions: str = "", name: Optional[str] = None) -> dict:
    """Score a JSONL/Parquet file of (image_id or file_name, caption) on a dataset. Returns the run summary."""
    if config.judge or config.pairwise_against or config.clip_model:
        raise ValueError("judge, pairwise_against and clip_model are not offered for external captions (yet)")
    config = config.model_copy(update={"model": external_name(captions, name)})
    with stage_results(config.output) as stages:
        ing = ingest_task(config)
        manifest = preprocess_task(opaque(ing), config)
        imported = import_captions_task(config, manifest, captions)
        scored = evaluate_task(config, manifest, imported, None, None)
    summary = RunSummary.build(ing, manifest, imported, scored, stages.records, stages.elapsed(), runtime.flow_run.id)
    summary.regression = publish_task(config, summary.to_dict())
    return summary.to_dict()
