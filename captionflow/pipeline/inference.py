"""Stage 3, inference: a caption for every accepted row, through Ray Data LLM and the vLLM engine.

One Ray Data job per pass (``processor.py``), streamed into the commit ledger (``ledger.py``) while this
run holds the lease on its run folder (``captionflow/data/lease.py``): a rerun sends only the rows not yet
committed, a concurrent run on the same folder waits and then finds them committed, and rows the engine
rejects are retried in later passes. Captions of the same image by the same checkpoint with the same
settings in another run folder (the dataset gained or lost files around it) are reused, not recomputed.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from captionflow.config import RunConfig
from captionflow.data.fingerprint import generation_fingerprint
from captionflow.data.layout import CAPTIONS, run_parts, shard_paths
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.errors import RowsFailed
from captionflow.model_source import ResolvedModel
from captionflow.pipeline.engine import EngineSettings
from captionflow.pipeline.ledger import Ledger, Progress, run_passes
from captionflow.pipeline.processor import build_vlm_processor, fitted_folder, map_task_kwargs, read_pending
from captionflow.pipeline.request_format import image_prompt
from captionflow.pipeline.session import ray_session
from captionflow.pipeline.staging import staged
from captionflow.results import InferenceResult, Manifest
from captionflow.service import runs as service
from captionflow.workers.llm_rows import CAPTION_SCHEMA, caption_fixed_schema, caption_request, to_caption

log = logging.getLogger("captionflow.inference")

# Testing hook: a comma-separated list of image ids whose *first* attempt is sent to the engine
# with invalid sampling parameters (temperature -1), so the real engine rejects that row.
INJECT_ENV = "CAPTIONFLOW_INJECT_ROW_FAILURES"


def caption_run_parts(
    cfg: RunConfig, manifest: Manifest, model: ResolvedModel, engine: EngineSettings
) -> tuple[str, ...]:
    return run_parts(manifest.dataset_fingerprint, model.fingerprint, generation_fingerprint(cfg, engine))


def reuse_captions(store: Store, run: tuple[str, ...], ledger: Ledger, pending: set[str], done: set[str]) -> int:
    """Commit, as they are, the captions of ``pending`` images found in other run folders of the same
    checkpoint and generation settings (other datasets); returns how many."""
    own = store.path(*run, CAPTIONS)
    found = 0
    for folder in sorted(store.fs.glob(store.path("runs", "*", run[2], run[3], CAPTIONS))):
        if not pending or folder.rstrip("/") == own:
            continue
        table = store.read_unique(sorted(p for p in store.fs.ls(folder, detail=False) if p.endswith(".parquet")))
        if table is None:
            continue
        table = table.filter(pc.is_in(table["image_id"], value_set=pa.array(sorted(pending), pa.string())))
        if table.num_rows:
            rows = table.select(CAPTION_SCHEMA.names).to_pylist()
            found += ledger.commit_rows_now(rows)
            ids = {r["image_id"] for r in rows}
            done |= ids
            pending -= ids
    if found:
        log.info("reused %d captions of the same images, checkpoint and settings from other run folders", found)
    return found


def run_inference(
    cfg: RunConfig,
    manifest: Manifest,
    model: ResolvedModel,
    engine: EngineSettings,
    progress: Optional[Progress] = None,
) -> InferenceResult:
    """Caption every accepted row not yet captioned. Rows that still failed after every pass are counted;
    more than ``max_failure_rate`` of them raises RowsFailed (with the result)."""
    t_start = time.perf_counter()
    store = Store(cfg.output)
    run = caption_run_parts(cfg, manifest, model, engine)
    shards = shard_paths(store, manifest)
    all_ids = store.ids(shards)
    timings: dict[str, float] = {}
    passes = []
    engines = "per-run"
    with Lease(store, "/".join(run), what=f"the run folder {store.url(*run)}", wait_s=cfg.lease_wait_s) as lease:
        store.write_json(
            {
                "model": model.source,
                "model_path": model.path,
                "model_fingerprint": model.fingerprint,
                "architecture": model.architecture,
                "dataset_fingerprint": manifest.dataset_fingerprint,
                "generation": cfg.generation_params(),
                "engine": engine.output_params(),
                "engine_kwargs": engine.engine_kwargs,
            },
            *run,
            "run.json",
        )
        ledger = Ledger(
            store,
            run,
            CAPTIONS,
            CAPTION_SCHEMA,
            cfg.commit_rows,
            lease=lease,
            stall_timeout_s=cfg.stall_timeout_s,
            what="inference",
        )
        done = ledger.committed()
        resumed_from = len(done & all_ids)
        reused = reuse_captions(store, run, ledger, all_ids - done, done)
        if progress:  # the folder is ours: an earlier attempt on it that did not finish is over
            progress(len(done & all_ids), len(done & all_ids), len(all_ids), 0.0)
        if all_ids - done:
            t0 = time.perf_counter()
            local = ray_session(cfg).started_here
            timings["ray_init_s"] = round(time.perf_counter() - t0, 2)
            with service.for_run(cfg, model, engine) as warm:  # its checkpoint loads while the passes start
                with staged(model.path, engine.compile_dir, local=local and warm is None) as path:
                    fitted = fitted_folder(cfg, store, manifest, engine)
                    rows_for = _caption_rows(cfg, model, path, engine, store, shards, fitted, warm)
                    passes = run_passes(ledger, all_ids, done, cfg.row_retries, rows_for, progress)
                if warm is not None:
                    warm.wait()
                    engines = f"warm ({warm.how})"
                    timings["warm_engine_s"] = warm.seconds
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
        reused=reused,
        engines=engines,
    )
    if result.failed:
        share = result.failed / max(result.accepted, 1)
        message = (
            f"{result.failed} of {result.accepted} rows ({share:.0%}) failed after {len(passes)} passes "
            f"(their errors: {result.run_dir}/failures)"
        )
        if share > cfg.max_failure_rate:
            raise RowsFailed(
                f"{message}: more than max_failure_rate {cfg.max_failure_rate:.0%}; the run is not "
                "a result (the captions committed are kept, a rerun retries the rest)",
                result,
            )
        log.warning("%s; a rerun retries them", message)
    return result


def _caption_rows(
    cfg: RunConfig,
    model: ResolvedModel,
    model_path: str,
    engine: EngineSettings,
    store: Store,
    shards: list[str],
    fitted: Optional[str],
    warm=None,
):
    """``rows_for(attempt, pending)``: the Ray dataset of caption rows for one pass; the engines load
    ``model_path`` (the checkpoint, or its staged slot: staging.py); ``fitted``: where the dataset's images
    fitted to the engine's grid are kept (``processor.fitted_folder``)."""
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
            model_path,
            preprocess=functools.partial(
                caption_request,
                image_prompt=image_prompt(model.path),
                system_prompt=cfg.system_prompt,
                prompt=cfg.prompt,
                sampling=sampling,
                fail_ids=inject if attempt == 0 else frozenset(),
                grid=engine.image_grid,
            ),
            postprocess=functools.partial(
                to_caption, max_tokens=cfg.max_tokens, model_fp=model.fingerprint, attempt=attempt
            ),
            warm=warm,
            rows=len(pending),
        )
        ds = read_pending(store.fs, shards, ["image_id", "image"], pending, engine, fitted)
        return processor(ds).map(
            functools.partial(caption_fixed_schema, model_fp=model.fingerprint, attempt=attempt),
            **map_task_kwargs(engine),
        )

    return rows_for
