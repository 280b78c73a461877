"""The HTML report of one run: one self-contained file (thumbnails and chart inline) to look at.

Sections: the headline metrics; each comparison's paired bootstrap; a chart of the primary metrics over the
checkpoints evaluated on this dataset with these generation settings (also written as ``chart.png``); a
side-by-side view against the compared run (previous, else best so far), the largest per-image wins and
losses first; and every image (up to ``max_images``) with its thumbnail, caption, references and scores.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any, Optional

from captionflow.data.layout import shard_paths
from captionflow.data.storage import Store
from captionflow.evaluation.sequential import bootstrap_line, meaning, verdict_line
from captionflow.results import Manifest

THUMB_PX = 160
SIDE_BY_SIDE = 20  # wins and as many losses
SORTED_BY = (
    "cider",
    "judge_score",
    "clip_score",
)  # per-image scores the side-by-side view sorts by, the first that differs
CHARTED = (
    ("cider", "CIDEr"),
    ("bleu_4", "BLEU-4"),
    ("rouge_l", "ROUGE-L"),
    ("judge_mean", "judge (1-5)"),
    ("clip_score", "CLIPScore"),
)
PER_IMAGE_COLUMNS = (
    ("cider", "CIDEr"),
    ("bleu_4", "BLEU-4"),
    ("rouge_l", "ROUGE-L"),
    ("judge_score", "judge"),
    ("pairwise_score", "pairwise (1 won)"),
    ("clip_score", "CLIPScore"),
)

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;margin:8px 0 24px}
td,th{border:1px solid #ddd;padding:4px 8px;vertical-align:top;text-align:left;max-width:520px;overflow-wrap:anywhere}
#chart{max-width:100%}
th{background:#f4f4f4}
td.num{text-align:right;font-variant-numeric:tabular-nums}
img.thumb{max-width:160px;max-height:160px;display:block}
.win{color:#176f2c}.loss{color:#a31515}.muted{color:#777}
"""
# Counts the images the browser decoded (a test reads it from the DOM)
LOADED = (
    "<script>window.addEventListener('load',function(){var i=[].slice.call(document.images);"
    "document.body.setAttribute('data-images-loaded',i.filter(function(x){return x.complete&&x.naturalWidth>0})"
    ".length);});</script>"
)


def side_by_side(mine: list[dict], theirs: list[dict], k: int = SIDE_BY_SIDE) -> tuple[Optional[str], list[dict]]:
    """Images both runs captioned, as (metric, rows): the ``k`` largest wins then the ``k`` largest losses by
    the first per-image score that tells them apart (CIDEr, else the judge's); without one, the first ``2k``
    images whose captions differ."""
    other = {r["image_id"]: r for r in theirs}
    pairs = [(r, other[r["image_id"]]) for r in mine if r["image_id"] in other]
    for metric in SORTED_BY:
        scored = [
            {"mine": a, "theirs": b, "delta": a[metric] - b[metric]}
            for a, b in pairs
            if a.get(metric) is not None and b.get(metric) is not None
        ]
        wins = sorted((d for d in scored if d["delta"] > 0), key=lambda d: (-d["delta"], d["mine"]["image_id"]))
        losses = sorted((d for d in scored if d["delta"] < 0), key=lambda d: (d["delta"], d["mine"]["image_id"]))
        if wins or losses:
            return metric, wins[:k] + losses[:k]
    differ = [{"mine": a, "theirs": b, "delta": None} for a, b in pairs if a["caption"] != b["caption"]]
    return None, differ[: 2 * k]


def thumbnails(store: Store, manifest: Manifest, ids: set[str], px: int = THUMB_PX) -> dict[str, str]:
    """image id -> a JPEG data URL of its preprocessed image, at most ``px`` on its longest side."""
    from PIL import Image

    out: dict[str, str] = {}
    for path in shard_paths(store, manifest):
        if len(out) == len(ids):
            break
        for r in store.read_table(path, columns=["image_id", "image"]).to_pylist():
            if r["image_id"] in ids and r["image_id"] not in out:
                with Image.open(io.BytesIO(r["image"])) as im:
                    im = im.convert("RGB")
                    im.thumbnail((px, px))
                    buf = io.BytesIO()
                    im.save(buf, format="JPEG", quality=75)
                out[r["image_id"]] = "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    return out


