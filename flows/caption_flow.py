"""The captionflow flow: ingest -> preprocess -> inference -> evaluate."""

from __future__ import annotations

import time

from prefect import flow, get_run_logger

from captionflow.config import RunConfig
from captionflow.model_source import resolve_model
from tasks.evaluate import evaluate_task
from tasks.inference import inference_task
from tasks.ingest import ingest_task
from tasks.preprocess import preprocess_task


@flow(name="captionflow")
def caption_flow(config: RunConfig = RunConfig()) -> dict:
    """Caption a dataset with a VLM checkpoint and score the captions. Returns the run summary."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    model = resolve_model(config.model)  # fails fast, before Ray or any decoding starts
    logger.info("model %s -> %s (fingerprint %s)", config.model, model.path, model.fingerprint)

    t = time.perf_counter()
    ing = ingest_task(config)
    timings["ingest_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    manifest = preprocess_task(ing, config.output)
    timings["preprocess_s"] = round(time.perf_counter() - t, 2)
    logger.info("dataset %s: %s%s", manifest["dataset_fingerprint"], manifest["counts"],
                " (already preprocessed: skipped)" if manifest.get("skipped") else "")
    t = time.perf_counter()
    inf = inference_task(config, manifest, model)
    timings["inference_s"] = round(time.perf_counter() - t, 2)
    timings.update({f"inference.{k}": v for k, v in inf["timings_s"].items()})
    t = time.perf_counter()
    ev = evaluate_task(config.output, manifest, inf, config.model)
    timings["evaluate_s"] = round(time.perf_counter() - t, 2)
    timings["total_s"] = round(time.perf_counter() - t0, 2)
    c = manifest["counts"]
    return {
        "dataset_dir": ing.dataset_dir,
        "run_dir": inf["run_dir"],
        "counts": {"total": c["listed"], "accepted": c["accepted"], "quarantined": c["quarantined"],
                   "duplicates": c["duplicates"], "captioned": inf["captioned"], "failed": inf["failed"]},
        "metrics": ev["metrics"],
        "timings_s": timings,
        "preprocess_skipped": bool(manifest.get("skipped")),
        "resumed_from": inf["resumed_from"],
        "report": ev["report"],
    }
