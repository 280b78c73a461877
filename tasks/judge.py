"""Optional LLM-as-judge pass: a VLM scores each caption against its image (and references) from 1 to 5.

The answer is constrained with vLLM structured outputs to a regular expression whose every match
is valid JSON of bounded length (a score digit 1-5 and a reason of at most 80 plain characters),
and ``max_tokens`` leaves room for the longest match. So every answer parses, even from the tiny
random built-in model. Rows the engine rejects are recorded with their error in
``judge/<judge-fp>/failures`` and never counted as judged; the pass is resumable like captioning.
"""

from __future__ import annotations

import functools
import time

from prefect import task

from captionflow.config import RunConfig
from captionflow.fingerprint import digest
from captionflow.llm_rows import (JUDGE_MAX_TOKENS, JUDGE_REGEX, JUDGE_SCHEMA, JUDGE_SYSTEM, judge_fixed_schema,
                                  judge_out, judge_prompt, judge_request)
from captionflow.model_source import ResolvedModel
from captionflow.retry import retry_transient
from captionflow.storage import Store
from tasks.preprocess import shard_paths
from tasks.inference import (build_vlm_processor, choose_preset, ids_in, init_ray, map_task_kwargs, read_pending,
                             stream_and_commit)

def judge_paths(run_parts: list[str], judge: ResolvedModel) -> tuple[str, ...]:
    fp = digest({"model": judge.fingerprint, "regex": JUDGE_REGEX, "system": JUDGE_SYSTEM,
                 "prompt": judge_prompt("{caption}", ["{reference}"])})
    return (*run_parts, "judge", fp)


def run_judge(cfg: RunConfig, manifest: dict, inference: dict, judge: ResolvedModel) -> dict:
    """Judge every captioned row not judged yet; returns counts, parse rate and the mean score."""
    t0 = time.perf_counter()
    store = Store(cfg.output)
    run = list(inference["run_parts"])
    base = judge_paths(run, judge)
    caps = store.read_tables(store.ls(*run, "captions", suffix=".parquet"), columns=["image_id", "caption"])
    captions = dict(zip(caps["image_id"].to_pylist(), caps["caption"].to_pylist())) if caps is not None else {}
    done = ids_in(store, store.ls(*base, "scores", suffix=".parquet"))
    shards = shard_paths(store, manifest)
    passes = []
    for attempt in range(cfg.row_retries + 1):
        pending = sorted(set(captions) - done)
        if not pending:
            break
        init_ray(cfg)
        preset = choose_preset(cfg)
        ds = read_pending(store, shards, ["image_id", "image", "references"], pending, preset,
                          cfg.batch_size or preset.batch_size)
        sampling = {"max_tokens": JUDGE_MAX_TOKENS, "temperature": 0.0, "seed": cfg.seed,
                    "structured_outputs": {"regex": JUDGE_REGEX}}
        processor = build_vlm_processor(
            cfg, judge, preset,
            preprocess=functools.partial(judge_request, captions=captions, sampling=sampling),
            postprocess=functools.partial(judge_out, attempt=attempt),
        )
        out = processor(ds).map(functools.partial(judge_fixed_schema, attempt=attempt), **map_task_kwargs(preset))
        n_ok, n_failed, _ = stream_and_commit(out, store, base, ("scores", "failures"), JUDGE_SCHEMA, done,
                                              cfg.commit_rows)
        passes.append({"attempt": attempt, "sent": len(pending), "judged": n_ok, "failed": n_failed})
    scores = store.read_tables(store.ls(*base, "scores", suffix=".parquet"))
    rows = scores.to_pylist() if scores is not None else []
    failures = store.read_tables(store.ls(*base, "failures", suffix=".parquet"))
    n_unparsed = sum(1 for r in failures.to_pylist() if r["error"].startswith("unparseable")) if failures else 0
    values = [r["score"] for r in rows]
    return {
        "judge_model": judge.source, "judge_dir": store.url(*base), "judge_parts": list(base), "judged": len(rows),
        "failed": len(captions) - len(rows),
        "parse_rate": len(rows) / (len(rows) + n_unparsed) if rows or n_unparsed else 0.0,
        "mean_score": sum(values) / len(values) if values else None,
        "distribution": {str(k): values.count(k) for k in range(1, 6)},
        "passes": passes, "seconds": round(time.perf_counter() - t0, 2),
    }


judge_task = task(name="judge", retries=1, retry_delay_seconds=[10], retry_condition_fn=retry_transient)(run_judge)
