"""The optional LLM-as-judge pass: a VLM scores each caption against its image (and references) from 1 to 5.

The answer is constrained with vLLM structured outputs to a regular expression whose every match is
valid JSON of bounded length (a score digit 1-5 and a reason of at most 80 plain characters), and
``max_tokens`` leaves room for the longest match, so every answer parses, even the tiny random
built-in model's. Rows the engine rejects are recorded with their error in ``judge/<judge-fp>/failures``
and never counted as judged; the pass resumes like captioning (the same ledger, lease and pass loop).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa

from captionflow.config import RunConfig
from captionflow.data.fingerprint import digest
from captionflow.data.layout import (
    FAILURES,
    SCORES,
    caption_failures,
    judge_parts,
    read_captions,
    read_scores,
    shard_paths,
)
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.engines.engine import EngineSettings
from captionflow.engines.processor import build_vlm_processor, fitted_folder, map_task_kwargs, read_pending
from captionflow.engines.request_format import image_prompt
from captionflow.engines.session import ray_session
from captionflow.engines.staging import staged
from captionflow.errors import BaselineError
from captionflow.evaluation.sequential import VERDICT_SCORES, PrefixVerdict
from captionflow.model_source import ResolvedModel
from captionflow.results import InferenceResult, JudgeResult, Manifest, PassResult
from captionflow.runs.baseline import baseline_order, baseline_verdict, resolve_baseline
from captionflow.runs.ledger import Ledger, run_passes
from captionflow.service import hold as service
from captionflow.service.feed import WarmRows
from captionflow.stages.caption_pass import Consumer
from captionflow.workers.llm_rows import (
    JUDGE_MAX_TOKENS,
    JUDGE_REGEX,
    JUDGE_SCHEMA,
    JUDGE_SYSTEM,
    both_orders,
    judge_fixed_schema,
    judge_out,
    judge_prompt,
    judge_request,
    judged_fixed_schema,
    judged_out,
    judged_request,
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
    images: set[str],
    failed: set[str],
) -> Optional[PrefixVerdict]:
    """The sequential verdict on the judge's 1-5 score (``verdict sequential``, ``verdict_score judge``) against
    ``verdict_against``: the dataset's ``images`` the baseline has scores of by this judge (the same checkpoint,
    settings and prompt: the baseline's ``judge/<fingerprint>``), but those whose caption ``failed``, judged in an
    order seeded by the dataset and the baseline run (``baseline_order``); each image's difference is this run's
    score minus the baseline's. None (the full set judged, said in the log) while no baseline exists yet;
    BaselineError for a baseline without this judge's scores."""
    base = resolve_baseline(store, run, cfg.verdict_against, what="verdict_against")
    if base is None:
        log.info("verdict sequential: no %s comparable run yet, so every caption is judged", cfg.verdict_against)
        return None
    folder = f"{base['run_dir'].rstrip('/')}/judge/{judge_fingerprint(judge, engine)}"
    theirs = read_scores(folder, "score")
    common = set(images) & set(theirs)
    if not common:
        raise BaselineError(
            f"verdict_against: the run {base['run_dir']} has no scores by the judge {judge.source} with these "
            "settings (run it with judge, or use another verdict_score)"
        )
    return baseline_verdict(
        cfg,
        base,
        baseline_order(run, base, common - failed, common),
        lambda mine: {i: mine[i] - theirs[i] for i in mine},
        VERDICT_SCORES["judge"],
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
    judging = None
    if cfg.verdict == "sequential" and cfg.verdict_score == "judge":
        images = store.dataset_ids(shard_paths(store, manifest))
        judging = judge_score_judging(cfg, store, run, images, caption_failures(store, run), judge, engine)
    verdict = judging.verdict if judging else None
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
        # a rerun or resume (or the captioning's pass, judging alongside) continues the same order's prefix
        if not (judging and judging.resume(store)) and set(captions) - done:
            passes = judge_passes(
                cfg, manifest, judge, engine, ledger, set(captions), done, judge_task(captions),
                order=verdict.order if verdict else None, stop=judging.observe if judging else None,
            )  # fmt: skip
    scores = store.read_unique(store.ls(*base, SCORES, suffix=".parquet"))
    rows = scores.to_pylist() if scores is not None else []
    values = [r["score"] for r in rows]
    failed = len(captions) - len(rows)
    if verdict is not None:  # the captions whose judgements failed for good leave its order: the rest decides
        verdict.finish(set(verdict.order) - {r["image_id"] for r in rows})
    if verdict and verdict.stopped_early:  # captions it did not need judged are not failures: the last pass's are
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


@dataclass(frozen=True)
class JudgeTask:
    """What a judge is asked, through structured output (``regex``, greedy, at most ``max_tokens``): ``request(row,
    image_prompt=, sampling=, grid=)`` builds each request from a dataset row, ``out(row, attempt=)`` parses the
    answer, ``fixed(row, attempt=)`` gives error rows the ledger's ``schema``. ``fan_out(pending)``, for results
    that are not one per image (pairwise: two orders, ``<image_id>#ab|#ba``), gives the images to read and the
    row -> rows function that makes each image's pending requests."""

    regex: str
    max_tokens: int
    request: Callable
    out: Callable
    fixed: Callable
    schema: pa.Schema
    fan_out: Optional[Callable[[list[str]], tuple[list[str], Callable]]] = None


def judge_processor(
    cfg: RunConfig,
    judge: ResolvedModel,
    engine: EngineSettings,
    task: JudgeTask,
    judge_path: str,
    attempt: int,
    rows: int,
    ordered: bool,
    after_captions: Optional[str] = None,
    warm=None,
):
    """The Ray Data LLM processor of one judge pass over ``rows`` requests (the judge loaded from ``judge_path``:
    the checkpoint, or its staged slot); ``after_captions`` (the captioning checkpoint's fingerprint): the rows
    are a captioner's results in the same pass (``SequentialJudging``); ``warm``: the warm engine service's judge
    engines judge them (``WarmEngine.judge_engines``)."""
    sampling = {
        "max_tokens": task.max_tokens,
        "temperature": 0.0,
        "seed": cfg.seed,
        "structured_outputs": {"regex": task.regex},
    }
    request = functools.partial(
        task.request, image_prompt=image_prompt(judge.path), sampling=sampling, grid=engine.image_grid
    )
    out = functools.partial(task.out, attempt=attempt)
    if after_captions is not None:
        request = functools.partial(judged_request, request=request)
        out = functools.partial(judged_out, out=task.out, attempt=attempt, pairs=task.fan_out is not None)
    return build_vlm_processor(
        engine, judge_path, preprocess=request, postprocess=out, warm=warm, rows=rows, ordered=ordered
    )


def judge_passes(
    cfg: RunConfig,
    manifest: Manifest,
    judge: ResolvedModel,
    engine: EngineSettings,
    ledger: Ledger,
    todo: set[str],
    done: set[str],
    task: JudgeTask,
    order: Optional[list[str]] = None,
    stop: Optional[Callable[[list[dict]], bool]] = None,
) -> list[PassResult]:
    """The passes of a judge (``task``) over ``todo``, on the warm engine service's judge engines where they hold
    this judge (``service.for_judge``), else on engines of their own. ``order`` and ``stop``: a sequential
    verdict's (``run_passes``): the images go to the engines in that order, and the pass ends once ``stop`` says
    so."""
    local = ray_session(cfg).started_here
    store = ledger.store
    shards = shard_paths(store, manifest)
    fitted = fitted_folder(cfg, store, manifest, engine)
    map_kwargs = map_task_kwargs(engine)

    def rows_for(attempt: int, pending: list[str], judge_path: str, warm):
        processor = judge_processor(
            cfg, judge, engine, task, judge_path, attempt, len(pending), order is not None, warm=warm
        )
        images, expand = task.fan_out(pending) if task.fan_out else (pending, None)
        columns = ["image_id", "image", "references"]
        engines = len(warm.apps) if warm is not None else None
        ds = read_pending(
            store.fs, shards, columns, images, engine, fitted, ordered=order is not None, engines=engines,
            shard_ids=store.shard_ids(shards),
        )  # fmt: skip
        if expand:
            ds = ds.flat_map(expand, **map_kwargs)
        return processor(ds).map(functools.partial(task.fixed, attempt=attempt), **map_kwargs)

    with (
        service.for_judge(cfg, judge, engine) as warm,
        staged(judge.path, engine.compile_dir, local=local and warm is None) as path,
    ):
        rows = functools.partial(rows_for, judge_path=path, warm=warm)
        return run_passes(ledger, todo, done, cfg.row_retries, rows, order=order, stop=stop)


@dataclass
class SequentialJudging(Consumer):
    """The judging of a sequential verdict on the judge's score or the pairwise win (``verdict_score judge |
    pairwise``): the ``verdict``, the folder its judgements commit to (``parts``, the judge or pairwise stage's)
    and how committed judgement rows become its values (``values``). The judge or pairwise stage feeds it its
    passes' rows (``observe``); where it can (``alongside``: engines started for the run, or the warm engine service's
    judge engines holding this judge), it is the caption pass's consumer (``caption_pass.Consumer``): the judge
    judges each caption as it comes out of the captioner's engines, in the captioning's own Ray Data job (``after``),
    the judgement commits beside the caption (``side``), and once the verdict is in the captioning stops too, not
    only the judging; the stage after it then finds the judgements committed and the same verdict in
    (``resume``, as a rerun or a resume does)."""

    judge: ResolvedModel
    engine: EngineSettings
    verdict: PrefixVerdict
    parts: tuple[str, ...]
    what: str
    values: Callable[[list[dict]], dict]
    task: JudgeTask  # what the judge is asked alongside the captioning (of the row's caption)

    judged = True

    def resume(self, store: Store, run: tuple[str, ...] = ()) -> bool:
        """Feed the verdict the judgements already committed to its folder (a rerun, a resume, the captioning's
        pass having judged alongside); True once it is in."""
        t = store.read_unique(store.ls(*self.parts, SCORES, suffix=".parquet"))
        return self.verdict.observe(self.values(t.to_pylist() if t is not None else []))

    def observe(self, rows: list[dict]) -> bool:
        """A block of judgement rows as they come (``run_passes``' stop); True once the verdict is in."""
        return self.verdict.observe(self.values(rows))

    @contextlib.contextmanager
    def beside(self, cfg: RunConfig, store: Store, warm, engine: EngineSettings, local: bool):
        """The judge beside the captioner for one caption pass: the warm engine service's judge engines where the
        captions come from warm engines (None, said in the log, where they do not hold this judge: the run then
        captions the full set and the judge stage's judging stops once sure), else half of each GPU's engines
        (``EngineSettings.halved``: the captioner's settings given back) or, on CPU, engines beside the
        captioner's; its folder's lease held (``side``: its ledger) and its checkpoint staged like the captioner's."""
        why = warm.judges(self.judge, self.engine) if warm is not None else None
        if why:
            log.info("verdict sequential on the %s: %s, so warm engines caption the full set and the judging "
                     "stops once sure", self.what, why)  # fmt: skip
            yield None
            return
        if warm is not None:
            log.info("verdict sequential on the %s: the warm engine service's judge engines judge the captions as "
                     "they are made", self.what)  # fmt: skip
        elif engine.preset.engine_gpus:  # half of each GPU's engines the captioner's, half the judge's
            engine, self.engine = engine.halved(), self.engine.halved()
        what = f"the {self.what} folder {store.url(*self.parts)}"
        with Lease(store, "/".join(self.parts), what=what, wait_s=cfg.lease_wait_s) as lease:
            self.side = Ledger(store, self.parts, SCORES, self.task.schema, cfg.commit_rows, lease=lease,
                               stall_timeout_s=cfg.stall_timeout_s, what=self.what)  # fmt: skip
            slot = contextlib.nullcontext(self.judge.path) if warm is not None else staged(
                self.judge.path, self.engine.compile_dir, local
            )  # fmt: skip
            with slot as self.judge_path:
                try:
                    yield engine
                finally:
                    self.side = None

    def after(self, captions, cfg: RunConfig, attempt: int, rows: int, model_fp: str):
        """The pass's result rows: ``captions`` (the captioner's rows, ``to_judged_caption``) judged by the judge
        loaded from ``judge_path`` (``beside``); warm captions (``feed.WarmRows``) by the warm engine service's
        judge engines, as they are made."""
        map_kwargs = map_task_kwargs(self.engine)
        pairs = self.task.fan_out is not None
        fixed = functools.partial(
            judged_fixed_schema, fixed=self.task.fixed, model_fp=model_fp, attempt=attempt, pairs=pairs
        )
        n = rows * (2 if pairs else 1)
        judge_path = self.judge_path
        if isinstance(captions, WarmRows):
            judges = captions.warm.judge_engines()
            processor = judge_processor(cfg, self.judge, self.engine, self.task, judge_path, attempt, n, True,
                                        model_fp, warm=judges)  # fmt: skip
            return captions.then(processor.processor, both_orders if pairs else None).map(fixed)
        if pairs:
            captions = captions.flat_map(both_orders, **map_kwargs)
        processor = judge_processor(cfg, self.judge, self.engine, self.task, judge_path, attempt, n, True, model_fp)
        return processor(captions).map(fixed, **map_kwargs)


def alongside(
    cfg: RunConfig, engine: EngineSettings, judge: Optional[ResolvedModel], judge_engine: Optional[EngineSettings]
) -> Optional[str]:
    """Why a judge verdict's judge cannot run alongside the captioning (``SequentialJudging``), or None where it can:
    the judge's image grid the captioner's (the judge takes the captioner's image arrays), and on GPUs room for
    both: each layout at least two engines on each GPU, so that half of each GPU's can be the captioner's and half
    the judge's (``EngineSettings.halved``)."""
    if judge is None or judge_engine is None:
        return "no judge"
    gpus = engine.preset.engine_gpus or judge_engine.preset.engine_gpus
    if gpus and min(engine.engines_per_gpu, judge_engine.engines_per_gpu) < 2:
        return "a GPU holds only one engine of the captioner or of the judge, so they cannot share the GPUs"
    if judge_engine.image_grid != engine.image_grid:
        return "the judge's image grid is not the captioner's"
    return None


def judge_score_judging(
    cfg: RunConfig,
    store: Store,
    run: tuple[str, ...],
    images: set[str],
    failed: set[str],
    judge: ResolvedModel,
    engine: EngineSettings,
) -> Optional[SequentialJudging]:
    """The judging of the judge's 1-5 score verdict (``judge_verdict``) over ``images``; None while there is no
    baseline yet (said in the log)."""
    verdict = judge_verdict(cfg, store, run, judge, engine, images, failed)
    if verdict is None:
        return None
    task = judge_task(None)
    values = lambda rows: {r["image_id"]: r["score"] for r in rows if not r["error"]}
    return SequentialJudging(judge, engine, verdict, judge_run_parts(run, judge, engine), "judge", values, task)


def judge_task(captions: Optional[dict]) -> JudgeTask:
    """The 1-5 score of each caption (``captions``: image id -> caption; None: the row's, alongside captioning)."""
    return JudgeTask(
        regex=JUDGE_REGEX,
        max_tokens=JUDGE_MAX_TOKENS,
        request=functools.partial(judge_request, captions=captions),
        out=judge_out,
        fixed=judge_fixed_schema,
        schema=JUDGE_SCHEMA,
    )
