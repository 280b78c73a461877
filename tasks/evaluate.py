"""Stage 4, evaluate: caption statistics, reference metrics, a report and a leaderboard row."""

from __future__ import annotations

import time

import pyarrow as pa
from prefect import task

from captionflow.retry import retry_transient

from captionflow.metrics import length_stats, reference_metrics
from captionflow.storage import Store
from tasks.preprocess import shard_paths

LEADERBOARD = "leaderboard.parquet"


def evaluate(output: str, manifest: dict, inference: dict, model_source: str, judge: dict | None = None,
             coco_java: bool = False) -> dict:
    """Score the captions of one run; write scores.parquet, metrics.json, report.md; update the leaderboard."""
    t0 = time.perf_counter()
    store = Store(output)
    run = tuple(inference["run_parts"])
    ds_fp = manifest["dataset_fingerprint"]
    data = store.read_tables(shard_paths(store, manifest), columns=["image_id", "source", "references"])
    refs = {i: r for i, r in zip(data["image_id"].to_pylist(), data["references"].to_pylist())} if data else {}
    sources = dict(zip(data["image_id"].to_pylist(), data["source"].to_pylist())) if data else {}
    caps_t = store.read_tables(store.ls(*run, "captions", suffix=".parquet"))
    rows = caps_t.to_pylist() if caps_t is not None else []
    captions = {r["image_id"]: r["caption"] for r in rows}
    stats = length_stats([r["caption"] for r in rows], [r["finish_reason"] for r in rows], inference["failed"])
    ref_agg, ref_per = reference_metrics(captions, refs, java=coco_java)
    metrics = {"stats": stats, "reference": ref_agg}
    judged: dict[str, dict] = {}
    if judge:
        metrics["judge"] = {k: judge[k] for k in ("judge_model", "judged", "failed", "parse_rate", "mean_score",
                                                  "distribution")}
        jt = store.read_tables(store.ls(*judge["judge_parts"], "scores", suffix=".parquet"))
        judged = {r["image_id"]: r for r in jt.to_pylist()} if jt is not None else {}
    scores = pa.Table.from_pylist([
        {"image_id": r["image_id"], "source": sources.get(r["image_id"], ""), "caption": r["caption"],
         "references": refs.get(r["image_id"], []), "finish_reason": r["finish_reason"],
         "num_output_tokens": r["num_output_tokens"],
         **{k: ref_per.get(r["image_id"], {}).get(k) for k in ("bleu_4", "rouge_l", "cider")},
         "judge_score": judged.get(r["image_id"], {}).get("score"),
         "judge_reason": judged.get(r["image_id"], {}).get("reason")}
        for r in sorted(rows, key=lambda r: r["image_id"])
    ])
    store.write_table(scores, *run, "scores.parquet")
    metrics["comparison"] = _append_leaderboard(store, ds_fp, run, model_source, metrics)
    store.write_json(metrics, *run, "metrics.json")
    report = render_report(model_source, manifest, inference, metrics, scores.to_pylist())
    store.write_text(report, *run, "report.md")
    _publish(report)
    return {"metrics": metrics, "report": store.url(*run, "report.md"), "seconds": round(time.perf_counter() - t0, 2)}


COMPARED = ("bleu_4", "rouge_l", "cider", "meteor", "judge_mean")


def _append_leaderboard(store: Store, ds_fp: str, run: tuple, model_source: str, metrics: dict) -> dict:
    """Upsert this run's row; return the deltas against the previous and the best run on this dataset."""
    row = {"dataset_fingerprint": ds_fp, "model_fingerprint": run[2], "generation_fingerprint": run[3],
           "model": model_source, "run_dir": store.url(*run), "evaluated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "n_captions": metrics["stats"]["n_captions"], "failure_rate": metrics["stats"]["failure_rate"],
           **{k: metrics["reference"].get(k) for k in ("bleu_4", "rouge_l", "cider", "meteor")},
           "judge_mean": (metrics.get("judge") or {}).get("mean_score")}
    old = store.read_table(store.path(LEADERBOARD)).to_pylist() if store.exists(LEADERBOARD) else []
    key = (row["dataset_fingerprint"], row["model_fingerprint"], row["generation_fingerprint"])
    kept = [r for r in old if (r["dataset_fingerprint"], r["model_fingerprint"], r["generation_fingerprint"]) != key]
    store.write_table(pa.Table.from_pylist(kept + [row]), LEADERBOARD)
    same = [r for r in kept if r["dataset_fingerprint"] == ds_fp]
    previous = max(same, key=lambda r: r["evaluated_at"], default=None)
    best = max((r for r in same if r.get("cider") is not None), key=lambda r: r["cider"], default=None)

    def delta(other):
        if other is None:
            return None
        return {"model": other["model"], "run_dir": other["run_dir"],
                **{k: (row[k] - other[k]) if row.get(k) is not None and other.get(k) is not None else None
                   for k in COMPARED}}

    return {"previous": delta(previous), "best_so_far": delta(best), "runs_on_dataset": len(same) + 1}


