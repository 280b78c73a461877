"""Stage 4, evaluate: caption statistics, reference metrics, per-image scores, a report and a leaderboard row."""

from __future__ import annotations

import time
from typing import Optional

import pyarrow as pa

from captionflow.caption_health import caption_health
from captionflow.layout import CAPTIONS, SCORES, shard_paths
from captionflow.metrics import length_stats, reference_metrics
from captionflow.report import render_report, update_leaderboard
from captionflow.results import EvalResult, InferenceResult, JudgeResult, Manifest
from captionflow.significance import PER_IMAGE, paired_bootstrap
from captionflow.storage import Store


def evaluate(
    output: str,
    manifest: Manifest,
    inference: InferenceResult,
    model_source: str,
    judge: Optional[JudgeResult] = None,
    coco_java: bool = False,
    bootstrap_resamples: int = 1000,
    prompts: tuple[str, ...] = (),
) -> EvalResult:
    """Score the captions of one run; write scores.parquet, metrics.json, report.md; update the leaderboard."""
    t0 = time.perf_counter()
    store = Store(output)
    run = tuple(inference.run_parts)
    data = store.read_tables(shard_paths(store, manifest), columns=["image_id", "source", "references"])
    refs = dict(zip(data["image_id"].to_pylist(), data["references"].to_pylist())) if data else {}
    sources = dict(zip(data["image_id"].to_pylist(), data["source"].to_pylist())) if data else {}
    caps_t = store.read_unique(store.ls(*run, CAPTIONS, suffix=".parquet"))
    rows = caps_t.to_pylist() if caps_t is not None else []
    captions = {r["image_id"]: r["caption"] for r in rows}
    stats = length_stats([r["caption"] for r in rows], [r["finish_reason"] for r in rows], inference.failed)
    ref_agg, ref_per = reference_metrics(captions, refs, java=coco_java)
    metrics = {"stats": stats, "health": caption_health(rows, prompts), "reference": ref_agg}
    judged: dict[str, dict] = {}
    if judge:
        metrics["judge"] = judge.headline()
        jt = store.read_unique(store.ls(*judge.judge_parts, SCORES, suffix=".parquet"))
        judged = {r["image_id"]: r for r in jt.to_pylist()} if jt is not None else {}
    scores = pa.Table.from_pylist(
        [
            {
                "image_id": r["image_id"],
                "source": sources.get(r["image_id"], ""),
                "caption": r["caption"],
                "references": refs.get(r["image_id"], []),
                "finish_reason": r["finish_reason"],
                "num_output_tokens": r["num_output_tokens"],
                **{k: ref_per.get(r["image_id"], {}).get(k) for k in ("bleu_4", "rouge_l", "cider")},
                "judge_score": judged.get(r["image_id"], {}).get("score"),
                "judge_reason": judged.get(r["image_id"], {}).get("reason"),
            }
            for r in sorted(rows, key=lambda r: r["image_id"])
        ]
    )
    store.write_table(scores, *run, "scores.parquet")
    score_rows = scores.to_pylist()
    metrics["comparison"] = update_leaderboard(store, manifest.dataset_fingerprint, run, model_source, metrics)
    if bootstrap_resamples:
        add_significance(metrics["comparison"], score_rows, bootstrap_resamples)
    store.write_json(metrics, *run, "metrics.json")
    store.write_text(render_report(model_source, manifest, inference, metrics, score_rows), *run, "report.md")
    return EvalResult(metrics=metrics, report=store.url(*run, "report.md"), seconds=round(time.perf_counter() - t0, 2))


def per_image(rows: list[dict]) -> dict[str, dict]:
    """image id -> its per-image scores under the leaderboard's metric names."""
    return {r["image_id"]: {m: r.get(col) for m, col in PER_IMAGE.items()} for r in rows}


def add_significance(comparison: dict, rows: list[dict], n_resamples: int) -> None:
    """A paired bootstrap (captionflow/significance.py) against each run the comparison names, from that
    run's scores.parquet; a run whose scores cannot be read gets the reason instead."""
    mine = per_image(rows)
    for label in ("previous", "best_so_far"):
        other = comparison.get(label)
        if not other:
            continue
        try:
            theirs = Store(other["run_dir"])
            table = theirs.read_table(theirs.path("scores.parquet"))
        except (OSError, ValueError) as e:
            other["significance"] = {"error": f"cannot read {other['run_dir']}/scores.parquet: {e}"}
            continue
        other["significance"] = paired_bootstrap(mine, per_image(table.to_pylist()), n_resamples=n_resamples)
