"""A run's caption pass: one object owns it, from the run folder's lease to the result.

    CaptionPass(cfg, manifest, model, engine, progress).run(consumer)
      hold the run folder (lease) -> run.json -> the ledger: what is committed, what other folders' runs of the same
      checkpoint and settings captioned (reused) -> the consumer resumes from what is committed
      -> engines: the warm engine service's (``service.hold.for_run``) or the run's own, the checkpoint staged
      -> passes (``runs.ledger.run_passes``): caption blocks as they come, committed by the ledger and handed to the
         consumer, in its order, until it has what it needs -> the result (``InferenceResult``)

The consumer (``Consumer``) is what takes the captions as they come, beside the ledger's commits: the sequential
verdict on CIDEr-D or CLIPScore (``CaptionVerdict``), or the judge beside the captioner, judging each caption in the
same pass for a verdict on the judge's score or the pairwise win (``judge.SequentialJudging``). The stage
(``inference.run_inference``) only says which.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from captionflow.config import RunConfig
from captionflow.data.fingerprint import generation_fingerprint
from captionflow.data.layout import CAPTIONS, read_captions, run_parts, shard_paths
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.engines.engine import EngineSettings
from captionflow.engines.processor import build_vlm_processor, fitted_folder, map_task_kwargs, read_pending
from captionflow.engines.request_format import image_prompt
from captionflow.engines.session import ray_session
from captionflow.engines.staging import staged
from captionflow.errors import RowsFailed
from captionflow.evaluation.sequential import PrefixVerdict, verdict_line
from captionflow.model_source import ResolvedModel
from captionflow.results import InferenceResult, Manifest
from captionflow.runs.ledger import Ledger, Progress, run_passes
from captionflow.service import hold
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


class Consumer:
    """What takes a caption pass's results as they come, beside the ledger's commits, and may end the pass: its
    ``verdict`` (a sequential one) orders the images and, once in, ends the pass.

    ``resume`` feeds it what is committed already (a rerun, a resume); ``beside`` holds what it needs for one
    pass (its own folder, engines beside the captioner's) and gives the captioner's engine settings with it there,
    or None where it cannot take this pass's captions (the pass then goes on without it); ``after`` extends the
    pass's rows (a judge beside the captioner: ``judged``, each row then carries its result for ``side``);
    ``observe`` takes each block of result rows, True once it has what it needs; ``finish`` the images that failed
    for good."""

    verdict: PrefixVerdict
    judged = False  # each caption goes on to a judge in the same pass (``after``), the rows carry its result
    side: Optional[Ledger] = None  # where the results of ``after`` commit, right after each caption commit

    def resume(self, store: Store, run: tuple[str, ...]) -> bool:
        raise NotImplementedError

    @contextlib.contextmanager
    def beside(self, cfg: RunConfig, store: Store, warm, engine: EngineSettings, local: bool):
        yield engine

    def after(self, rows, cfg: RunConfig, attempt: int, n: int, model_fp: str):
        raise NotImplementedError

    def observe(self, rows: list[dict]) -> bool:
        raise NotImplementedError

    def finish(self, failed: set[str]) -> None:
        self.verdict.finish(failed)


class CaptionVerdict(Consumer):
    """The sequential verdict on the captions themselves (CIDEr-D, CLIPScore: ``inference.sequential_verdict``)."""

    def __init__(self, verdict: PrefixVerdict):
        self.verdict = verdict

    def resume(self, store: Store, run: tuple[str, ...]) -> bool:
        return self.verdict.observe(read_captions(store, run))  # a rerun or resume continues the same prefix

    def observe(self, rows: list[dict]) -> bool:
        return self.verdict.observe({r["image_id"]: r["caption"] for r in rows})


class CaptionPass:
    """One run's captioning of the dataset's accepted images not captioned yet, on the warm engine service's engines
    or engines of its own, committed by the ledger as they come and handed to a ``Consumer``. ``store``, ``run``,
    ``shards``, ``ids``: the output root, the run folder's parts, the dataset's shards and image ids (what a
    consumer is built from)."""

    def __init__(
        self,
        cfg: RunConfig,
        manifest: Manifest,
        model: ResolvedModel,
        engine: EngineSettings,
        progress: Optional[Progress] = None,
    ):
        self.cfg, self.manifest, self.model, self.engine, self.progress = cfg, manifest, model, engine, progress
        self.store = Store(cfg.output)
        self.run = caption_run_parts(cfg, manifest, model, engine)
        self.shards = shard_paths(self.store, manifest)
        self.ids = self.store.dataset_ids(self.shards)
        self.timings: dict[str, float] = {}
        self.engines = "per-run"

    def run_with(self, consumer: Callable[[CaptionPass], Optional[Consumer]] = lambda p: None) -> InferenceResult:
        """Caption what is left; ``consumer(self)``, called once the pass holds its folder (it sees the folder as it
        is), gives what takes the captions as they come (or None). Rows that still failed after every pass are
        counted; more than ``max_failure_rate`` of them raises RowsFailed (with the result)."""
        t_start = time.perf_counter()
        store, run = self.store, self.run
        passes = []
        with self.lease() as lease:
            ledger, done, resumed_from, reused = self.open(lease)
            if self.progress:  # the folder is ours: an earlier attempt on it that did not finish is over
                self.progress(len(done & self.ids), len(done & self.ids), len(self.ids), 0.0)
            taker = consumer(self)
            if taker is not None and taker.resume(store, run) and taker.judged:
                log.info("the %s's sequential verdict is in from the judgements committed", taker.what)
            if self.ids - done and not (taker and taker.verdict.decided):
                passes = self._passes(ledger, done, taker)
            self.timings["inference_s"] = round(time.perf_counter() - t_start, 2)
        if taker is not None and not taker.judged:  # the captions that failed for good leave its order
            taker.finish(self.ids - done)
            log.info("sequential verdict: %s", verdict_line(taker.verdict.record()))
        elif taker is not None and taker.verdict.decided:
            log.info("captioning stopped, the %s's sequential verdict is in: %s", taker.what,
                     verdict_line(taker.verdict.record()))  # fmt: skip
        return self._result(passes, done, resumed_from, reused, taker)

    def lease(self) -> Lease:
        """The run folder's lease: one writer at a time."""
        what = f"the run folder {self.store.url(*self.run)}"
        return Lease(self.store, "/".join(self.run), what=what, wait_s=self.cfg.lease_wait_s)

    def open(self, lease: Lease) -> tuple[Ledger, set[str], int, int]:
        """The run folder, held (``lease``): its run.json written, its ledger, the images committed (those of other
        folders' runs of the same checkpoint and settings committed here first), how many of them were committed
        before and how many reused."""
        store, run, cfg = self.store, self.run, self.cfg
        self._write_run_json()
        ledger = Ledger(store, run, CAPTIONS, CAPTION_SCHEMA, cfg.commit_rows, lease=lease,
                        stall_timeout_s=cfg.stall_timeout_s, what="inference")  # fmt: skip
        done = ledger.committed()
        resumed_from = len(done & self.ids)
        reused = self._reuse(ledger, self.ids - done, done)
        return ledger, done, resumed_from, reused

    def request(self, attempt: int, engine: EngineSettings, judged: bool = False) -> Callable[[dict], dict]:
        """The preprocess of a pass: an image row as the request ``engine`` gets (``caption_request``)."""
        cfg, model = self.cfg, self.model
        inject = frozenset(x for x in os.environ.get(INJECT_ENV, "").split(",") if x)
        return functools.partial(
            caption_request,
            image_prompt=image_prompt(model.path),
            system_prompt=cfg.system_prompt,
            prompt=cfg.prompt,
            sampling={
                "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
                "seed": cfg.seed,
                "ignore_eos": cfg.ignore_eos,
            },
            fail_ids=inject if attempt == 0 else frozenset(),
            grid=engine.image_grid,
            judged=judged,
            adapter=model.adapter.path if model.adapter else None,
        )

    def _write_run_json(self) -> None:
        model, engine = self.model, self.engine
        self.store.write_json(
            {
                "model": model.source,
                "model_path": model.path,
                "model_fingerprint": model.fingerprint,
                "architecture": model.architecture,
                "dataset_fingerprint": self.manifest.dataset_fingerprint,
                "generation": self.cfg.generation_params(),
                "engine": engine.output_params(),
                "engine_kwargs": engine.engine_kwargs,
            },
            *self.run,
            "run.json",
        )

    def _reuse(self, ledger: Ledger, pending: set[str], done: set[str]) -> int:
        """Commit, as they are, the captions of ``pending`` images found in other run folders of the same checkpoint
        and generation settings (other datasets); returns how many."""
        store, run = self.store, self.run
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

    def _passes(self, ledger: Ledger, done: set[str], taker: Optional[Consumer]):
        """The passes over what is left, on the engines: the warm engine service's, else the run's own."""
        cfg, model = self.cfg, self.model
        t0 = time.perf_counter()
        local = ray_session(cfg).started_here
        self.timings["ray_init_s"] = round(time.perf_counter() - t0, 2)
        with hold.for_run(cfg, model, self.engine) as warm, contextlib.ExitStack() as stack:
            engine = self.engine
            if taker is not None:
                engine = stack.enter_context(taker.beside(cfg, self.store, warm, engine, local))
                if engine is None:  # it cannot take this pass's captions (it said why)
                    taker, engine = None, self.engine
            with staged(model.path, engine.compile_dir, local=local and warm is None) as path:
                rows_for = self._rows(path, engine, warm, taker)
                passes = run_passes(
                    ledger, self.ids, done, cfg.row_retries, rows_for, self.progress,
                    order=taker.verdict.order if taker else None,
                    stop=taker.observe if taker else None,
                    side=taker.side if taker else None,
                )  # fmt: skip
            if warm is not None:
                warm.wait()
                self.engines = f"warm ({warm.how})"
                self.timings["warm_engine_s"] = warm.seconds
        return passes

    def _rows(self, model_path: str, engine: EngineSettings, warm, taker: Optional[Consumer]):
        """``rows_for(attempt, pending)``: the Ray dataset of caption rows for one pass; the engines load
        ``model_path`` (the checkpoint, or its staged slot: staging.py); with a ``taker`` the rows go to the engines
        in its verdict's order, and where it is ``judged`` each caption goes on to its judge in the same pass (each
        row with its judgement: ``Ledger.drain``'s side)."""
        cfg, model, store, shards = self.cfg, self.model, self.store, self.shards
        fitted = fitted_folder(cfg, store, self.manifest, engine)
        judged = taker is not None and taker.judged

        def rows_for(attempt: int, pending: list[str]):
            processor = build_vlm_processor(
                engine,
                model_path,
                preprocess=self.request(attempt, engine, judged),
                postprocess=functools.partial(
                    to_judged_caption if judged else to_caption,
                    max_tokens=cfg.max_tokens,
                    model_fp=model.fingerprint,
                    attempt=attempt,
                ),
                warm=warm,
                rows=len(pending),
                ordered=taker is not None,
            )
            columns = ["image_id", "image", "references"] if judged else ["image_id", "image"]
            ds = read_pending(
                store.fs, shards, columns, pending, engine, fitted, ordered=taker is not None,
                engines=len(warm.apps) if warm is not None else None,  # the first window: a batch for each engine
                shard_ids=store.shard_ids(shards),
            )  # fmt: skip
            if judged:
                return taker.after(processor(ds), cfg, attempt, len(pending), model.fingerprint)
            return processor(ds).map(
                functools.partial(caption_fixed_schema, model_fp=model.fingerprint, attempt=attempt),
                **map_task_kwargs(engine),
            )

        return rows_for

    def _result(self, passes, done: set[str], resumed_from: int, reused: int, taker: Optional[Consumer]):
        cfg, ids = self.cfg, self.ids
        captioned = len(done & ids)
        result = InferenceResult(
            run_dir=self.store.url(*self.run),
            run_parts=self.run,
            accepted=len(ids),
            captioned=captioned,
            failed=len(ids) - captioned,
            resumed_from=resumed_from,
            passes=passes,
            timings_s=self.timings,
            reused=reused,
            engines=self.engines,
            verdict=taker.verdict.record() if taker is not None and not taker.judged else None,
        )
        if taker is not None and taker.verdict.stopped_early:
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
