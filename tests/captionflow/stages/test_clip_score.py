"""The reference-free score: the built-in CLIP, the scorer actor, the pass through real Ray Data, and CLIPScore as
the sequential verdict's score."""

from __future__ import annotations

import io
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.layout import CAPTIONS, run_parts
from captionflow.data.sources import ingest
from captionflow.data.storage import Store
from captionflow.errors import DatasetError, ModelError
from captionflow.evaluation.evaluate import bootstrap_beside_verdict, clip_per_image
from captionflow.model_source import resolve_clip
from captionflow.preflight import OptionError, check_inputs, preflight
from captionflow.results import InferenceResult
from captionflow.stages.clip_score import OrderedImages, PrefixClipScore, run_clip, scorer_placement
from captionflow.stages.inference import sequential_verdict
from captionflow.stages.preprocess import preprocess
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


def _dataset(tmp_path, **options):
    """Five plain images (no references), preprocessed; the run's checks, its store, shards and image ids."""
    (tmp_path / "ds").mkdir()
    for colour in COLOURS:
        Image.new("RGB", (40, 30), colour).save(tmp_path / "ds" / f"{colour}.png")
    cfg = RunConfig(
        dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"), device="cpu", clip_model="builtin", **options
    )
    checked = preflight(cfg)
    manifest = preprocess(ingest(cfg), cfg)
    store = Store(cfg.output)
    shards = [store.path("datasets", manifest.dataset_fingerprint, "shards", s) for s in manifest.shards]
    return cfg, checked, manifest, store, shards, store.ids(shards)


def _captioned(store, manifest, model_fp: str, captions: dict[str, str]) -> InferenceResult:
    """A run folder of ``model_fp`` holding ``captions``, as inference commits them."""
    run = run_parts(manifest.dataset_fingerprint, model_fp, "g")
    rows = [
        {"image_id": i, "caption": c, "finish_reason": "stop", "num_input_tokens": 1, "num_output_tokens": 1,
         "model_fingerprint": model_fp, "error": "", "attempt": 0}
        for i, c in sorted(captions.items())
    ]  # fmt: skip
    store.write_table(pa.Table.from_pylist(rows, schema=CAPTION_SCHEMA), *run, CAPTIONS, "part-0.parquet")
    return InferenceResult(store.url(*run), run, len(rows), len(rows), 0, 0, [], {})


COLOURS = ("red", "green", "blue", "white", "black")


def test_every_caption_is_scored_through_ray_data_and_a_rerun_scores_none_again(tmp_path):
    cfg, checked, manifest, store, _, ids = _dataset(tmp_path)
    inference = _captioned(store, manifest, "m", {i: f"caption {n}" for n, i in enumerate(sorted(ids))})
    res = run_clip(cfg, manifest, inference, checked.clip, checked.engine)
    assert res.scored == 5 and res.failed == 0 and 0.0 <= res.mean <= CLIP_WEIGHT
    scores = pq.read_table(f"{res.clip_dir}/scores").to_pylist()
    assert {r["image_id"] for r in scores} == ids
    files = sorted(p.name for p in (tmp_path / "out").rglob("clip/*/scores/*.parquet"))
    again = run_clip(cfg, manifest, inference, checked.clip, checked.engine)
    assert (
        again.mean == res.mean and sorted(p.name for p in (tmp_path / "out").rglob("clip/*/scores/*.parquet")) == files
    )


