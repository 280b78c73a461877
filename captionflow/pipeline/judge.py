"""The optional LLM-as-judge pass: a VLM scores each caption against its image (and references) from 1 to 5.

The answer is constrained with vLLM structured outputs to a regular expression whose every match is
valid JSON of bounded length (a score digit 1-5 and a reason of at most 80 plain characters), and
``max_tokens`` leaves room for the longest match, so every answer parses, even the tiny random
built-in model's. Rows the engine rejects are recorded with their error in ``judge/<judge-fp>/failures``
and never counted as judged; the pass resumes like captioning (the same ledger, lease and pass loop).
"""

from __future__ import annotations

import functools
import time

from captionflow.config import RunConfig
from captionflow.fingerprint import digest
from captionflow.layout import CAPTIONS, FAILURES, SCORES, judge_parts, shard_paths
from captionflow.lease import Lease
from captionflow.model_source import ResolvedModel
from captionflow.pipeline.engine import EngineSettings
from captionflow.pipeline.ledger import Ledger, run_passes
from captionflow.pipeline.processor import build_vlm_processor, map_task_kwargs, read_pending
from captionflow.pipeline.session import ray_session
from captionflow.pipeline.staging import staged
from captionflow.results import InferenceResult, JudgeResult, Manifest
from captionflow.storage import Store
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


def judge_run_parts(run: tuple[str, ...], judge: ResolvedModel, engine: EngineSettings) -> tuple[str, ...]:
    """Where one judge's scores of one run go: keyed on the judge checkpoint, its settings and its prompt."""
    fp = digest(
        {
            "model": judge.fingerprint,
            "engine": engine.output_params(),
            "regex": JUDGE_REGEX,
            "system": JUDGE_SYSTEM,
            "prompt": judge_prompt("{caption}", ["{reference}"]),
        }
    )
    return judge_parts(run, fp)


def run_judge(
    cfg: RunConfig, manifest: Manifest, inference: InferenceResult, judge: ResolvedModel, engine: EngineSettings
) -> JudgeResult:
    """Judge every captioned row not judged yet; returns counts, parse rate and the mean score."""
    t0 = time.perf_counter()
    store = Store(cfg.output)
    run = tuple(inference.run_parts)
    base = judge_run_parts(run, judge, engine)
    caps = store.read_unique(store.ls(*run, CAPTIONS, suffix=".parquet"), columns=["image_id", "caption"])
    captions = dict(zip(caps["image_id"].to_pylist(), caps["caption"].to_pylist())) if caps is not None else {}
    passes = []
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
        if set(captions) - done:
            passes = _judge_passes(cfg, manifest, judge, engine, store, ledger, captions, done)
    scores = store.read_unique(store.ls(*base, SCORES, suffix=".parquet"))
    rows = scores.to_pylist() if scores is not None else []
    failures = store.read_tables(store.ls(*base, FAILURES, suffix=".parquet"))
    n_unparsed = sum(1 for r in failures.to_pylist() if r["error"].startswith("unparseable")) if failures else 0
    values = [r["score"] for r in rows]
    return JudgeResult(
        judge_model=judge.source,
        judge_dir=store.url(*base),
        judge_parts=base,
        judged=len(rows),
        failed=len(captions) - len(rows),
        parse_rate=len(rows) / (len(rows) + n_unparsed) if rows or n_unparsed else 0.0,
        mean_score=sum(values) / len(values) if values else None,
        distribution={str(k): values.count(k) for k in range(1, 6)},
        passes=passes,
        seconds=round(time.perf_counter() - t0, 2),
    )


def _judge_passes(
    cfg: RunConfig,
    manifest: Manifest,
    judge: ResolvedModel,
    engine: EngineSettings,
    store: Store,
    ledger: Ledger,
    captions: dict[str, str],
    done: set[str],
):
    local = ray_session(cfg).started_here
    shards = shard_paths(store, manifest)
    sampling = {
        "max_tokens": JUDGE_MAX_TOKENS,
        "temperature": 0.0,
        "seed": cfg.seed,
        "structured_outputs": {"regex": JUDGE_REGEX},
    }

    def rows_for(attempt: int, pending: list[str], judge_path: str):
        processor = build_vlm_processor(
            engine,
            judge_path,
            preprocess=functools.partial(judge_request, captions=captions, sampling=sampling, grid=engine.image_grid),
            postprocess=functools.partial(judge_out, attempt=attempt),
        )
        ds = read_pending(store.fs, shards, ["image_id", "image", "references"], pending, engine)
        return processor(ds).map(
            functools.partial(judge_fixed_schema, attempt=attempt), **map_task_kwargs(engine.preset)
        )

    with staged(judge.path, engine.compile_dir, local=local) as path:
        return run_passes(ledger, set(captions), done, cfg.row_retries, functools.partial(rows_for, judge_path=path))
