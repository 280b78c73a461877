"""The report of one run (markdown) and the leaderboard of every run under an output root."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Optional

import pyarrow as pa

from captionflow.data.layout import EXTERNAL_GENERATION, LEADERBOARD
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.evaluation.sequential import bootstrap_line, meaning, verdict_line
from captionflow.results import InferenceResult, Manifest

COMPARED = ("bleu_4", "rouge_l", "cider", "meteor", "judge_mean", "clip_score")
ROW_FIELDS = ("n_captions", "failure_rate", "bleu_4", "rouge_l", "cider", "meteor", "judge_mean", "clip_score")
ROWS = "leaderboard"  # one JSON file per (dataset, model, generation): each run writes only its own


def row_file(dataset_fp: str, model_fp: str, generation_fp: str) -> str:
    """The name of a run's row file under ``ROWS``: its run folder's three fingerprints (layout.run_parts)."""
    return f"{dataset_fp}-{model_fp}-{generation_fp}.json"


def _row_name(row: dict) -> str:
    return row_file(row["dataset_fingerprint"], row["model_fingerprint"], row["generation_fingerprint"])


def evaluated_as(store: Store, run_dir: str, model: str) -> Optional[str]:
    """The name under which the leaderboard holds ``run_dir``'s row when it is not ``model``: the same weights
    (one content fingerprint) evaluated before under another path or name. None: no row, or the same name."""
    row = next((r for r in read_leaderboard(store) if r["run_dir"] == run_dir), None)
    return row["model"] if row and row["model"] != model else None


def read_leaderboard(store: Store) -> list[dict]:
    """Every leaderboard row: the row files, and rows of an older ``leaderboard.parquet`` that have none."""
    rows = {p.rsplit("/", 1)[-1]: json.loads(store.fs.cat_file(p)) for p in store.ls(ROWS, suffix=".json")}
    if store.exists(LEADERBOARD):
        for r in store.read_table(store.path(LEADERBOARD)).to_pylist():
            rows.setdefault(_row_name(r), r)
    return sorted(rows.values(), key=lambda r: r["evaluated_at"])


def update_leaderboard(store: Store, ds_fp: str, run: tuple, model_source: str, metrics: dict) -> dict:
    """Write this run's row and return the deltas against the previous and the best run on the same dataset
    with the same generation settings (never across them), among those that captioned the whole set. Concurrent
    writers never lose a row: each writes its own row file; ``leaderboard.parquet`` is recompacted from all of them
    under a lease."""
    row = {
        "dataset_fingerprint": ds_fp,
        "model_fingerprint": run[2],
        "generation_fingerprint": run[3],
        "model": model_source,
        "run_dir": store.url(*run),
        "evaluated_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),  # orders runs within a second
        "n_captions": metrics["stats"]["n_captions"],
        "failure_rate": metrics["stats"]["failure_rate"],
        **{k: metrics["reference"].get(k) for k in ("bleu_4", "rouge_l", "cider", "meteor")},
        "judge_mean": (metrics.get("judge") or {}).get("mean_score"),
        # a sequential verdict's decision, e.g. "worse after 612 of 5,000 images (alpha 0.05, ...)"
        "verdict": verdict_line(metrics["sequential"]) if metrics.get("sequential") else None,
        # the sequential verdict stopped the captioning: the row's metrics are of the order's prefix, and the run is
        # neither another's baseline nor "best" (baseline.resolve_baseline)
        "partial": bool(metrics.get("partial")),
        # the run's deadline when it was evaluated, e.g. "MISSED by 3 h 05 min (2026-11-29T06:00:00)"
        "deadline": f"{d['line']} ({d['deadline']})" if (d := metrics.get("deadline")) else None,
        "clip_score": (metrics.get("clip") or {}).get("mean"),
        "external": run[3] == EXTERNAL_GENERATION,  # captions produced elsewhere (captionflow evaluate)
    }
    board = read_leaderboard(store)
    old = next((r for r in board if _row_name(r) == _row_name(row)), None)
    if old:  # a metric this evaluation did not compute (no judge this time) keeps its earlier value
        row.update({k: old[k] for k in ROW_FIELDS if row.get(k) is None and old.get(k) is not None})
    store.write_json(row, ROWS, _row_name(row))
    compact_leaderboard(store)
    same = [
        r
        for r in board
        if _row_name(r) != _row_name(row)
        and r["dataset_fingerprint"] == ds_fp
        and r["generation_fingerprint"] == row["generation_fingerprint"]
        and not r.get("partial")  # a prefix's metrics: compared with nothing
    ]
    previous = max(same, key=lambda r: r["evaluated_at"], default=None)
    best = max((r for r in same if r.get("cider") is not None), key=lambda r: r["cider"], default=None)

    def delta(other):
        if other is None:
            return None
        return {
            "model": other["model"],
            "run_dir": other["run_dir"],
            **{
                k: (row[k] - other[k]) if row.get(k) is not None and other.get(k) is not None else None
                for k in COMPARED
            },
        }

    return {"previous": delta(previous), "best_so_far": delta(best), "runs_on_dataset": len(same) + 1}


def compact_leaderboard(store: Store) -> None:
    """``leaderboard.parquet`` from every row file, written under a lease: the last writer's view holds every
    row written before it took the lease."""
    with Lease(store, "leaderboard", what=f"the leaderboard {store.url(LEADERBOARD)}", ttl_s=30, wait_s=600):
        rows = read_leaderboard(store)
        if rows:
            # every row with every column any row has: rows written by an older version lack the newer ones, and
            # from_pylist takes its columns from the first row alone
            columns = list(dict.fromkeys(k for r in rows for k in r))
            store.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]), LEADERBOARD)


_MD_SPECIAL = str.maketrans({c: f"\\{c}" for c in "\\`*_[]|#"})


def md_text(value: object, limit: int | None = None) -> str:
    """Text from a run's data (a caption, a file name, a model's path) as it must stand in a Markdown table cell or
    line: on one line (``\\r`` and newlines as spaces), HTML shown as text (``<`` ``>`` ``&`` as entities), and
    Markdown's own characters (``|`` ending a cell, ``*``, ``_``, backticks...) escaped; cut to ``limit``
    characters first. The one escaping of every Markdown artifact and report."""
    text = " ".join(str(value).replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.translate(_MD_SPECIAL)


def significance_lines(comp: dict) -> list[str]:
    """The paired bootstrap of each comparison (captionflow/evaluation/significance.py) as a table."""
    lines: list[str] = []
    for label in ("previous", "best_so_far"):
        d = comp.get(label) or {}
        sig = d.get("significance")
        if not sig:
            continue
        if "error" in sig:
            lines += [
                f"Is the difference against {md_text(d['model'])} real? Not computed: {md_text(sig['error'])}",
                "",
            ]
            continue
        n = max((v["n_images"] for v in sig.values()), default=0)
        lines += [
            f"### Is the difference real? Against the {label.replace('_', ' ')} run {md_text(d['model'])} "
            f"(paired bootstrap over {n} images)",
            "",
            "| metric | Δ | 95% interval | p (Holm) | verdict |",
            "|---|---|---|---|---|",
        ]
        for k, v in sig.items():
            lines.append(
                f"| {k} | {v['delta']:+.4f} | [{v['ci_low']:+.4f}, {v['ci_high']:+.4f}] | {v['p_holm']:.3f} | "
                f"**{v['verdict']}** |"
            )
        lines.append("")
    return lines


def _health_lines(health: dict | None) -> list[str]:
    """Caption health: each fault's count and rate, with examples (captionflow/evaluation/caption_health.py)."""
    if not health or not health["n_captions"]:
        return []
    lines = [
        "## Caption health",
        "",
        "Cheap heuristics (docs/evaluation.md): counted, never scored.",
        "",
        "| fault | captions | rate | examples |",
        "|---|---|---|---|",
    ]
    for fault, count in health["counts"].items():
        shown = "; ".join(
            f"{md_text(e.get('file') or e['image_id'])}: {md_text(e['caption'], 80)}" for e in health["examples"][fault]
        )
        lines.append(f"| {fault.replace('_', ' ')} | {count} | {health['rates'][fault]:.1%} | {shown or '-'} |")
    return [*lines, ""]