def test_the_stage_scores_on_a_gpu_of_the_run_after_its_engines_else_on_their_cpus(tmp_path):
    from dataclasses import replace

    from captionflow.engines.presets import GPU

    (tmp_path / "ds").mkdir()
    Image.new("RGB", (40, 30), "red").save(tmp_path / "ds" / "red.png")
    cpu = preflight(RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"), device="cpu")).engine
    # CPU: the captioning engine's threads, a map task's share of Ray's CPUs
    assert scorer_placement(cpu, warm=False) == ({"num_cpus": cpu.preset.map_cpus}, {"device": "cpu", "threads": 1})
    # engines started for the run on 2 GPUs, 4 on each: they are gone by then, and CLIP takes one of their GPUs
    gpus = replace(cpu, preset=GPU, engines_per_gpu=4, gpu_share=0.25, concurrency=8)
    resources, where = scorer_placement(gpus, warm=False)
    assert resources["num_gpus"] == 1 and where == {"device": "cuda", "threads": None}
    # warm engines keep their GPUs (and Ray's GPU resources): a GPU asked for would never be granted, and the stage
    # would wait forever; on the CPU with the threads their engine actors have (8 x 4)
    resources, where = scorer_placement(gpus, warm=True)
    assert "num_gpus" not in resources and where == {"device": "cpu", "threads": 32}


def test_a_clipscore_verdict_scores_both_sides_as_the_clip_stage_does(tmp_path):
    """A dataset without references: the sequential verdict's score is CLIPScore (verdict_score auto, clip_model
    set), computed in the driver by the stage's scorer on the same shard images; the bootstrap beside it reads the
    baseline's scores by the same CLIP checkpoint."""
    cfg, checked, manifest, store, shards, ids = _dataset(tmp_path)
    order = sorted(ids)
    mine = {i: f"a {c} square" if n % 2 else "a photo of a dog" for n, (i, c) in enumerate(zip(order, COLOURS))}
    theirs = dict.fromkeys(order, "something else entirely")
    runs = {"m": _captioned(store, manifest, "m", mine), "base": _captioned(store, manifest, "base", theirs)}
    staged = {
        k: clip_per_image(run_clip(cfg, manifest, r, checked.clip, checked.engine).clip_dir) for k, r in runs.items()
    }

    scorer = PrefixClipScore(checked.clip, store, shards, order, window=2)  # the images in two windows
    got = scorer({i: mine[i] for i in order[:2]}) | scorer({i: mine[i] for i in order[2:]})
    got_theirs = scorer(theirs)  # the images' embeddings from the first calls
    for side, expected in ((got, staged["m"]), (got_theirs, staged["base"])):
        assert side.keys() == ids and all(abs(side[i] - expected[i]) < 1e-5 for i in ids)
    assert len({round(v, 6) for v in got.values()}) > 1  # not one value for every caption

    seq = cfg.model_copy(update={"verdict": "sequential", "verdict_against": runs["base"].run_dir})
    verdict = sequential_verdict(seq, store, runs["m"].run_parts, shards, ids, checked.clip)
    verdict.observe(mine)
    rec = verdict.record()
    assert rec["score"] == "CLIPScore" and rec["metric"] == "clip_score" and rec["images_total"] == 5
    assert rec["images_used"] == 5 and rec["clip_model"] == "builtin"
    difference = sum(staged["m"][i] - staged["base"][i] for i in ids) / 5
    assert abs(rec["mean_difference"] - difference) < 1e-5
    rows = [{"image_id": i, "clip_score": s} for i, s in staged["m"].items()]
    boot = bootstrap_beside_verdict(rec, rows, 200)
    assert boot["n_images"] == 5 and abs(boot["delta"] - difference) < 1e-9
    # the baseline without CLIPScores by this checkpoint: said, not a crash
    assert (
        "has no CLIPScores by builtin"
        in bootstrap_beside_verdict({**rec, "baseline_scores": str(tmp_path)}, rows, 9)["error"]
    )

    # the images are read a window of the order at a time, at most one window beyond the one being taken from
    lazy = OrderedImages(store, shards, order, window=1)  # windows of 1, 2 and 2 images
    first = lazy.take(order[:1])
    assert list(first) == order[:1] and first[order[0]][:2] == b"\xff\xd8"  # a JPEG of the shard
    time.sleep(0.5)  # time enough to read the whole set, were it not bounded
    assert lazy._loaded == 3 and sorted(lazy._bytes) == sorted(order[1:3])
    assert sorted(lazy.take(order[3:])) == sorted(order[3:]) and lazy._loaded == 5
    with pytest.raises(DatasetError, match="not in the dataset's shards"):
        lazy.take(order[3:])  # each image handed out once
    waiting = OrderedImages(store, shards, order, window=1)
    waiting.close()  # a verdict in: the reading thread ends
    waiting.thread.join(timeout=10)
    assert not waiting.thread.is_alive()

    # without references: CIDEr-D asked for, or no clip_model to fall back on, is a one-line error naming the fix
    with pytest.raises(DatasetError, match="no reference captions to score CIDEr-D against"):
        sequential_verdict(seq.model_copy(update={"verdict_score": "cider"}), store, runs["m"].run_parts, shards, ids)
    with pytest.raises(DatasetError, match="set clip_model for a CLIPScore verdict"):
        sequential_verdict(seq, store, runs["m"].run_parts, shards, ids, None)
    with pytest.raises(OptionError, match="verdict_score clip needs clip_model"):
        check_inputs(seq.model_copy(update={"verdict_score": "clip", "clip_model": None}))
