"""The HTML report: the side-by-side order, the chart, and the page as a real headless chromium renders it."""

from __future__ import annotations

import io

import pyarrow as pa
from PIL import Image

from captionflow.data.layout import SHARDS, dataset_parts
from captionflow.data.storage import Store
from captionflow.report.html import chart_png, render_html, side_by_side, thumbnails
from captionflow.results import Counts, Manifest
from tests.support.browser import DomCounts, rendered_dom


def _rows(scores: dict[str, float], caption: str = "a cat") -> list[dict]:
    return [
        {"image_id": i, "source": f"{i}.jpg", "caption": f"{caption} {i}", "references": ["a cat"], "cider": c}
        for i, c in scores.items()
    ]


def test_side_by_side_lists_the_largest_wins_then_the_largest_losses():
    mine = _rows({"a": 0.9, "b": 0.1, "c": 0.5, "d": 0.2, "e": 0.4})
    theirs = _rows({"a": 0.1, "b": 0.6, "c": 0.5, "d": 0.1, "e": 0.9, "z": 1.0})
    metric, pairs = side_by_side(mine, theirs, k=5)
    assert metric == "cider"
    assert [(p["mine"]["image_id"], round(p["delta"], 3)) for p in pairs] == [
        ("a", 0.8),
        ("d", 0.1),
        ("b", -0.5),
        ("e", -0.5),
    ]  # c (no difference) and z (only theirs) are not listed
    _, capped = side_by_side(mine, theirs, k=1)
    assert [p["mine"]["image_id"] for p in capped] == ["a", "b"]
    judged = [{**r, "cider": 0.0, "judge_score": 5 if r["image_id"] == "e" else 3} for r in mine]
    metric, by_judge = side_by_side(judged, [{**r, "cider": 0.0, "judge_score": 3} for r in theirs], k=5)
    assert metric == "judge_score" and [p["mine"]["image_id"] for p in by_judge] == ["e"]  # CIDEr ties everywhere
    plain = [{k: v for k, v in r.items() if k != "cider"} for r in mine]
    metric, differ = side_by_side(plain, [{**r, "caption": "same"} for r in plain[:2]] + plain[2:], k=5)
    assert metric is None and [p["mine"]["image_id"] for p in differ] == ["a", "b"]  # no score: captions that differ


def test_chart_is_a_png_of_the_metrics_some_row_has():
    rows = [{"model": f"ckpt-{i}", "run_dir": f"r{i}", "cider": i / 10, "bleu_4": None} for i in range(3)]
    png = chart_png(rows, "r2")
    assert png and png.startswith(b"\x89PNG")
    assert (
        Image.open(io.BytesIO(png)).size[0]
        < Image.open(io.BytesIO(chart_png([{**r, "bleu_4": 0.1} for r in rows], "r2"))).size[0]
    )  # one panel per metric present
    assert chart_png([{"model": "m", "run_dir": "r", "cider": None}], "r") is None


def _store_with_shard(tmp_path, n: int) -> tuple[Store, Manifest]:
    store = Store(str(tmp_path))
    rows = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (320, 200), (20 * i % 255, 90, 160)).save(buf, format="JPEG")
        rows.append({"image_id": f"img{i:02d}", "image": buf.getvalue()})
    store.write_table(pa.Table.from_pylist(rows), *dataset_parts("dsfp"), SHARDS, "part-00000.parquet")
    manifest = Manifest("dsfp", 1, "demo", "images", Counts(n, n, 0, 0), {}, ["part-00000.parquet"], {}, 0.0)
    return store, manifest


def test_the_page_renders_every_thumbnail_row_and_the_chart_in_chromium(tmp_path):
    n, shown = 12, 8
    store, manifest = _store_with_shard(tmp_path, n)
    mine = _rows({f"img{i:02d}": i / n for i in range(n)})
    mine[0]["caption"] = "<img src=x onerror=alert(1)> a caption that must stay text"
    theirs = _rows({f"img{i:02d}": 0.5 for i in range(n)}, caption="a dog")
    side = side_by_side(mine, theirs)
    pairs = side[1]
    ids = {r["image_id"] for r in mine[:shown]} | {p["mine"]["image_id"] for p in pairs}
    thumbs = thumbnails(store, manifest, ids)
    assert set(thumbs) == ids and all(
        Image.open(io.BytesIO(__import__("base64").b64decode(u.split(",", 1)[1]))).size[0] <= 160
        for u in thumbs.values()
    )
    history = [{"model": "ckpt-1", "run_dir": "r1", "cider": 0.5}, {"model": "ckpt-2", "run_dir": "r2", "cider": 0.46}]
    metrics = {
        "stats": {"words": {"mean": 4.0}, "truncated_rate": 0.0, "failure_rate": 0.0},
        "reference": {"cider": 0.46},
    }
    compared = {
        "model": "ckpt-1",
        "significance": {
            "cider": {
                "delta": -0.04,
                "ci_low": -0.2,
                "ci_high": 0.1,
                "p_holm": 0.6,
                "verdict": "no detectable difference",
            }
        },
    }
    page = tmp_path / "report.html"
    page.write_text(
        render_html("ckpt-2", manifest, metrics, mine, thumbs, chart_png(history, "r2"), compared, side, shown),
        encoding="utf-8",
    )
    dom = DomCounts(rendered_dom(page, tmp_path / "profile"))
    assert dom.rows["images"] == shown and dom.row_ids["images"] == sorted(r["image_id"] for r in mine)[:shown]
    assert dom.rows["side-by-side"] == len(pairs) == n - 1  # every image but the one scored 0.5 by both
    wins, losses = [f"img{i:02d}" for i in range(11, 6, -1)], [f"img{i:02d}" for i in range(6)]
    assert dom.row_ids["side-by-side"] == wins + losses  # the largest win first, then the largest loss
    assert len(dom.images) == shown + len(pairs) + 1  # thumbnails, side by side, the chart; the caption stays text
    assert dom.body["data-images-loaded"] == str(len(dom.images))  # every one decoded by the browser
    assert "a caption that must stay text" in page.read_text(encoding="utf-8")
