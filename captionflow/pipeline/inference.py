"""Stage 3, inference: a caption for every accepted row, through Ray Data LLM and the vLLM engine.

One Ray Data job per pass (``processor.py``), streamed into the commit ledger (``ledger.py``): a rerun
sends only the rows not yet committed, and rows the engine rejects are retried in later passes.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Optional

from captionflow.config import RunConfig
from captionflow.errors import RowsFailed
from captionflow.fingerprint import generation_fingerprint
from captionflow.layout import CAPTIONS, run_parts, shard_paths
from captionflow.model_source import ResolvedModel
from captionflow.pipeline.engine import resolve_engine
from captionflow.pipeline.ledger import Ledger, Progress, run_passes
from captionflow.pipeline.processor import build_vlm_processor, map_task_kwargs, read_pending
from captionflow.pipeline.session import ray_session
from captionflow.results import InferenceResult, Manifest
from captionflow.storage import Store
from captionflow.workers.llm_rows import CAPTION_SCHEMA, caption_fixed_schema, caption_request, to_caption

# Testing hook: a comma-separated list of image ids whose *first* attempt is sent to the engine
# with invalid sampling parameters (temperature -1), so the real engine rejects that row.
INJECT_ENV = "CAPTIONFLOW_INJECT_ROW_FAILURES"


def caption_run_parts(cfg: RunConfig, manifest: Manifest, model: ResolvedModel) -> tuple[str, ...]:
    return run_parts(manifest.dataset_fingerprint, model.fingerprint, generation_fingerprint(cfg))


def run_inference(
    cfg: RunConfig, manifest: Manifest, model: ResolvedModel, progress: Optional[Progress] = None
) -> InferenceResult:
    """Caption every accepted row not yet captioned. Raises RowsFailed (with the result) when rows
    still failed after every pass."""
    t_start = time.perf_counter()
    store = Store(cfg.output)
    run = caption_run_parts(cfg, manifest, model)
    shards = shard_paths(store, manifest)
    all_ids = store.ids(shards)
    store.write_json(
        {
            "model": model.source,
            "model_path": model.path,
            "model_fingerprint": model.fingerprint,
            "architecture": model.architecture,
            "dataset_fingerprint": manifest.dataset_fingerprint,
            "generation": cfg.generation_params(),
        },
        *run,
        "run.json",
    )
    ledger = Ledger(store, run, CAPTIONS, CAPTION_SCHEMA, cfg.commit_rows)
    done = ledger.committed()
    resumed_from = len(done & all_ids)
    timings: dict[str, float] = {}
    passes = []
    if all_ids - done:
        t0 = time.perf_counter()
        session = ray_session(cfg)
        timings["ray_init_s"] = round(time.perf_counter() - t0, 2)
        engine = resolve_engine(cfg, model, session.preset(cfg.device), session.gpus(), session.started_here)
        inject = frozenset(x for x in os.environ.get(INJECT_ENV, "").split(",") if x)
        sampling = {
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "seed": cfg.seed,
            "ignore_eos": cfg.ignore_eos,
        }

        def rows_for(attempt: int, pending: list[str]):
            processor = build_vlm_processor(
                engine,
                model.path,
                preprocess=functools.partial(
                    caption_request,
                    system_prompt=cfg.system_prompt,
                    prompt=cfg.prompt,
                    sampling=sampling,
                    fail_ids=inject if attempt == 0 else frozenset(),
                ),
                postprocess=functools.partial(
                    to_caption, max_tokens=cfg.max_tokens, model_fp=model.fingerprint, attempt=attempt
                ),
            )
            ds = read_pending(store.fs, shards, ["image_id", "image"], pending, engine)
            return processor(ds).map(
                functools.partial(caption_fixed_schema, model_fp=model.fingerprint, attempt=attempt),
                **map_task_kwargs(engine.preset),
            )

        passes = run_passes(ledger, all_ids, done, cfg.row_retries, rows_for, progress)
        timings["inference_s"] = round(time.perf_counter() - t_start, 2)
    captioned = len(done & all_ids)
    result = InferenceResult(
        run_dir=store.url(*run),
        run_parts=run,
        accepted=len(all_ids),
        captioned=captioned,
        failed=len(all_ids) - captioned,
        resumed_from=resumed_from,
        passes=passes,
        timings_s=timings,
    )
    if result.failed:
        raise RowsFailed(
            f"{result.failed} of {result.accepted} rows failed after {len(passes)} passes "
            f"(see {result.run_dir}/failures)",
            result,
        )
    return result
