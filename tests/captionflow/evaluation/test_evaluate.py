"""The evaluate stage on a real preprocessed dataset with captions written by hand (the engine is not the
subject here; tests/e2e runs it): slices, scores.parquet, both reports."""

from __future__ import annotations

import json

import pyarrow as pa
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.layout import CAPTIONS, run_parts
from captionflow.data.sources import ingest
from captionflow.data.storage import Store
from captionflow.evaluation.evaluate import evaluate
from captionflow.results import InferenceResult
from captionflow.stages.preprocess import preprocess
from captionflow.workers.llm_rows import CAPTION_SCHEMA
from tests.support.browser import DomCounts

COLOURS = {"a/1.png": "red", "a/2.png": "green", "a/3.png": "blue", "b/1.png": "white", "b/2.png": "black"}


def test_a_folder_is_sliced_by_its_sub_folders(tmp_path):
    ds = tmp_path / "ds"
    for name, colour in {**COLOURS, "top.png": "yellow"}.items():
        (ds / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40 + len(name), 30), colour).save(ds / name)
    refs = {name: f"a plain {colour} square" for name, colour in {**COLOURS, "top.png": "yellow"}.items()}
    (ds / "captions.jsonl").write_text(
        "".join(json.dumps({"file_name": k, "captions": v}) + "\n" for k, v in refs.items()), encoding="utf-8"
    )
    cfg = RunConfig(dataset=str(ds), output=str(tmp_path / "out"), device="cpu")
    manifest = preprocess(ingest(cfg), cfg)
    store = Store(cfg.output)
    shards = store.read_tables(
        [store.path("datasets", manifest.dataset_fingerprint, "shards", s) for s in manifest.shards],
        columns=["image_id", "source"],
    ).to_pylist()
    # slice a captioned as its references say, slice b with nonsense
    captions = {r["image_id"]: refs[r["source"]] if not r["source"].startswith("b/") else "zzz" for r in shards}
    run = run_parts(manifest.dataset_fingerprint, "model-fp", "gen-fp")
    rows = [
        {"image_id": i, "caption": c, "finish_reason": "stop", "num_input_tokens": 9, "num_output_tokens": 4,
         "model_fingerprint": "model-fp", "error": "", "attempt": 0}
        for i, c in captions.items()
    ]  # fmt: skip
    store.write_table(pa.Table.from_pylist(rows, schema=CAPTION_SCHEMA), *run, CAPTIONS, "part-0.parquet")
    inference = InferenceResult(store.url(*run), run, len(rows), len(rows), 0, 0, [], {})
    result = evaluate(cfg.output, manifest, inference, "my-ckpt", bootstrap_resamples=0, report_images=4)

    sl = {r["slice"]: r for r in result.metrics["slices"]}
    assert {k: v["n"] for k, v in sl.items()} == {"(top level)": 1, "a": 3, "b": 2}
    assert sl["a"]["cider"] > sl["b"]["cider"] and sl["a"]["rouge_l"] == 1.0 and sl["b"]["rouge_l"] == 0.0
    scores = store.read_table(store.path(*run, "scores.parquet")).to_pylist()
    assert {r["source"]: r["slice"] for r in scores} == {
        **{k: k.split("/")[0] for k in COLOURS},
        "top.png": "(top level)",
    }
    assert "## Per slice" in (tmp_path / "out" / "/".join(run) / "report.md").read_text(encoding="utf-8")
    page = DomCounts((tmp_path / "out" / "/".join(run) / "report.html").read_text(encoding="utf-8"))
    assert page.rows["images"] == 4 and len(page.images) == 4 + 1  # report_images thumbnails and the chart
    assert all(src.startswith("data:image/jpeg;base64,") for src in page.images[1:])


def test_the_bootstrap_beside_the_verdict_uses_the_baselines_scores_already_read(tmp_path):
    """The sequential verdict's baseline is often the previous or the best run, whose scores the comparison has
    read: they are used, not read again; a baseline not among them is read from its folder."""
    import numpy as np
    import pyarrow.parquet as pq

    from captionflow.evaluation.evaluate import bootstrap_beside_verdict

    rng = np.random.default_rng(5)
    ids = [f"i{k:03d}" for k in range(200)]
    theirs = [{"image_id": i, "cider": float(x)} for i, x in zip(ids, rng.uniform(1, 2, len(ids)))]
    mine = [{"image_id": r["image_id"], "cider": r["cider"] - 0.8} for r in theirs]
    record = {"decision": "worse", "score": "CIDEr-D", "against_run": str(tmp_path / "baseline")}
    # never written: only the rows given can answer
    got = bootstrap_beside_verdict(record, mine, 200, read={record["against_run"]: theirs})
    assert got["verdict"] == "worse" and got["agrees"] and got["n_images"] == 200
    assert "cannot read" in bootstrap_beside_verdict(record, mine, 200, read={str(tmp_path / "other"): theirs})["error"]
    (tmp_path / "baseline").mkdir()
    pq.write_table(pa.Table.from_pylist(theirs), tmp_path / "baseline" / "scores.parquet")
    assert bootstrap_beside_verdict(record, mine, 200) == got  # read from its folder: the same answer
