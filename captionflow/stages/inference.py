"""Stage 3, inference: a caption for every accepted row, through Ray Data LLM and the vLLM engine.

One Ray Data job per pass (``processor.py``), streamed into the commit ledger (``ledger.py``) while this
run holds the lease on its run folder (``captionflow/data/lease.py``): a rerun sends only the rows not yet
committed, a concurrent run on the same folder waits and then finds them committed, and rows the engine
rejects are retried in later passes. Captions of the same image by the same checkpoint with the same
settings in another run folder (the dataset gained or lost files around it) are reused, not recomputed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import time
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from captionflow.config import RunConfig
from captionflow.data.fingerprint import generation_fingerprint
from captionflow.data.layout import CAPTIONS, SCORES, caption_failures, read_captions, run_parts, shard_paths
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.engines.engine import EngineSettings
from captionflow.engines.processor import build_vlm_processor, fitted_folder, map_task_kwargs, read_pending
from captionflow.engines.request_format import image_prompt
from captionflow.engines.session import ray_session
from captionflow.engines.staging import staged
from captionflow.errors import BaselineError, DatasetError, RowsFailed
from captionflow.evaluation.cider import FixedIdfCider
from captionflow.evaluation.sequential import VERDICT_SCORES, PrefixVerdict, paired_differences, verdict_line
from captionflow.model_source import ClipModel, ResolvedModel
from captionflow.results import InferenceResult, Manifest
from captionflow.runs.baseline import baseline_order, baseline_verdict, resolve_baseline
from captionflow.runs.ledger import Ledger, Progress, run_passes
from captionflow.service import hold as service
from captionflow.stages.clip_score import PrefixClipScore
from captionflow.stages.judge import SequentialJudging, alongside, judge_score_judging
from captionflow.stages.pairwise import pairwise_judging
from captionflow.workers.llm_rows import (
    CAPTION_SCHEMA,
    caption_fixed_schema,
    caption_request,
    to_caption,
    to_judged_caption,
)

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
    clip: Optional[ClipModel] = None,
    judge: Optional[ResolvedModel] = None,
    judge_engine: Optional[EngineSettings] = None,
) -> InferenceResult:
    """Caption every accepted row not yet captioned (``clip``: the CLIP checkpoint of a CLIPScore verdict;
    ``judge``, ``judge_engine``: the judge of a verdict on the judge's score or the pairwise win, which judges the
    captions as they are made where it can: ``judging_alongside``). Rows that still failed after every pass are
    counted; more than ``max_failure_rate`` of them raises RowsFailed (with the result)."""
    t_start = time.perf_counter()
    store = Store(cfg.output)
    run = caption_run_parts(cfg, manifest, model, engine)
    shards = shard_paths(store, manifest)
    all_ids = store.dataset_ids(shards)
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
        verdict = (
            sequential_verdict(cfg, store, run, shards, all_ids, clip, engine.preset.name == "gpu")
            if cfg.verdict == "sequential"
            else None
        )
        if verdict is not None:
            verdict.observe(read_captions(store, run))  # a rerun or resume continues the same order's prefix
        judging = judging_alongside(cfg, store, run, engine, all_ids, judge, judge_engine)
        if judging is not None and judging.observe_committed(store):
            log.info("the %s's sequential verdict is in from the judgements committed", judging.what)
        if all_ids - done and not (verdict and verdict.decided) and not (judging and judging.verdict.decided):
            t0 = time.perf_counter()
            local = ray_session(cfg).started_here
            timings["ray_init_s"] = round(time.perf_counter() - t0, 2)
            with service.for_run(cfg, model, engine) as warm, contextlib.ExitStack() as judge_side:
                why = warm.judges(judging.judge, judging.engine) if warm is not None and judging is not None else None
                if why:
                    log.info("verdict sequential on the %s: %s, so warm engines caption the full set and the judging "
                             "stops once sure", judging.what, why)  # fmt: skip
                    judging = None
                side = judge_path = None
                if judging is not None:  # its folder is ours for the pass, its checkpoint staged like the captioner's
                    if warm is not None:
                        log.info("verdict sequential on the %s: the warm engine service's judge engines judge the "
                                 "captions as they are made", judging.what)  # fmt: skip
                        judge_path = judging.judge.path
                    elif engine.preset.engine_gpus:  # half of each GPU's engines the captioner's, half the judge's
                        engine = engine.halved()
                        judging = dataclasses.replace(judging, engine=judging.engine.halved())
                    side = judge_side.enter_context(_judge_ledger(cfg, store, judging))
                    if warm is None:
                        judge_path = judge_side.enter_context(
                            staged(judging.judge.path, judging.engine.compile_dir, local)
                        )
                with staged(model.path, engine.compile_dir, local=local and warm is None) as path:
                    fitted = fitted_folder(cfg, store, manifest, engine)
                    rows_for = _caption_rows(
                        cfg, model, path, engine, store, shards, fitted, warm, ordered=verdict is not None,
                        judging=judging, judge_path=judge_path,
                    )  # fmt: skip
                    decider, stop = (judging.verdict, judging.stop) if judging else (verdict, None)
                    if verdict is not None:
                        stop = lambda rows: verdict.observe({r["image_id"]: r["caption"] for r in rows})
                    passes = run_passes(
                        ledger,
                        all_ids,
                        done,
                        cfg.row_retries,
                        rows_for,
                        progress,
                        order=decider.order if decider else None,
                        stop=stop,
                        side=side,
                    )
                if warm is not None:
                    warm.wait()
                    engines = f"warm ({warm.how})"
                    timings["warm_engine_s"] = warm.seconds
            timings["inference_s"] = round(time.perf_counter() - t_start, 2)
    if verdict is not None:  # the captions that failed for good leave its order: the rest decides
        verdict.finish(all_ids - done)
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
        verdict=verdict.record() if verdict else None,
    )
    if verdict:
        log.info("sequential verdict: %s", verdict_line(result.verdict))
    elif judging is not None and judging.verdict.decided:
        log.info("captioning stopped, the %s's sequential verdict is in: %s", judging.what,
                 verdict_line(judging.verdict.record()))  # fmt: skip
    if (verdict or judging) and (verdict or judging.verdict).stopped_early:
        # the images the verdict did not need are not failures: only the last pass's are
        result.failed = passes[-1].failed if passes and passes[-1].stopped else 0
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


def judging_alongside(
    cfg: RunConfig,
    store: Store,
    run: tuple[str, ...],
    engine: EngineSettings,
    ids: set[str],
    judge: Optional[ResolvedModel],
    judge_engine: Optional[EngineSettings],
) -> Optional[SequentialJudging]:
    """For a sequential verdict on the judge's score or the pairwise win, its judge judging the captions of
    ``ids`` as they are made, so that the captioning stops once the verdict is in (``judge.SequentialJudging``); None
    (said in the log) where it cannot (``judge.alongside``: the run captions the full set, and the judge or pairwise
    stage's judging stops once sure) or there is no baseline yet. BaselineError for a baseline without what the
    verdict needs, before any engine starts."""
    if cfg.verdict != "sequential" or cfg.verdict_score not in ("judge", "pairwise"):
        return None
    what = "pairwise judge" if cfg.verdict_score == "pairwise" else "judge's score"
    why = alongside(cfg, engine, judge, judge_engine)
    if why:
        log.info("verdict sequential on the %s: %s, so the full set is captioned and the judging stops once sure",
                 what, why)  # fmt: skip
        return None
    make = pairwise_judging if cfg.verdict_score == "pairwise" else judge_score_judging
    return make(cfg, store, run, ids, caption_failures(store, run), judge, judge_engine)


@contextlib.contextmanager
def _judge_ledger(cfg: RunConfig, store: Store, judging: SequentialJudging):
    """The ledger of the judgements made alongside the captioning, holding their folder's lease."""
    what = f"the {judging.what} folder {store.url(*judging.parts)}"
    with Lease(store, "/".join(judging.parts), what=what, wait_s=cfg.lease_wait_s) as lease:
        yield Ledger(
            store, judging.parts, SCORES, judging.task.schema, cfg.commit_rows, lease=lease,
            stall_timeout_s=cfg.stall_timeout_s, what=judging.what,
        )  # fmt: skip


def sequential_verdict(
    cfg: RunConfig,
    store: Store,
    run: tuple[str, ...],
    shards: list[str],
    ids: set[str],
    clip: Optional[ClipModel] = None,
    gpu: bool = False,
) -> Optional[PrefixVerdict]:
    """The run's sequential verdict against ``verdict_against`` (``evaluation/sequential.py``): the golden set's
    images with a baseline caption (and references, for CIDEr-D), in an order seeded by the dataset and the baseline
    run, each scored (both sides, as the prefix reaches it) by ``verdict_score``: CIDEr-D with the IDF of all the
    references (``evaluation/cider.py``) or CLIPScore by ``clip`` (``clip_score.PrefixClipScore``; on the driver's
    GPU for a ``gpu`` run). None (the full
    set, said in the log) while no baseline exists yet, and for a judge or pairwise verdict (their judge decides:
    ``judging_alongside``, or the judge or pairwise stage); DatasetError for a dataset the score cannot score."""
    if cfg.verdict_score in ("judge", "pairwise"):  # their judge decides (judging_alongside)
        return None
    baseline = resolve_baseline(store, run, cfg.verdict_against, what="verdict_against")
    if baseline is None:
        log.info("verdict sequential: no %s comparable run yet, so the full set is captioned", cfg.verdict_against)
        return None
    refs: dict[str, list[str]] = {}
    if cfg.verdict_score in ("auto", "cider"):
        data = store.read_tables(shards, columns=["image_id", "references"])
        refs = {i: r for i, r in zip(data["image_id"].to_pylist(), data["references"].to_pylist()) if r} if data else {}
    score = "clip" if cfg.verdict_score == "clip" else "cider" if refs else "clip" if clip else None
    if score is None:
        raise DatasetError(
            f"verdict sequential: the dataset {cfg.dataset} has no reference captions to score CIDEr-D against "
            "(give a caption_column, set clip_model for a CLIPScore verdict, or use verdict full)"
        )
    if score == "clip" and clip is None:  # preflight says so first; here for a caller without it
        raise DatasetError("verdict sequential: verdict_score clip needs clip_model")
    population = refs if score == "cider" else ids
    theirs = {i: c for i, c in read_captions(Store(baseline["run_dir"]), ()).items() if i in ids and i in population}
    if not theirs:
        raise BaselineError(f"verdict_against: the run {baseline['run_dir']} has no captions of this dataset's images")
    order = baseline_order(run, baseline, set(theirs) - caption_failures(store, run), theirs)
    if score == "cider":
        # the references' document frequencies are counted while the run's requests start (~1.7 s for 5,000
        # images on 2 cores); the first captions to score wait for them
        idf = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="captionflow-idf")
        cider = idf.submit(FixedIdfCider, refs)
        idf.shutdown(wait=False)
        scorer, extra = (lambda captions: cider.result().scores(captions)), {}
    else:
        scorer = PrefixClipScore(clip, store, shards, order, gpu)
        # where the bootstrap beside the verdict finds the baseline's CLIPScores by the same checkpoint
        extra = {
            "clip_model": clip.source,
            "baseline_scores": f"{baseline['run_dir'].rstrip('/')}/clip/{clip.fingerprint}",
        }
    return baseline_verdict(cfg, baseline, order, paired_differences(scorer, theirs), VERDICT_SCORES[score], extra)