def slice_lines(slices: list[dict]) -> list[str]:
    """Metrics per slice (captionflow/evaluation/slices.py) as a table."""
    cols = [k for k in slices[0] if k not in ("slice", "n")]
    lines = [
        "## Per slice",
        "",
        "| slice | images | " + " | ".join(cols) + " |",
        "|---|---|" + "---|" * len(cols),
    ]
    for r in slices:
        cells = " | ".join("-" if r[k] is None else f"{r[k]:.4f}" for k in cols)
        lines.append(f"| {md_text(r['slice'])} | {r['n']} | {cells} |")
    return [*lines, ""]


def pairwise_lines(p: dict) -> list[str]:
    """The pairwise judge's verdict (captionflow/stages/pairwise.py) as a section."""
    if not p.get("baseline_model"):
        return ["## Pairwise judge", "", f"Not judged: {p['note']}.", ""]
    st = p.get("stats")
    lines = [
        f"## Pairwise judge against {md_text(p['baseline_model'])}",
        "",
        f"- judge {md_text(p['judge_model'])}; {p['judged']} images judged in both orders (captions swapped), "
        f"{p['failed']} judgements failed, answers parsed {p['parse_rate']:.0%}",
        f"- this checkpoint won {p['wins']}, lost {p['losses']}, split or tied {p['ties']}; "
        f"the two orders agreed on {p['consistency']:.0%} of the images",
    ]
    if st:
        lines.append(
            f"- **win rate {st['win_rate']:.3f}** (95% interval [{st['ci_low']:.3f}, {st['ci_high']:.3f}], "
            f"p {st['p_value']:.3f} against 0.5): **{st['verdict']}**"
        )
    lb = p.get("length_bias")
    if lb:
        lines.append(
            f"- caption length: {lb['mean_words']:.1f} words against the baseline's {lb['baseline_mean_words']:.1f}"
            " (judges prefer longer captions)"
        )
        lines += length_lines(lb["win_rate_by_length"], "win rate", "this caption ")
    return [*lines, ""]


