"""Stage 4, evaluate: caption statistics, reference metrics, per-image scores, a report and a leaderboard row."""

from __future__ import annotations

import time
from typing import Optional

import pyarrow as pa

from captionflow.data.layout import CAPTIONS, SCORES, read_captions, read_scores, shard_paths
from captionflow.data.storage import Store
from captionflow.evaluation.caption_health import caption_health
from captionflow.evaluation.metrics import length_stats, reference_metrics
from captionflow.evaluation.pairwise_scores import length_bias, pairwise_per_image, score_by_length
from captionflow.evaluation.significance import PER_IMAGE, paired_bootstrap
from captionflow.evaluation.slices import slice_metrics, slices_of
from captionflow.evaluation.tokens import caption_words
from captionflow.report.html import chart_png, render_html, side_by_side, thumbnails
from captionflow.report.markdown import read_leaderboard, render_report, update_leaderboard
from captionflow.results import ClipResult, EvalResult, InferenceResult, JudgeResult, Manifest, PairwiseResult


def evaluate(
    output: str,
    manifest: Manifest,
    inference: InferenceResult,
    model_source: str,
    judge: Optional[JudgeResult] = None,
    coco_java: bool = False,
    bootstrap_resamples: int = 1000,
    prompts: tuple[str, ...] = (),
    report_images: int = 200,
    pairwise: Optional[PairwiseResult] = None,
    clip: Optional[ClipResult] = None,
    deadline: Optional[dict] = None,
) -> EvalResult:
    """Score the captions of one run; write scores.parquet, metrics.json, report.md, report.html and
    chart.png; update the leaderboard. ``deadline``: the run's deadline outcome so far (``Deadline.outcome``),
    kept in the metrics and the leaderboard row."""
    t0 = time.perf_counter()
    store = Store(output)
    run = tuple(inference.run_parts)
    sliced = bool(manifest.params.get("slice_column"))
    columns = ["image_id", "source", "references", *(["slice"] if sliced else [])]
    data = store.read_tables(shard_paths(store, manifest), columns=columns)
    ids = data["image_id"].to_pylist() if data else []
    refs = dict(zip(ids, data["references"].to_pylist())) if data else {}
    sources = dict(zip(ids, data["source"].to_pylist())) if data else {}
    slices = slices_of(manifest.kind, sources, dict(zip(ids, data["slice"].to_pylist())) if sliced and data else None)
    caps_t = store.read_unique(store.ls(*run, CAPTIONS, suffix=".parquet"))
    rows = caps_t.to_pylist() if caps_t is not None else []
    captions = {r["image_id"]: r["caption"] for r in rows}
    words = [caption_words(r["caption"]) for r in rows]  # once, for the statistics and the health checks
    stats = length_stats([r["caption"] for r in rows], [r["finish_reason"] for r in rows], inference.failed, words)
    ref_agg, ref_per = reference_metrics(captions, refs, java=coco_java)
    names = {i: src.rsplit("/", 1)[-1] for i, src in sources.items() if src}  # the examples' file names
    metrics = {"stats": stats, "health": caption_health(rows, prompts, words, names), "reference": ref_agg}
    # the sequential verdict: on the captions' scores, or on the judge's or the pairwise judge's
    verdict = inference.verdict or (judge and judge.verdict) or (pairwise and pairwise.verdict)
    if verdict:
        metrics["sequential"] = verdict
    if stopped_early(inference, judge):
        metrics["partial"] = True
    judged: dict[str, dict] = {}
    if judge:
        metrics["judge"] = judge.headline()
        jt = store.read_unique(store.ls(*judge.judge_parts, SCORES, suffix=".parquet"))
        judged = {r["image_id"]: r for r in jt.to_pylist()} if jt is not None else {}
    clipped: dict[str, float] = {}
    if clip:
        metrics["clip"] = clip.headline()
        clipped = clip_per_image(clip.clip_dir)
    if judge and judged:  # the judge's length preference beside its score
        metrics["judge"]["length"] = score_by_length(captions, {i: r.get("score") for i, r in judged.items()})
    paired: dict[str, float] = {}
    if pairwise:
        metrics["pairwise"] = pairwise.headline()
        paired = pairwise_per_image(pairwise.pairwise_dir) if pairwise.pairwise_dir else {}
        if paired and pairwise.baseline_run_dir:  # both sides' lengths, and the win rate by length difference
            theirs = read_captions(Store(pairwise.baseline_run_dir), ())
            metrics["pairwise"]["length_bias"] = length_bias(captions, theirs, paired)
    scores = pa.Table.from_pylist(
        [
            {
                "image_id": r["image_id"],
                "source": sources.get(r["image_id"], ""),
                "slice": slices.get(r["image_id"]),
                "caption": r["caption"],
                "references": refs.get(r["image_id"], []),
                "finish_reason": r["finish_reason"],
                "num_output_tokens": r["num_output_tokens"],
                **{k: ref_per.get(r["image_id"], {}).get(k) for k in ("bleu_4", "rouge_l", "cider")},
                "judge_score": judged.get(r["image_id"], {}).get("score"),
                "judge_reason": judged.get(r["image_id"], {}).get("reason"),
                "pairwise_score": paired.get(r["image_id"]),
                "clip_score": clipped.get(r["image_id"]),
            }
            for r in sorted(rows, key=lambda r: r["image_id"])
        ]
    )
    store.write_table(scores, *run, "scores.parquet")
    score_rows = scores.to_pylist()
    by_slice = slice_metrics(score_rows, slices)
    if by_slice:
        metrics["slices"] = by_slice
    if deadline:
        metrics["deadline"] = deadline
    metrics["comparison"] = update_leaderboard(store, manifest.dataset_fingerprint, run, model_source, metrics)
    compared_rows = read_compared(metrics["comparison"])
    if bootstrap_resamples:
        add_significance(metrics["comparison"], score_rows, compared_rows, bootstrap_resamples)
        if metrics.get("sequential"):
            metrics["sequential"]["bootstrap"] = bootstrap_beside_verdict(
                metrics["sequential"],
                score_rows,
                bootstrap_resamples,
                read=_compared_by_run(metrics, compared_rows),
                win=(metrics.get("pairwise") or {}).get("stats"),
            )
    store.write_json(metrics, *run, "metrics.json")
    store.write_text(render_report(model_source, manifest, inference, metrics, score_rows), *run, "report.md")
    write_html_report(store, run, manifest, model_source, metrics, score_rows, compared_rows, report_images)
    return EvalResult(
        metrics=metrics,
        report=store.url(*run, "report.md"),
        seconds=round(time.perf_counter() - t0, 2),
        report_html=store.url(*run, "report.html"),
    )