def render_report(model_source: str, manifest: dict, inference: dict, metrics: dict, scores: list[dict]) -> str:
    s, ref = metrics["stats"], metrics["reference"]
    c = manifest["counts"]
    lines = [
        "# captionflow report", "",
        f"- model: `{model_source}`", f"- dataset: `{manifest['source']}` (`{manifest['dataset_fingerprint']}`)",
        f"- inputs: {c['listed']} listed, {c['accepted']} accepted, {c['quarantined']} quarantined, "
        f"{c['duplicates']} duplicates", f"- captioned: {inference['captioned']}, failed: {inference['failed']}", "",
        "## Headline metrics", "", "| metric | value |", "|---|---|",
    ]
    for k in ("bleu_1", "bleu_4", "rouge_l", "cider", "meteor"):
        if k in ref:
            lines.append(f"| {k} | {ref[k]:.4f} |")
    lines += [f"| words per caption (mean) | {s['words']['mean']:.1f} |", f"| truncated at max_tokens | {s['truncated_rate']:.1%} |",
              f"| empty | {s['empty_rate']:.1%} |", f"| repetition | {s['repetition_rate']:.3f} |",
              f"| vocabulary | {s['vocabulary_size']} |", f"| failure rate | {s['failure_rate']:.1%} |", ""]
    j = metrics.get("judge")
    if j:
        lines += ["## LLM judge", "", f"- judge model: `{j['judge_model']}`, judged {j['judged']}, failed {j['failed']}, "
                  f"answers parsed {j['parse_rate']:.0%}",
                  f"- mean score: {j['mean_score']:.2f}" if j["mean_score"] is not None else "- mean score: n/a",
                  "- distribution: " + ", ".join(f"{k}: {v}" for k, v in j["distribution"].items()), ""]
    comp = metrics.get("comparison") or {}
    if comp.get("previous") or comp.get("best_so_far"):
        lines += ["## Against earlier checkpoints on this dataset", "", "| vs | model | " + " | ".join(
            f"Δ {k}" for k in COMPARED) + " |", "|---|---|" + "---|" * len(COMPARED)]
        for label in ("previous", "best_so_far"):
            d = comp.get(label)
            if d:
                cells = " | ".join("" if d[k] is None else f"{d[k]:+.4f}" for k in COMPARED)
                lines.append(f"| {label.replace('_', ' ')} | `{d['model']}` | {cells} |")
        lines.append("")
    scored = [r for r in scores if r.get("cider") is not None]
    if scored:
        scored.sort(key=lambda r: r["cider"], reverse=True)
        for title, part in (("Best captions (CIDEr)", scored[:3]), ("Worst captions (CIDEr)", scored[-3:][::-1])):
            lines += [f"## {title}", "", "| image | caption | references | CIDEr |", "|---|---|---|---|"]
            for r in part:
                cap = r["caption"].replace("|", "\\|").replace("\n", " ")[:120]
                refs = " / ".join(r["references"]).replace("|", "\\|")[:160]
                lines.append(f"| {r['source']} | {cap} | {refs} | {r['cider']:.3f} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def _publish(report: str) -> None:
    from prefect.context import get_run_context

    try:
        get_run_context()
    except Exception:
        return
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=report, key="caption-report", description="captionflow evaluation report")


evaluate_task = task(name="evaluate", retries=2, retry_delay_seconds=[2, 10],
                   retry_condition_fn=retry_transient)(evaluate)