def _caption_rows(
    cfg: RunConfig,
    model: ResolvedModel,
    model_path: str,
    engine: EngineSettings,
    store: Store,
    shards: list[str],
    fitted: Optional[str],
    warm=None,
    ordered: bool = False,
    judging: Optional[SequentialJudging] = None,
    judge_path: Optional[str] = None,
):
    """``rows_for(attempt, pending)``: the Ray dataset of caption rows for one pass; the engines load
    ``model_path`` (the checkpoint, or its staged slot: staging.py); ``fitted``: where the dataset's images
    fitted to the engine's grid are kept (``processor.fitted_folder``); ``ordered``: the rows go to the engines in
    ``pending``'s order (a sequential verdict's); ``judging``: each caption goes on to its judge (loaded from
    ``judge_path``) in the same pass, the rows in that order, each with its judgement (``Ledger.drain``'s side)."""
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
                judged=judging is not None,
            ),
            postprocess=functools.partial(
                to_judged_caption if judging else to_caption,
                max_tokens=cfg.max_tokens,
                model_fp=model.fingerprint,
                attempt=attempt,
            ),
            warm=warm,
            rows=len(pending),
            ordered=ordered or judging is not None,
        )
        columns = ["image_id", "image", "references"] if judging else ["image_id", "image"]
        ds = read_pending(
            store.fs, shards, columns, pending, engine, fitted, ordered=ordered or judging is not None,
            engines=len(warm.apps) if warm is not None else None,  # the first window: a batch for each that serves
            shard_ids=store.shard_ids(shards),  # read with all_ids
        )  # fmt: skip
        if judging:
            return judging.after(processor(ds), cfg, judge_path, attempt, len(pending), model.fingerprint)
        return processor(ds).map(
            functools.partial(caption_fixed_schema, model_fp=model.fingerprint, attempt=attempt),
            **map_task_kwargs(engine),
        )

    return rows_for