def chart_png(rows: list[dict], current_run_dir: str) -> Optional[bytes]:
    """The primary metrics of ``rows`` (leaderboard rows, oldest first) as a PNG; this run's point ringed.
    None when no row has any of them."""
    charted = [(k, label) for k, label in CHARTED if any(r.get(k) is not None for r in rows)]
    if not charted:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3.2 * len(charted), 3.0), dpi=100, layout="constrained")
    axes = fig.subplots(1, len(charted), squeeze=False)[0]
    x = list(range(1, len(rows) + 1))
    names = [r["model"].rstrip("/").rsplit("/", 1)[-1][:18] for r in rows]
    for ax, (k, label) in zip(axes, charted):
        ys = [None if r.get(k) is None else round(r[k], 6) for r in rows]  # 2e-14 is 0: no axis of 1e-14 steps
        pts = [(xi, y) for xi, y in zip(x, ys) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color="#2060a0")
        lo, hi = min(p[1] for p in pts), max(p[1] for p in pts)
        if hi - lo < 1e-6:  # all the same: a band around it, in the metric's own scale
            pad = max(abs(hi), 1.0) * 0.05
            ax.set_ylim(lo - pad, hi + pad)
        ax.ticklabel_format(axis="y", useOffset=False)
        for xi, r in zip(x, rows):
            if r["run_dir"] == current_run_dir and r.get(k) is not None:
                ax.plot([xi], [round(r[k], 6)], marker="o", markersize=12, fillstyle="none", color="#d04010")
        ax.set_title(label)
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
        ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def verdict_png(record: dict) -> bytes:
    """The sequential verdict's interval for the expected per-image difference, look by look, with 0, the
    equivalence margin and the stop marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    traj = record["trajectory"]
    n = [t[0] for t in traj]
    fig = Figure(figsize=(6.4, 3.0), dpi=100, layout="constrained")
    ax = fig.subplots()
    ax.fill_between(n, [t[1] for t in traj], [t[2] for t in traj], color="#2060a0", alpha=0.3, step="post")
    ax.axhline(0, color="black", linewidth=0.8)
    if record.get("margin"):
        for y in (-record["margin"], record["margin"]):
            ax.axhline(y, color="grey", linestyle=":", linewidth=0.8)
    ax.axvline(record["images_used"], color="#d04010", linestyle="--", linewidth=1)
    ax.set_xlabel(f"images (of {record['images_total']:,}) in the seeded order")
    pairwise = record.get("metric") == "pairwise_score"  # its differences: the shares minus 0.5
    ax.set_ylabel(f"{record['score']} - 0.5" if pairwise else f"{record['score']} difference")
    ax.set_title(f"{record['decision']} after {record['images_used']:,} images (alpha {record['alpha']:g})")
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _e(v: Any) -> str:
    return html.escape(str(v))


def _num(v: Any, fmt: str = "{:.3f}") -> str:
    return '<td class="num">' + ("-" if v is None else _e(fmt.format(v) if isinstance(v, float) else v)) + "</td>"


def _thumb(urls: dict[str, str], image_id: str) -> str:
    url = urls.get(image_id)
    return f'<img class="thumb" src="{url}" alt="{_e(image_id)}">' if url else '<span class="muted">-</span>'


def render_html(
    model_source: str,
    manifest: Manifest,
    metrics: dict[str, Any],
    scores: list[dict],
    thumbs: dict[str, str],
    chart: Optional[bytes],
    compared: Optional[dict[str, Any]] = None,
    side: tuple[Optional[str], list[dict]] = (None, []),
    max_images: int = 200,
) -> str:
    """The page. ``scores``: this run's scores.parquet rows; ``compared``: the comparison (its ``model``,
    ``run_dir``, ``significance``); ``side``: ``side_by_side`` of this run against it."""
    s, ref = metrics["stats"], metrics.get("reference") or {}
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>captionflow report: {_e(model_source)}</title><style>{STYLE}</style></head><body>",
        "<h1>captionflow report</h1>",
        f"<p>model <code>{_e(model_source)}</code> on dataset <code>{_e(manifest.source)}</code> "
        f"(<code>{_e(manifest.dataset_fingerprint[:12])}</code>): {len(scores)} images captioned, "
        f"{manifest.counts.quarantined} quarantined.</p>",
        "<h2>Headline metrics</h2><table id='headline'><tr><th>metric</th><th>value</th></tr>",
    ]
    for k in ("bleu_1", "bleu_4", "rouge_l", "cider", "meteor"):
        if k in ref:
            out.append(f"<tr><td>{k}</td>{_num(ref[k], '{:.4f}')}</tr>")
    if not ref:
        out.append("<tr><td>reference metrics</td><td>none: the dataset has no reference captions</td></tr>")
    clip = metrics.get("clip")
    if clip and clip.get("mean") is not None:
        out.append(
            f"<tr><td>CLIPScore (reference-free, {_e(clip['clip_model'])})</td>{_num(clip['mean'], '{:.4f}')}</tr>"
        )
    j = metrics.get("judge")
    if j and j.get("mean_score") is not None:
        out.append(f"<tr><td>judge mean (1-5)</td>{_num(j['mean_score'], '{:.2f}')}</tr>")
    out += [
        f"<tr><td>words per caption (mean)</td>{_num(s['words']['mean'], '{:.1f}')}</tr>",
        f"<tr><td>truncated at max_tokens</td>{_num(s['truncated_rate'], '{:.1%}')}</tr>",
        f"<tr><td>failure rate</td>{_num(s['failure_rate'], '{:.1%}')}</tr></table>",
    ]
    seq = metrics.get("sequential")
    if seq:
        out += [
            f"<h2>Sequential verdict against <code>{_e(seq['against'])}</code></h2>",
            f"<p id='verdict'><b>{_e(verdict_line(seq))}</b>. {_e(meaning(seq))} The interval is for the "
            f"expected per-image {_e(seq['score'])} difference on images like the golden set's; while the images "
            "come it holds at every look at once, so stopping as soon as it decides keeps the error rate; once "
            "every image is seen a paired t test decides the rest (docs/evaluation.md).</p>",
            *([f"<p id='verdict-bootstrap'>{_e(line)}.</p>"] if (line := bootstrap_line(seq)) else []),
            f"<img id='verdict-chart' alt='the interval narrowing over images' src='data:image/png;base64,"
            f"{base64.b64encode(verdict_png(seq)).decode('ascii')}'>",
        ]
    if metrics.get("slices"):
        cols = [k for k in metrics["slices"][0] if k not in ("slice", "n")]
        out.append(
            "<h2>Per slice</h2><table id='slices'><tr><th>slice</th><th>images</th>"
            + "".join(f"<th>{_e(k)}</th>" for k in cols)
            + "</tr>"
        )
        for r in metrics["slices"]:
            out.append(
                f"<tr><td>{_e(r['slice'])}</td>{_num(r['n'])}" + "".join(_num(r[k], "{:.4f}") for k in cols) + "</tr>"
            )
        out.append("</table>")
    p = metrics.get("pairwise")
    if p and p.get("stats"):
        st = p["stats"]
        out += [
            f"<h2>Pairwise judge against <code>{_e(p['baseline_model'])}</code></h2><table id='pairwise'>",
            f"<tr><td>win rate (95% interval)</td><td class='num'>{st['win_rate']:.3f} "
            f"[{st['ci_low']:.3f}, {st['ci_high']:.3f}]</td></tr>",
            f"<tr><td>verdict</td><td><b>{_e(st['verdict'])}</b></td></tr>",
            f"<tr><td>won / split or tied / lost</td><td>{p['wins']} / {p['ties']} / {p['losses']}</td></tr>",
            f"<tr><td>both orders agreed</td>{_num(p['consistency'], '{:.0%}')}</tr>",
        ]
        lb = p.get("length_bias")
        if lb:
            out.append(
                f"<tr><td>caption length (words): this / baseline</td><td class='num'>{lb['mean_words']:.1f} / "
                f"{lb['baseline_mean_words']:.1f}</td></tr>"
            )
            for name, g in lb["win_rate_by_length"].items():
                if g["win_rate"] is not None:
                    out.append(
                        f"<tr><td>win rate where this caption is {_e(name)}</td><td class='num'>"
                        f"{g['win_rate']:.3f} ({g['images']} images)</td></tr>"
                    )
        out.append("</table>")
    if chart:
        out += [
            "<h2>Across checkpoints (this dataset, these generation settings)</h2>",
            f"<img id='chart' alt='metrics across checkpoints' src='data:image/png;base64,"
            f"{base64.b64encode(chart).decode('ascii')}'>",
        ]
    if compared:
        out += _comparison(compared, side, thumbs)
    shown = sorted(scores, key=lambda r: r["image_id"])[:max_images]
    cols = [(k, label) for k, label in PER_IMAGE_COLUMNS if any(r.get(k) is not None for r in scores)]
    out += [
        f"<h2>Images</h2><p>{len(shown)} of {len(scores)} images"
        + (f" (the first {max_images} by image id)" if len(shown) < len(scores) else "")
        + ".</p>",
        "<table id='images'><tr><th>image</th><th>caption</th><th>references</th>"
        + "".join(f"<th>{label}</th>" for _, label in cols)
        + "</tr>",
    ]
    for r in shown:
        refs = "<br>".join(_e(x) for x in r.get("references") or []) or '<span class="muted">none</span>'
        out.append(
            f"<tr data-image-id='{_e(r['image_id'])}'><td>{_thumb(thumbs, r['image_id'])}"
            f"<div class='muted'>{_e(r.get('source', ''))}</div></td><td>{_e(r['caption'])}</td><td>{refs}</td>"
            + "".join(_num(r.get(k)) for k, _ in cols)
            + "</tr>"
        )
    out += ["</table>", LOADED, "</body></html>"]
    return "\n".join(out)


def _comparison(compared: dict, side: tuple[Optional[str], list[dict]], thumbs: dict[str, str]) -> list[str]:
    out = [f"<h2>Against <code>{_e(compared['model'])}</code></h2>"]
    sig = compared.get("significance") or {}
    if sig and "error" not in sig:
        out.append(
            "<table id='significance'><tr><th>metric</th><th>Δ</th><th>95% interval</th><th>p (Holm)</th>"
            "<th>verdict</th></tr>"
        )
        for k, v in sig.items():
            out.append(
                f"<tr><td>{_e(k)}</td>{_num(v['delta'], '{:+.4f}')}<td>[{v['ci_low']:+.4f}, {v['ci_high']:+.4f}]"
                f"</td>{_num(v['p_holm'])}<td><b>{_e(v['verdict'])}</b></td></tr>"
            )
        out.append("</table>")
    metric, pairs = side
    if not pairs:
        out.append("<p>The two checkpoints captioned every image alike.</p>")
        return out
    how = f"the largest per-image {metric} wins, then losses" if metric else "images whose captions differ"
    out += [
        f"<h3>Side by side ({_e(how)})</h3>",
        "<table id='side-by-side'><tr><th>image</th><th>this checkpoint</th>"
        f"<th><code>{_e(compared['model'])}</code></th><th>Δ</th></tr>",
    ]
    for d in pairs:
        a, b = d["mine"], d["theirs"]
        cls = "" if d["delta"] is None else " class='win'" if d["delta"] > 0 else " class='loss'"
        score = (lambda r: f"<div class='muted'>{r[metric]:.3f}</div>") if metric else (lambda r: "")
        out.append(
            f"<tr{cls} data-image-id='{_e(a['image_id'])}'><td>{_thumb(thumbs, a['image_id'])}</td>"
            f"<td>{_e(a['caption'])}{score(a)}</td><td>{_e(b['caption'])}{score(b)}</td>"
            + (_num(d["delta"], "{:+.3f}") if d["delta"] is not None else "<td>-</td>")
            + "</tr>"
        )
    out.append("</table>")
    return out