def length_lines(groups: dict | None, what: str, prefix: str = "") -> list[str]:
    """``what`` by caption length (evaluation/pairwise_scores.length_bias, score_by_length) as a list line."""
    if not groups:
        return []
    parts = [
        f"{prefix}{name}: {g.get('win_rate', g.get('mean_score')):.3f} ({g.get('images', g.get('mean_words'))}"
        + (" images)" if "images" in g else " words)")
        for name, g in groups.items()
        if g.get("win_rate", g.get("mean_score")) is not None
    ]
    return [f"- {what} by length: " + "; ".join(parts)] if parts else []


def render_report(
    model_source: str, manifest: Manifest, inference: InferenceResult, metrics: dict, scores: list[dict]
) -> str:
    s, ref = metrics["stats"], metrics["reference"]
    c = manifest.counts
    lines = [
        "# captionflow report",
        "",
        f"- model: {md_text(model_source)}",
        f"- dataset: {md_text(manifest.source)} (`{manifest.dataset_fingerprint}`)",
        f"- inputs: {c.listed} listed, {c.accepted} accepted, {c.quarantined} quarantined, {c.duplicates} duplicates",
        f"- captioned: {inference.captioned}, failed: {inference.failed}",
        *(
            [
                f"- sequential verdict: {md_text(verdict_line(metrics['sequential']))}. "
                f"{md_text(meaning(metrics['sequential']))}"
            ]
            if "sequential" in metrics
            else []
        ),
        *(
            ["- partial: the sequential verdict stopped this run early; its metrics are of the images it captioned"]
            if metrics.get("partial")
            else []
        ),
        *([f"- {md_text(line)}"] if (line := bootstrap_line(metrics.get("sequential"))) else []),
        "- to look at: `report.html` beside this file (thumbnails, side by side with the compared checkpoint, chart)",
        "",
        "## Headline metrics",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    for k in ("bleu_1", "bleu_4", "rouge_l", "cider", "meteor"):
        if k in ref:
            lines.append(f"| {k} | {ref[k]:.4f} |")
    clip = metrics.get("clip")
    if clip and clip.get("mean") is not None:
        lines.append(f"| CLIPScore (reference-free, {md_text(clip['clip_model'])}) | {clip['mean']:.4f} |")
    if not ref:
        why = (
            "no reference metric: the dataset has no reference captions (a `captions.jsonl` beside the images, or "
            "a captions column)"
            + (
                "; its reference-free score is the CLIPScore above"
                if clip
                else "; `clip_model` (CLIPScore) or `judge` give a reference-free score"
            )
        )
        lines.append(f"| {why} | - |")
    lines += [
        f"| words per caption (mean) | {s['words']['mean']:.1f} |",
        f"| truncated at max_tokens | {s['truncated_rate']:.1%} |",
        f"| empty | {s['empty_rate']:.1%} |",
        f"| repetition | {s['repetition_rate']:.3f} |",
        f"| vocabulary | {s['vocabulary_size']} |",
        f"| failure rate | {s['failure_rate']:.1%} |",
        "",
    ]
    lines += _health_lines(metrics.get("health"))
    j = metrics.get("judge")
    if j:
        lines += [
            "## LLM judge",
            "",
            f"- judge model: `{j['judge_model']}`, judged {j['judged']}, failed {j['failed']}, "
            f"answers parsed {j['parse_rate']:.0%}",
            f"- mean score: {j['mean_score']:.2f}" if j["mean_score"] is not None else "- mean score: n/a",
            "- distribution: " + ", ".join(f"{k}: {v}" for k, v in j["distribution"].items()),
            *length_lines((j.get("length") or {}).get("mean_score_by_length"), "mean score"),
            "",
        ]
    if metrics.get("slices"):
        lines += slice_lines(metrics["slices"])
    if metrics.get("pairwise"):
        lines += pairwise_lines(metrics["pairwise"])
    comp = metrics.get("comparison") or {}
    if comp:
        lines += ["## Against earlier checkpoints on this dataset", ""]
    if comp and not (comp.get("previous") or comp.get("best_so_far")):
        lines += [
            "None to compare: no earlier run on this dataset with the same generation settings (prompt, "
            "max_tokens, sampling, engine settings that change captions); comparisons never cross them.",
            "",
        ]
    if comp.get("previous") or comp.get("best_so_far"):
        lines += [
            "| vs | model | " + " | ".join(f"Δ {k}" for k in COMPARED) + " |",
            "|---|---|" + "---|" * len(COMPARED),
        ]
        for label in ("previous", "best_so_far"):
            d = comp.get(label)
            if d:
                cells = " | ".join("" if d.get(k) is None else f"{d[k]:+.4f}" for k in COMPARED)
                lines.append(f"| {label.replace('_', ' ')} | {md_text(d['model'])} | {cells} |")
        lines.append("")
        lines += significance_lines(comp)
    scored = [r for r in scores if r.get("cider") is not None]
    if scored:
        scored.sort(key=lambda r: r["cider"], reverse=True)
        for title, part in (("Best captions (CIDEr)", scored[:3]), ("Worst captions (CIDEr)", scored[-3:][::-1])):
            lines += [f"## {title}", "", "| image | caption | references | CIDEr |", "|---|---|---|---|"]
            for r in part:
                cap, refs = md_text(r["caption"], 120), md_text(" / ".join(r["references"]), 160)
                lines.append(f"| {md_text(r['source'])} | {cap} | {refs} | {r['cider']:.3f} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def leaderboard_rows(
    store: Store, dataset: str | None = None, generation: str | None = None, model: str | None = None
) -> list[dict]:
    """Leaderboard rows, newest first, filtered by a prefix of the dataset or generation fingerprint and by a
    substring of the model."""
    rows = [
        r
        for r in read_leaderboard(store)
        if (not dataset or r["dataset_fingerprint"].startswith(dataset))
        and (not generation or r["generation_fingerprint"].startswith(generation))
        and (not model or model in r["model"])
    ]
    return rows[::-1]


def leaderboard_table(rows: list[dict]) -> str:
    """Rows as an aligned text table (fingerprints shortened to 8 characters; ``n`` of a run its sequential verdict
    stopped early marked ``(partial)``: its metrics are its prefix's)."""
    cols = ("evaluated_at", "dataset", "generation", "model", "n", "cider", "bleu_4", "rouge_l", "judge")

    def cell(r: dict, c: str) -> str:
        v = {
            "dataset": r["dataset_fingerprint"][:8],
            "generation": r["generation_fingerprint"][:8],
            "n": f"{r.get('n_captions')} (partial)" if r.get("partial") else r.get("n_captions"),
            "judge": r.get("judge_mean"),
        }.get(c, r.get(c))
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    table = [list(cols)] + [[cell(r, c) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in table)
