"""A dataset's images fitted to the engine's grid: fitted once per shard and kept, read back exactly, never
used for another shard or a changed one, on a local disk and through the S3 protocol."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import captionflow.workers.images as images
from captionflow.data.storage import Store
from captionflow.workers.fitted_images import HEIGHT, RGB, WIDTH, cache_key, fitted_array, fitted_path
from captionflow.workers.image_prompt import ImagePrompt
from captionflow.workers.llm_rows import caption_request, judge_request, read_pending_rows

GRID = (28, 56 * 56, 112 * 112)  # a Qwen2-VL-style grid: factor, min and max pixels


def _jpeg(seed: int, size=(200, 150)) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _shard(store: Store, name: str, seeds: list[int], ids: list[str] | None = None) -> str:
    table = pa.table(
        {
            "image_id": ids or [f"img-{s}" for s in seeds],
            "image": [_jpeg(s) for s in seeds],
            "references": [[f"caption {s}"] for s in seeds],
        }
    )
    return store.write_table(table, "datasets", "fp", "shards", name)


def _read(store: Store, shard: str, folder: str, pending: list[str], columns=("image_id", "image")) -> list[dict]:
    batch = pa.table({"shard": [shard], "fitted": [fitted_path(folder, shard)]})
    out = read_pending_rows(batch, fs=store.fs, columns=list(columns), pending=pa.array(pending), grid=GRID)
    return out.to_pylist()


def _decoded(seed: int) -> np.ndarray:
    return images.engine_image(_jpeg(seed), GRID)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store(str(tmp_path / "out"))
    return Store(f"s3://{request.getfixturevalue('s3_bucket')}/out")


def test_fitted_once_then_read_back_exactly_without_decoding(store, monkeypatch):
    shard = _shard(store, "part-00000.parquet", [1, 2, 3])
    folder = store.path("datasets", "fp", "fitted", cache_key(GRID))
    first = _read(store, shard, folder, ["img-1", "img-3"])
    assert [r["image_id"] for r in first] == ["img-1", "img-3"]  # the pending rows only
    assert store.fs.exists(fitted_path(folder, shard))
    kept = store.read_table(fitted_path(folder, shard))
    assert kept["image_id"].to_pylist() == ["img-1", "img-2", "img-3"]  # the whole shard, for the next run

    want = [_decoded(2), _decoded(3)]

    def no_decoding(*a, **k):
        raise AssertionError("decoded although the fitted images are kept")

    monkeypatch.setattr(images, "engine_image", no_decoding)
    again = _read(store, shard, folder, ["img-2", "img-3"])
    for row, decoded in zip(again, want, strict=True):
        got = fitted_array(dict(row))
        assert got.dtype == np.uint8 and got.flags.writeable
        assert np.array_equal(got, decoded)  # exactly what decoding gives
        assert got.shape[0] % GRID[0] == 0 and got.shape[1] % GRID[0] == 0
        assert got.shape[0] * got.shape[1] <= GRID[2]


def test_requests_from_fitted_rows_equal_requests_decoded_from_the_shard(tmp_path):
    store = Store(str(tmp_path / "out"))
    shard = _shard(store, "part-00000.parquet", [4, 5])
    folder = store.path("datasets", "fp", "fitted", cache_key(GRID))
    prompt = ImagePrompt("<s>", "<u><image>", "</u><a>")
    kw = {"image_prompt": prompt, "sampling": {"max_tokens": 8}, "grid": GRID}
    fitted = _read(store, shard, folder, ["img-4", "img-5"], ("image_id", "image", "references"))
    plain = store.read_table(shard).to_pylist()
    for f, p in zip(fitted, plain):
        assert f["references"] == p["references"]  # the other columns travel as they are
        a = caption_request(dict(f), system_prompt="s", prompt="p", fail_ids=frozenset(), **kw)
        b = caption_request(dict(p), system_prompt="s", prompt="p", fail_ids=frozenset(), **kw)
        assert a.keys() == b.keys() and not {RGB, HEIGHT, WIDTH, "image"} & a.keys()
        assert np.array_equal(a["multimodal_data"]["image"], b["multimodal_data"]["image"])
        j = judge_request(dict(f), captions={f["image_id"]: "a cat"}, **kw)
        assert np.array_equal(j["multimodal_data"]["image"], b["multimodal_data"]["image"])


def test_a_changed_shard_or_a_broken_file_is_fitted_again(tmp_path):
    store = Store(str(tmp_path / "out"))
    folder = store.path("datasets", "fp", "fitted", cache_key(GRID))
    shard = _shard(store, "part-00000.parquet", [1, 2])
    _read(store, shard, folder, ["img-1"])
    # the shard rebuilt with other images under the same ids: the kept arrays are not its images
    _shard(store, "part-00000.parquet", [7, 8], ids=["img-1", "img-2"])
    row = _read(store, shard, folder, ["img-1"])[0]
    assert np.array_equal(fitted_array(dict(row)), _decoded(7))
    # a file cut short
    path = fitted_path(folder, shard)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    row = _read(store, shard, folder, ["img-2"])[0]
    assert np.array_equal(fitted_array(dict(row)), _decoded(8))
    assert pq.read_table(path).num_rows == 2  # replaced by a whole one
    # another shard's file under this shard's name
    other = _shard(store, "part-00001.parquet", [9])
    _read(store, other, folder, ["img-9"])
    Path(path).write_bytes(Path(fitted_path(folder, other)).read_bytes())
    assert np.array_equal(fitted_array(dict(_read(store, shard, folder, ["img-1"])[0])), _decoded(7))


def test_a_shard_with_nothing_pending_is_not_fitted(tmp_path):
    store = Store(str(tmp_path / "out"))
    folder = store.path("datasets", "fp", "fitted", cache_key(GRID))
    shard = _shard(store, "part-00000.parquet", [1, 2])
    assert _read(store, shard, folder, ["img-99"]) == []
    assert not store.fs.exists(fitted_path(folder, shard))


def test_the_key_changes_with_the_grid():
    assert cache_key(GRID) == cache_key(tuple(GRID))
    assert cache_key(GRID) != cache_key((28, 56 * 56, 224 * 224)) != cache_key((14, 56 * 56, 112 * 112))