def stopped_early(inference: InferenceResult, judge: Optional[JudgeResult]) -> bool:
    """Whether a sequential verdict stopped the captioning, or the judging, before every image: the run's metrics
    are then of the order's prefix (the leaderboard marks it, and it is no other run's baseline)."""
    captions = inference.captioned + inference.failed < inference.accepted
    return captions or (judge is not None and judge.judged + judge.failed < inference.captioned)


def write_html_report(
    store: Store,
    run: tuple,
    manifest: Manifest,
    model_source: str,
    metrics: dict,
    rows: list[dict],
    compared_rows: dict[str, list[dict]],
    max_images: int,
) -> None:
    """report.html (captionflow/report/html.py) and chart.png under the run folder. The side-by-side view is
    against the previous comparable run, else the best one."""
    comp = metrics["comparison"]
    label = next((k for k in ("previous", "best_so_far") if comp.get(k) and compared_rows.get(k)), None)
    theirs = compared_rows.get(label, []) if label else []
    side = side_by_side(rows, theirs)
    ids = {r["image_id"] for r in sorted(rows, key=lambda r: r["image_id"])[:max_images]}
    ids |= {d["mine"]["image_id"] for d in side[1]}
    mine = store.url(*run)
    history = [
        r
        for r in read_leaderboard(store)
        if r["dataset_fingerprint"] == manifest.dataset_fingerprint and r["generation_fingerprint"] == run[3]
    ]
    chart = chart_png(history, mine)
    if chart:
        store.write_bytes(chart, *run, "chart.png")
    page = render_html(
        model_source,
        manifest,
        metrics,
        rows,
        thumbnails(store, manifest, ids),
        chart,
        comp.get(label) if label else None,
        side,
        max_images,
    )
    store.write_text(page, *run, "report.html")


