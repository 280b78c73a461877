"""The reference-free score: the built-in CLIP, the scorer actor, and the pass through real Ray Data."""

from __future__ import annotations

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.layout import CAPTIONS, run_parts
from captionflow.data.sources import ingest
from captionflow.data.storage import Store
from captionflow.errors import ModelError
from captionflow.model_source import resolve_clip
from captionflow.pipeline.clip_score import run_clip
from captionflow.pipeline.preprocess import preprocess
from captionflow.preflight import preflight
from captionflow.results import InferenceResult
from captionflow.workers.clip_rows import CLIP_WEIGHT, ClipScorer
from captionflow.workers.llm_rows import CAPTION_SCHEMA


def _jpeg(colour: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (90, 60), colour).save(buf, format="JPEG")
    return buf.getvalue()


def test_the_scorer_gives_a_clip_score_per_row_and_an_error_for_a_bad_image():
    clip = resolve_clip("builtin")
    assert clip == resolve_clip("builtin")  # built once, the same fingerprint
    captions = {"a": "a red square", "b": "a cat lying on a table next to a cup of coffee " * 20, "c": "x"}
    scorer = ClipScorer(clip.path, captions)
    batch = pa.table({"image_id": ["a", "b", "c"], "image": [_jpeg("red"), _jpeg("red"), b"not an image"]})
    rows = scorer(batch).to_pylist()
    assert [r["image_id"] for r in rows] == ["c", "a", "b"]
    assert rows[0]["clip_score"] is None and rows[0]["error"].startswith("cannot decode")
    assert all(0.0 <= r["clip_score"] <= CLIP_WEIGHT and r["error"] == "" for r in rows[1:])  # b: truncated to 77
    again = ClipScorer(clip.path, captions)(batch.slice(0, 2)).to_pylist()
    assert [r["clip_score"] for r in again] == [r["clip_score"] for r in rows[1:]]  # deterministic


def test_a_clip_model_that_is_not_one_is_refused_before_any_work(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        resolve_clip(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    with pytest.raises(ModelError, match="model_type is 'qwen2_vl', not 'clip'"):
        resolve_clip(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(ModelError, match="no weights"):
        resolve_clip(str(tmp_path))


def test_every_caption_is_scored_through_ray_data_and_a_rerun_scores_none_again(tmp_path):
    (tmp_path / "ds").mkdir()
    for colour in ("red", "green", "blue", "white", "black"):
        Image.new("RGB", (40, 30), colour).save(tmp_path / "ds" / f"{colour}.png")
    cfg = RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"), device="cpu", clip_model="builtin")
    checked = preflight(cfg)
    manifest = preprocess(ingest(cfg), cfg)
    store = Store(cfg.output)
    ids = store.ids([store.path("datasets", manifest.dataset_fingerprint, "shards", s) for s in manifest.shards])
    run = run_parts(manifest.dataset_fingerprint, "m", "g")
    rows = [
        {"image_id": i, "caption": f"caption {n}", "finish_reason": "stop", "num_input_tokens": 1,
         "num_output_tokens": 1, "model_fingerprint": "m", "error": "", "attempt": 0}
        for n, i in enumerate(sorted(ids))
    ]  # fmt: skip
    store.write_table(pa.Table.from_pylist(rows, schema=CAPTION_SCHEMA), *run, CAPTIONS, "part-0.parquet")
    inference = InferenceResult(store.url(*run), run, 5, 5, 0, 0, [], {})
    res = run_clip(cfg, manifest, inference, checked.clip, checked.engine)
    assert res.scored == 5 and res.failed == 0 and 0.0 <= res.mean <= CLIP_WEIGHT
    scores = pq.read_table(f"{res.clip_dir}/scores").to_pylist()
    assert {r["image_id"] for r in scores} == ids
    files = sorted(p.name for p in (tmp_path / "out").rglob("clip/*/scores/*.parquet"))
    again = run_clip(cfg, manifest, inference, checked.clip, checked.engine)
    assert (
        again.mean == res.mean and sorted(p.name for p in (tmp_path / "out").rglob("clip/*/scores/*.parquet")) == files
    )
