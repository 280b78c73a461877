"""The captionflow flow: preflight -> ingest -> preprocess -> inference -> [judge] -> [pairwise] -> [clip-score]
-> evaluate -> publish.

Each stage is a Prefect task (``tasks/``) with its retries and cache key on its decorator. Stages after
the listing are cached on content fingerprints (dataset, model, generation settings), never the run
id, with results persisted under the output root: a new run with the same inputs - a Custom run from
the UI, a schedule, a rerun by hand - shows them as Cached and does no work, unless storage no longer
holds what they produced. ``publish`` is never cached: every run, a cached rerun too, shows its tables, report
and regression alert in the UI; the summary is the flow's persisted result.
"""

from __future__ import annotations

from prefect import flow, runtime
from prefect.utilities.annotations import opaque

from captionflow import deadline
from captionflow.config import RunConfig
from captionflow.results import RunSummary
from flows import watch
from flows.parameters import with_config_parameters
from tasks.clip import clip_task
from tasks.evaluate import evaluate_task
from tasks.inference import inference_task
from tasks.ingest import ingest_task
from tasks.judge import judge_task
from tasks.pairwise import pairwise_task
from tasks.preflight import preflight_task
from tasks.preprocess import preprocess_task
from tasks.publish import publish_task
from tasks.results import stage_results


@flow(name="captionflow", persist_result=True)
@with_config_parameters()
def caption_flow(config: RunConfig) -> dict:
    """Caption a dataset with a VLM checkpoint and score the captions. Returns the run summary.
    Its parameters are RunConfig's fields (flows/parameters.py)."""
    with watch.watching(config):  # the deadline, from the run's start (the at-risk event, the backstop's watch)
        results = stage_results(config.output)  # its storage is saved while preflight runs
        checked = preflight_task(config)
        with results as stages:
            ing = ingest_task(config)
            manifest = preprocess_task(opaque(ing), config)  # opaque: the listing is not walked entry by entry
            captions = inference_task(config, manifest, checked)
            judged = judge_task(config, manifest, captions, checked) if config.judge else None
            paired = pairwise_task(config, manifest, captions, checked) if config.pairwise_against else None
            clipped = clip_task(config, manifest, captions, checked) if config.clip_model else None
            scored = evaluate_task(config, manifest, captions, judged, paired, clipped)
        summary = RunSummary.build(
            ing, manifest, captions, scored, stages.records, stages.elapsed(), runtime.flow_run.id
        )
        due = deadline.for_run(config.deadline, config.deadline_margin_s, runtime.flow_run.scheduled_start_time)
        if due:  # one outcome: when the verdict was in (the evaluate stage's, the leaderboard row's), else now
            fresh = "evaluate" not in summary.cached_stages
            summary.deadline = (fresh and summary.metrics.get("deadline")) or due.outcome()
        summary.regression = publish_task(config, summary.to_dict())
    return summary.to_dict()
