"""The optional LLM-as-judge pass: a VLM scores each caption against its image (and references) from 1 to 5.

The answer is constrained with vLLM structured outputs to a regular expression whose every match is
valid JSON of bounded length (a score digit 1-5 and a reason of at most 80 plain characters), and
``max_tokens`` leaves room for the longest match, so every answer parses, even the tiny random
built-in model's. Rows the engine rejects are recorded with their error in ``judge/<judge-fp>/failures``
and never counted as judged; the pass resumes like captioning (the same ledger, lease and pass loop).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Optional

from captionflow.config import RunConfig
from captionflow.data.fingerprint import digest
from captionflow.data.layout import FAILURES, SCORES, judge_parts, read_captions, read_scores, shard_paths
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.errors import BaselineError
from captionflow.evaluation.sequential import PrefixVerdict
from captionflow.model_source import ResolvedModel
from captionflow.pipeline.baseline import baseline_order, baseline_verdict, resolve_baseline
from captionflow.pipeline.engine import EngineSettings
from captionflow.pipeline.ledger import Ledger, run_passes
from captionflow.pipeline.processor import build_vlm_processor, fitted_folder, map_task_kwargs, read_pending
from captionflow.pipeline.request_format import image_prompt
from captionflow.pipeline.session import ray_session
from captionflow.pipeline.staging import staged
from captionflow.results import InferenceResult, JudgeResult, Manifest, PassResult
from captionflow.workers.llm_rows import (
    JUDGE_MAX_TOKENS,
    JUDGE_REGEX,
    JUDGE_SCHEMA,
    JUDGE_SYSTEM,
    judge_fixed_schema,
    judge_out,
    judge_prompt,
    judge_request,
)

log = logging.getLogger("captionflow.judge")


def judge_fingerprint(judge: ResolvedModel, engine: EngineSettings) -> str:
    """The judge checkpoint, its settings and its prompt: what one judge's scores are keyed on."""
    return digest(
        {
            "model": judge.fingerprint,
            "engine": engine.output_params(),
            "regex": JUDGE_REGEX,
            "system": JUDGE_SYSTEM,
            "prompt": judge_prompt("{caption}", ["{reference}"]),
        }
    )


def judge_run_parts(run: tuple[str, ...], judge: ResolvedModel, engine: EngineSettings) -> tuple[str, ...]:
    """Where one judge's scores of one run go."""
    return judge_parts(run, judge_fingerprint(judge, engine))


def judge_verdict(
    cfg: RunConfig,
    store: Store,
    run: tuple[str, ...],
    judge: ResolvedModel,
    engine: EngineSettings,
    captions: dict[str, str],
) -> Optional[PrefixVerdict]:
    """The sequential verdict on the judge's 1-5 score (``verdict sequential``, ``verdict_score judge``) against
    ``verdict_against``: the images both runs have scores of by this judge (the same checkpoint, settings and prompt:
    the baseline's ``judge/<fingerprint>``), judged in an order seeded by the dataset and the baseline run; each
    image's difference is this run's score minus the baseline's, within (-4, 4). None (the full set judged, said
    in the log) while no baseline exists yet; BaselineError for a baseline without this judge's scores."""
    base = resolve_baseline(store, run, cfg.verdict_against, what="verdict_against")
    if base is None:
        log.info("verdict sequential: no %s comparable run yet, so every caption is judged", cfg.verdict_against)
        return None
    folder = f"{base['run_dir'].rstrip('/')}/judge/{judge_fingerprint(judge, engine)}"
    theirs = read_scores(folder, "score")
    common = sorted(set(captions) & set(theirs))
    if not common:
        raise BaselineError(
            f"verdict_against: the run {base['run_dir']} has no scores by the judge {judge.source} with these "
            "settings (run it with judge, or use another verdict_score)"
        )
    return baseline_verdict(
        cfg,
        base,
        baseline_order(run, base, common),
        lambda mine: {i: mine[i] - theirs[i] for i in mine},
        (-4.0, 4.0),
        "judge score",
        "judge_mean",
        {"judge_model": judge.source, "baseline_scores": folder},
    )