def _compared_by_run(metrics: dict, compared_rows: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The scores already read of the runs the comparison names, by their run folder."""
    comparison = metrics.get("comparison") or {}
    return {comparison[k]["run_dir"]: rows for k, rows in compared_rows.items() if comparison.get(k)}


def bootstrap_beside_verdict(
    record: dict,
    rows: list[dict],
    n_resamples: int,
    read: dict[str, list[dict]] | None = None,
    win: dict | None = None,
) -> dict:
    """The fixed-sample paired bootstrap of the verdict's score against the sequential verdict's own baseline, on the
    images captioned (``sequential.reconcile``); ``error`` when the baseline's scores cannot be read. CIDEr-D: the
    baseline's scores.parquet (``read``: the scores rows of runs already read, by run folder; the baseline is often
    the previous or the best run); CLIPScore: the baseline's scores by the same CLIP checkpoint (its run folder's
    ``clip/<checkpoint fingerprint>``), which a baseline run without clip_model lacks; the pairwise win: ``win``, the
    pairwise stage's win rate with its bootstrap interval (``significance.win_rate``) on the images judged."""
    from captionflow.evaluation.sequential import reconcile

    run_dir, metric = record.get("against_run"), record.get("metric", "cider")
    if metric == "pairwise_score":
        if not win or win.get("n_images", 0) == 0:
            return {"error": "no image judged in both orders"}
        shifted = {k: win[k] - 0.5 for k in ("ci_low", "ci_high")}  # the verdict's scale: the win rate minus 0.5
        return reconcile(record, {**shifted, "verdict": win["verdict"], "delta": win["win_rate"] - 0.5,
                                  "n_images": win["n_images"]})  # fmt: skip
    if metric in ("clip_score", "judge_mean"):  # the baseline's scores by the same checkpoint, from its folder
        theirs, column = record["baseline_scores"], PER_IMAGE[metric]
        stored, what = ("clip_score", "CLIPScores") if metric == "clip_score" else ("score", "judge scores")
        by = record.get("clip_model") or record.get("judge_model")
        try:
            their_rows = [{"image_id": i, column: s} for i, s in read_scores(theirs, stored).items()]
        except (OSError, ValueError, TypeError) as e:
            return {"error": f"cannot read the baseline's {what} {theirs}: {e}"}
        if not their_rows:
            return {"error": f"the baseline has no {what} by {by} ({theirs})"}
    else:
        their_rows = (read or {}).get(run_dir)
    if their_rows is None:
        try:
            theirs = Store(run_dir)
            their_rows = theirs.read_table(theirs.path("scores.parquet"), columns=["image_id", "cider"]).to_pylist()
        except (OSError, ValueError, TypeError) as e:
            return {"error": f"cannot read {run_dir}/scores.parquet: {e}"}
    result = paired_bootstrap(per_image(rows), per_image(their_rows), metrics=(metric,), n_resamples=n_resamples)
    if metric not in result:
        return {"error": f"no image scored by both this run and {run_dir}"}
    return reconcile(record, result[metric])


def clip_per_image(clip_dir: str) -> dict[str, float]:
    """image id -> its CLIPScore (captionflow/stages/clip_score.py)."""
    return read_scores(clip_dir, "clip_score")


def per_image(rows: list[dict]) -> dict[str, dict]:
    """image id -> its per-image scores under the leaderboard's metric names."""
    return {r["image_id"]: {m: r.get(col) for m, col in PER_IMAGE.items()} for r in rows}


def read_compared(comparison: dict) -> dict[str, list[dict]]:
    """The scores.parquet rows of each run the comparison names ("previous", "best_so_far"); a run whose scores
    cannot be read gets the reason as its ``error`` instead."""
    out: dict[str, list[dict]] = {}
    for label in ("previous", "best_so_far"):
        other = comparison.get(label)
        if not other:
            continue
        try:
            theirs = Store(other["run_dir"])
            out[label] = theirs.read_table(theirs.path("scores.parquet")).to_pylist()
        except (OSError, ValueError) as e:
            other["error"] = f"cannot read {other['run_dir']}/scores.parquet: {e}"
    return out


def add_significance(comparison: dict, rows: list[dict], compared: dict[str, list[dict]], n_resamples: int) -> None:
    """A paired bootstrap (captionflow/evaluation/significance.py) against each run the comparison names."""
    mine = per_image(rows)
    for label in ("previous", "best_so_far"):
        other = comparison.get(label)
        if other and "error" in other:
            other["significance"] = {"error": other["error"]}
        elif other:
            other["significance"] = paired_bootstrap(mine, per_image(compared[label]), n_resamples=n_resamples)
