"""Captions produced elsewhere, matched to a real preprocessed dataset and written as a run."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.layout import EXTERNAL_GENERATION
from captionflow.data.sources import ingest
from captionflow.data.storage import Store
from captionflow.errors import DatasetError
from captionflow.evaluation.external import external_name, import_captions, read_caption_file
from captionflow.stages.preprocess import preprocess


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ext")
    for i, colour in enumerate(("red", "green", "blue")):
        (root / "ds" / "sub").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (30 + i, 20), colour).save(root / "ds" / ("sub" if i == 2 else "") / f"{colour}.png")
    cfg = RunConfig(dataset=str(root / "ds"), output=str(root / "out"), device="cpu")
    return cfg, preprocess(ingest(cfg), cfg)


def test_captions_are_matched_by_file_name_or_image_id_and_written_as_a_run(dataset, tmp_path):
    cfg, manifest = dataset
    store = Store(cfg.output)
    shards = store.read_tables(
        [store.path("datasets", manifest.dataset_fingerprint, "shards", s) for s in manifest.shards]
    )
    blue_id = next(r["image_id"] for r in shards.to_pylist() if r["source"] == "sub/blue.png")
    path = tmp_path / "caps.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in (
                {"file_name": "red.png", "caption": "a red square"},
                {"image_id": blue_id, "caption": "a blue square"},
                {"file_name": "red.png", "caption": "a second caption of red: the first is kept"},
                {"file_name": "nowhere.png", "caption": "x"},
            )
        ),
        encoding="utf-8",
    )
    run, unmatched = import_captions(cfg.output, manifest, str(path))
    assert unmatched == ["nowhere.png"] and run.captioned == 2 and run.failed == 1  # green has none
    assert run.run_parts[3] == EXTERNAL_GENERATION and run.run_parts[2].startswith("ext-")
    caps = {r["image_id"]: r["caption"] for r in pq.read_table(f"{run.run_dir}/captions").to_pylist()}
    assert caps[blue_id] == "a blue square" and "a red square" in caps.values()
    again, _ = import_captions(cfg.output, manifest, str(path))
    assert again.run_parts == run.run_parts  # the same captions: the same run
    parquet = tmp_path / "caps.parquet"
    pq.write_table(pa.table({"file_name": ["red.png"], "caption": ["a red square"]}), parquet)
    other, _ = import_captions(cfg.output, manifest, str(parquet))
    assert other.captioned == 1 and other.run_parts != run.run_parts
    assert external_name(str(parquet), None) == "external:caps.parquet"


def test_a_caption_file_that_names_nothing_usable_says_what_and_where(dataset, tmp_path):
    cfg, manifest = dataset
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"file_name": "red.png", "caption": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: not a JSON object"):
        read_caption_file(str(bad))
    bad.write_text('{"name": "red.png", "caption": "ok"}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"row 1 needs a text 'caption' and an 'image_id' or 'file_name'"):
        read_caption_file(str(bad))
    bad.write_text('{"file_name": "other.png", "caption": "ok"}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"none of its 1 rows names an image of dataset"):
        import_captions(cfg.output, manifest, str(bad))
    with pytest.raises(DatasetError, match="does not exist"):
        read_caption_file(str(tmp_path / "missing.jsonl"))