def run_judge(
    cfg: RunConfig, manifest: Manifest, inference: InferenceResult, judge: ResolvedModel, engine: EngineSettings
) -> JudgeResult:
    """Judge every captioned row not judged yet; returns counts, parse rate and the mean score."""
    t0 = time.perf_counter()
    store = Store(cfg.output)
    run = tuple(inference.run_parts)
    base = judge_run_parts(run, judge, engine)
    captions = read_captions(store, run)
    passes = []
    verdict = None
    if cfg.verdict == "sequential" and cfg.verdict_score == "judge":
        verdict = judge_verdict(cfg, store, run, judge, engine, captions)
    with Lease(store, "/".join(base), what=f"the judge folder {store.url(*base)}", wait_s=cfg.lease_wait_s) as lease:
        ledger = Ledger(
            store,
            base,
            SCORES,
            JUDGE_SCHEMA,
            cfg.commit_rows,
            lease=lease,
            stall_timeout_s=cfg.stall_timeout_s,
            what="judge",
        )
        done = ledger.committed()
        if verdict is not None:  # a rerun or resume continues the same order's prefix from the scores committed
            verdict.observe(read_scores(store.url(*base), "score"))
        if set(captions) - done and not (verdict and verdict.decided):
            passes = judge_passes(
                cfg, manifest, judge, engine, ledger, set(captions), done,
                regex=JUDGE_REGEX,
                max_tokens=JUDGE_MAX_TOKENS,
                request=functools.partial(judge_request, captions=captions),
                out=judge_out,
                fixed=judge_fixed_schema,
                order=verdict.order if verdict else None,
                stop=(lambda rows: verdict.observe({r["image_id"]: r["score"] for r in rows})) if verdict else None,
            )  # fmt: skip
    scores = store.read_unique(store.ls(*base, SCORES, suffix=".parquet"))
    rows = scores.to_pylist() if scores is not None else []
    values = [r["score"] for r in rows]
    failed = len(captions) - len(rows)
    if verdict and verdict.decided:  # captions the verdict did not need judged are not failures: the last pass's are
        failed = passes[-1].failed if passes and passes[-1].stopped else 0
    return JudgeResult(
        judge_model=judge.source,
        judge_dir=store.url(*base),
        judge_parts=base,
        judged=len(rows),
        failed=failed,
        parse_rate=parse_rate(store, base, len(rows)),
        mean_score=sum(values) / len(values) if values else None,
        distribution={str(k): values.count(k) for k in range(1, 6)},
        passes=passes,
        seconds=round(time.perf_counter() - t0, 2),
        verdict=verdict.record() if verdict else None,
    )


def parse_rate(store: Store, base: tuple[str, ...], n_parsed: int) -> float:
    """The share of a judge's answers that parsed: ``n_parsed`` against the unparseable ones in ``base/failures``."""
    failures = store.read_tables(store.ls(*base, FAILURES, suffix=".parquet"))
    n_unparsed = sum(1 for r in failures.to_pylist() if r["error"].startswith("unparseable")) if failures else 0
    return n_parsed / (n_parsed + n_unparsed) if n_parsed or n_unparsed else 0.0


def judge_passes(
    cfg: RunConfig,
    manifest: Manifest,
    judge: ResolvedModel,
    engine: EngineSettings,
    ledger: Ledger,
    todo: set[str],
    done: set[str],
    *,
    regex: str,
    max_tokens: int,
    request: Callable,
    out: Callable,
    fixed: Callable,
    fan_out: Optional[Callable[[list[str]], tuple[list[str], Callable]]] = None,
    order: Optional[list[str]] = None,
    stop: Optional[Callable[[list[dict]], bool]] = None,
) -> list[PassResult]:
    """The passes of a judge that answers through structured output (``regex``, greedy): ``request(row,
    image_prompt=, sampling=, grid=)`` builds each request from a dataset row, ``out(row, attempt=)`` parses the answer,
    ``fixed(row, attempt=)`` gives error rows the ledger's schema. ``fan_out(pending)``, for results that are
    not one per image (pairwise: two orders), gives the images to read and the row -> rows function that
    makes each image's pending requests. ``order`` and ``stop``: a sequential verdict's (``run_passes``): the images
    go to the engines in that order, and the pass ends once ``stop`` says so."""
    local = ray_session(cfg).started_here
    store = ledger.store
    shards = shard_paths(store, manifest)
    fitted = fitted_folder(cfg, store, manifest, engine)
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "seed": cfg.seed, "structured_outputs": {"regex": regex}}
    map_kwargs = map_task_kwargs(engine)

    def rows_for(attempt: int, pending: list[str], judge_path: str):
        processor = build_vlm_processor(
            engine,
            judge_path,
            preprocess=functools.partial(
                request, image_prompt=image_prompt(judge.path), sampling=sampling, grid=engine.image_grid
            ),
            postprocess=functools.partial(out, attempt=attempt),
            rows=len(pending),
            ordered=order is not None,
        )
        images, expand = fan_out(pending) if fan_out else (pending, None)
        columns = ["image_id", "image", "references"]
        ds = read_pending(store.fs, shards, columns, images, engine, fitted, ordered=order is not None)
        if expand:
            ds = ds.flat_map(expand, **map_kwargs)
        return processor(ds).map(functools.partial(fixed, attempt=attempt), **map_kwargs)

    with staged(judge.path, engine.compile_dir, local=local) as path:
        rows = functools.partial(rows_for, judge_path=path)
        return run_passes(ledger, todo, done, cfg.row_retries, rows, order=order, stop=stop)
