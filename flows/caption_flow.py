"""The captionflow flow: ingest -> preprocess -> inference -> evaluate.

Caching: preprocess, inference and evaluate are cached by Prefect on content fingerprints
(dataset, model, generation parameters), never on the run id, with results persisted under the
storage root (``<output>/.prefect-cache``). A new run with the same inputs - a "Custom run"
from the UI, a schedule, a retry by hand - shows those stages as Cached and does no work.
Ingest (a listing) always runs: it is the cheap check that notices a changed dataset.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger

from captionflow.config import RunConfig
from captionflow.fingerprint import digest
from captionflow.model_source import resolve_model
from captionflow.storage import Store
from tasks.evaluate import evaluate_task
from tasks.inference import RowsFailed, inference_task, run_paths
from tasks.ingest import ingest_task
from tasks.judge import judge_paths, judge_task
from tasks.preprocess import preprocess_task


def result_storage(output: str):
    """A Prefect filesystem block under the storage root for persisted task results.

    Prefect needs result storage saved server-side; the block is named after the storage root
    (``captionflow-results-<digest>``) and holds no credentials (see storage.storage_options).
    """
    from prefect.filesystems import LocalFileSystem, RemoteFileSystem

    from captionflow.storage import storage_options

    store = Store(output)
    if store.is_local:
        block = LocalFileSystem(basepath=store.path(".prefect-cache"))
    else:
        block = RemoteFileSystem(basepath=store.url(".prefect-cache"), settings=storage_options(store.uri))
    block.save(name=f"captionflow-results-{digest(store.url())}", overwrite=True)
    return block


def _run(task_, key: str | None, storage, *args) -> tuple[Any, bool]:
    """Submit one stage with a fingerprint cache key; returns (result, was_cached)."""
    opts: dict[str, Any] = {"persist_result": True, "result_storage": storage}
    if key:
        opts["cache_key_fn"] = lambda *_: key
    else:
        opts["refresh_cache"] = True
    state = task_.with_options(**opts)(*args, return_state=True)
    if state.is_failed():
        exc = state.result(raise_on_failure=False)
        if isinstance(exc, RowsFailed):  # some rows failed every pass: carry on, they are counted
            return exc.summary, False
    return state.result(), state.name == "Cached"


@flow(name="captionflow")
def caption_flow(config: RunConfig = RunConfig()) -> dict:
    """Caption a dataset with a VLM checkpoint and score the captions. Returns the run summary."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    cached: list[str] = []
    model = resolve_model(config.model, dummy_weights=config.dummy_weights())  # fails fast, before Ray or any decoding starts
    logger.info("model %s -> %s (fingerprint %s)", config.model, model.path, model.fingerprint)
    judge = None
    if config.judge:
        judge = model if config.judge_model in (None, config.model) else resolve_model(config.judge_model, dummy_weights=config.dummy_weights())
    if config.coco_java:
        import shutil

        if not shutil.which("java"):
            raise ValueError("coco_java needs Java on the PATH (PTB tokenizer and METEOR run on the JVM)")
    storage = result_storage(config.output)

    t = time.perf_counter()
    ing = ingest_task(config)
    timings["ingest_s"] = round(time.perf_counter() - t, 2)

    t = time.perf_counter()
    key = None if config.force_preprocess else f"preprocess-{ing.dataset_fingerprint}"
    manifest, hit = _run(preprocess_task, key, storage, ing, config)
    cached += ["preprocess"] if hit else []
    timings["preprocess_s"] = round(time.perf_counter() - t, 2)
    logger.info("dataset %s: %s%s", manifest["dataset_fingerprint"], manifest["counts"],
                " (already preprocessed: reused)" if manifest.get("skipped") or hit else "")

    t = time.perf_counter()
    run = run_paths(config, ing.dataset_fingerprint, model.fingerprint)
    inf, hit = _run(inference_task, "inference-" + "-".join(run[1:]), storage, config, manifest, model)
    cached += ["inference"] if hit else []
    timings["inference_s"] = round(time.perf_counter() - t, 2)
    if not hit:
        timings.update({f"inference.{k}": v for k, v in inf["timings_s"].items()})

    jdg = None
    if judge is not None:
        t = time.perf_counter()
        jkey = "judge-" + digest([list(judge_paths(list(run), judge)), inf["captioned"]])
        jdg, hit = _run(judge_task, jkey, storage, config, manifest, inf, judge)
        cached += ["judge"] if hit else []
        timings["judge_s"] = round(time.perf_counter() - t, 2)

    t = time.perf_counter()
    ev_key = "evaluate-" + digest([list(run), inf["captioned"], inf["failed"], jdg and jdg["judged"], config.coco_java])
    ev, hit = _run(evaluate_task, ev_key, storage, config.output, manifest, inf, config.model, jdg, config.coco_java)
    cached += ["evaluate"] if hit else []
    timings["evaluate_s"] = round(time.perf_counter() - t, 2)
    timings["total_s"] = round(time.perf_counter() - t0, 2)
    c = manifest["counts"]
    return {
        "dataset_dir": ing.dataset_dir,
        "run_dir": inf["run_dir"],
        "counts": {"total": c["listed"], "accepted": c["accepted"], "quarantined": c["quarantined"],
                   "duplicates": c["duplicates"], "captioned": inf["captioned"], "failed": inf["failed"]},
        "quarantine_reasons": manifest.get("quarantine_reasons", {}),
        "hidden_skipped": {"count": ing.hidden_skipped, "examples": ing.hidden_examples},
        "metrics": ev["metrics"],
        "timings_s": timings,
        "cached_stages": cached,
        "preprocess_skipped": bool(manifest.get("skipped")) or "preprocess" in cached,
        "resumed_from": inf["resumed_from"],
        "passes": inf["passes"],
        "report": ev["report"],
    }
