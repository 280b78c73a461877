"""Ingest + preprocess: every input lands in exactly one place, from any source."""

from __future__ import annotations

import io
import os
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hostile import ACCEPTED, add_local_specials, build_corpus
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.sources import ingest
from captionflow.data.storage import Store
from captionflow.errors import DatasetError
from captionflow.results import Manifest
from captionflow.stages.preprocess import LARGEST_TASK, SMALLEST_TASK, preprocess, task_sizes, work_items

ROOT = Path(__file__).resolve().parents[3]


def _outcomes(cfg: RunConfig, manifest) -> dict[str, str]:
    store = Store(cfg.output)
    base = ("datasets", manifest.dataset_fingerprint)
    acc = store.read_tables([store.path(*base, "shards", s) for s in manifest.shards])
    q = store.read_table(store.path(*base, "quarantine.parquet")).to_pylist()
    out = dict.fromkeys(acc.column("source").to_pylist() if acc is not None else [], ACCEPTED)
    for r in q:
        assert r["source"] not in out, f"{r['source']} landed twice"
        assert r["detail"], r
        out[r["source"]] = r["reason"]
    return out


def test_hostile_corpus_every_file_in_exactly_one_place(tmp_path):
    expected = build_corpus(tmp_path / "corpus")
    expected.update(add_local_specials(tmp_path / "corpus", tmp_path / "outside"))
    cfg = RunConfig(dataset=str(tmp_path / "corpus"), output=str(tmp_path / "out"), shard_rows=4)
    ing = ingest(cfg)
    assert ing.n_inputs == len(expected)  # hidden files are not inputs
    m = preprocess(ing, cfg)
    assert _outcomes(cfg, m) == expected
    c = asdict(m.counts)
    assert c["accepted"] + c["quarantined"] + c["duplicates"] == c["listed"] == len(expected)
    assert len(m.shards) == -(-c["accepted"] // 4)  # shards bounded by shard_rows
    store = Store(cfg.output)
    rows = store.read_tables([store.path("datasets", m.dataset_fingerprint, "shards", s) for s in m.shards]).to_pylist()
    for r in rows:
        assert max(r["width"], r["height"]) <= cfg.max_image_side
        assert Image.open(io.BytesIO(r["image"])).mode == "RGB"
    by_source = {r["source"]: r for r in rows}
    assert (by_source["exif_rotated.jpg"]["width"], by_source["exif_rotated.jpg"]["height"]) == (100, 300)
    assert by_source["huge_8000x6000.jpg"]["orig_width"] == 8000
    assert by_source["animated.gif"]["orig_format"] == "GIF"
    q = {
        r["source"]: r
        for r in store.read_table(store.path("datasets", m.dataset_fingerprint, "quarantine.parquet")).to_pylist()
    }
    assert "FIFO" in q["pipe.jpg"]["detail"] and "broken symbolic link" in q["broken_link.jpg"]["detail"]
    assert "directory" in q["linked_folder"]["detail"]
    assert q["sparse_600mb.jpg"]["size_bytes"] == 600 * 2**20
    assert "448x2 once the long side is bounded" in q["banner_2000x10.png"]["detail"]


def test_golden_skip_and_change_detection(tmp_path):
    corpus = tmp_path / "corpus"
    build_corpus(corpus)
    cfg = RunConfig(dataset=str(corpus), output=str(tmp_path / "out"))
    first = ingest(cfg)
    assert not first.already_preprocessed
    preprocess(first, cfg)
    again = ingest(cfg)
    assert again.already_preprocessed and again.dataset_fingerprint == first.dataset_fingerprint
    assert preprocess(again, cfg).skipped is True
    assert not ingest(cfg.model_copy(update={"force_preprocess": True})).already_preprocessed
    (corpus / "added.png").write_bytes((corpus / "one_pixel.png").read_bytes())
    added = ingest(cfg)
    assert added.dataset_fingerprint != first.dataset_fingerprint and not added.already_preprocessed
    os.remove(corpus / "added.png")
    assert ingest(cfg).dataset_fingerprint == first.dataset_fingerprint
    p = corpus / "cmyk.jpg"
    p.write_bytes(p.read_bytes() + b"\0")  # modified content (size changes)
    assert ingest(cfg).dataset_fingerprint != first.dataset_fingerprint


def test_task_sizes_ramp_up_and_down_and_cover_every_file():
    for n in (0, 1, 63, 64, 100, 2000, 6000, 20000, 100_003):
        for workers in (1, 2, 16):
            sizes = task_sizes(n, workers)
            assert sum(sizes) == n and all(0 < k <= LARGEST_TASK for k in sizes), (n, workers, sizes)
    sizes = task_sizes(20000, 2)
    assert sizes[:2] == [SMALLEST_TASK] * 2 and sizes[-2:] == [SMALLEST_TASK] * 2  # each worker starts small
    assert sizes.count(LARGEST_TASK) >= len(sizes) - 12  # full-size tasks in the middle


def test_work_items_are_one_table_in_listing_order(tmp_path):
    """Built a chunk at a time (here 7 files per chunk): every listed file once, numbered by its place."""
    expected = build_corpus(tmp_path / "c")
    ing = ingest(RunConfig(dataset=str(tmp_path / "c"), output=str(tmp_path / "o")))
    items = work_items(ing, chunk=7)
    assert items.num_rows == len(expected) == ing.n_inputs and items["item"].to_pylist() == list(range(len(expected)))
    assert items["name"].to_pylist() == [f["name"] for f in ing.files] and set(items["name"].to_pylist()) == set(
        expected
    )
    assert items.slice(10, 5).to_pylist() == work_items(ing).slice(10, 5).to_pylist()


def test_many_tasks_keep_listing_order_and_the_first_duplicate(tmp_path):
    """Enough files for several tasks of different sizes: shards hold the accepted images in listing
    order, a duplicate is recorded against the first copy listed, and image bytes are stored
    uncompressed (JPEG already is) while the other columns are zstd."""
    corpus = tmp_path / "many"
    corpus.mkdir()
    for i in range(150):
        colour = (i, 255 - i, (7 * i) % 256)
        Image.new("RGB", (40 + i % 5, 30), colour).save(corpus / f"img_{i:03d}.png")
    (corpus / "img_149_copy.png").write_bytes((corpus / "img_003.png").read_bytes())
    cfg = RunConfig(dataset=str(corpus), output=str(tmp_path / "out"))
    ing = ingest(cfg)
    assert len(task_sizes(ing.n_inputs, 2)) >= 3
    m = preprocess(ing, cfg)
    assert asdict(m.counts) == {"listed": 151, "accepted": 150, "quarantined": 0, "duplicates": 1}
    store = Store(cfg.output)
    base = ("datasets", m.dataset_fingerprint)
    paths = [store.path(*base, "shards", s) for s in m.shards]
    assert store.read_tables(paths).column("source").to_pylist() == [f"img_{i:03d}.png" for i in range(150)]
    q = store.read_table(store.path(*base, "quarantine.parquet")).to_pylist()
    assert [(r["source"], r["reason"], r["detail"]) for r in q] == [
        ("img_149_copy.png", "duplicate", "same content as img_003.png")
    ]
    meta = pq.ParquetFile(paths[0]).metadata.row_group(0)
    codecs = {meta.column(i).path_in_schema: meta.column(i).compression for i in range(meta.num_columns)}
    assert codecs["image"] == "UNCOMPRESSED" and codecs["image_id"] == "ZSTD", codecs
    stats = {meta.column(i).path_in_schema: meta.column(i).is_stats_set for i in range(meta.num_columns)}
    assert not stats["image"] and stats["image_id"], stats
    assert not [f for f in os.listdir(os.path.dirname(paths[0])) if f.startswith(".")]  # no temporary left


def _hf_parquet(path, n_files: int = 2) -> list[str]:
    """Hugging Face `datasets`-style Parquet: image struct {bytes, path} plus a list of captions."""
    photo = Image.effect_mandelbrot((160, 120), (-2, -1.2, 1, 1.2), 32).convert("RGB")
    expected = []
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for f in range(n_files):
        recs = []
        for i in range(5):
            b = io.BytesIO()
            photo.rotate(f * 50 + i * 7).save(b, format="PNG")
            data = b.getvalue() if (f, i) != (1, 3) else b.getvalue()[:60]  # a truncated PNG
            recs.append(
                {
                    "image": {"bytes": data, "path": f"img_{f}_{i}.png"},
                    "captions": [f"caption {f} {i}", "another"],
                    "kind": ["even", "odd"][i % 2],
                }
            )
            expected.append(ACCEPTED if (f, i) != (1, 3) else "decode_error")
        schema = pa.schema([("image", struct), ("captions", pa.list_(pa.string())), ("kind", pa.string())])
        table = pa.Table.from_pylist(recs, schema=schema)
        pq.write_table(table, path / f"train-{f:05d}.parquet", row_group_size=2)
    return expected


def test_parquet_dataset_with_struct_images_and_captions(tmp_path):
    (tmp_path / "ds").mkdir()
    expected = _hf_parquet(tmp_path / "ds")
    cfg = RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"))
    ing = ingest(cfg)
    assert ing.kind == "parquet" and ing.n_inputs == 10 and ing.image_column == "image"
    m = preprocess(ing, cfg)
    outcomes = _outcomes(cfg, m)
    assert len(outcomes) == 10
    assert outcomes["train-00001.parquet#3:img_1_3.png"] == "decode_error"
    assert sorted(outcomes.values()) == sorted(expected)
    store = Store(cfg.output)
    rows = store.read_tables([store.path("datasets", m.dataset_fingerprint, "shards", s) for s in m.shards]).to_pylist()
    assert all(r["references"] and r["references"][1] == "another" for r in rows)
    assert all(r["slice"] is None for r in rows)  # no slice column asked for


def test_a_parquet_slice_column_is_carried_into_the_shards(tmp_path):
    (tmp_path / "ds").mkdir()
    _hf_parquet(tmp_path / "ds")
    plain = ingest(RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out")))
    cfg = RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"), slice_column="kind")
    ing = ingest(cfg)
    assert ing.dataset_fingerprint != plain.dataset_fingerprint and ing.slice_column == "kind"
    m = preprocess(ing, cfg)
    store = Store(cfg.output)
    rows = store.read_tables([store.path("datasets", m.dataset_fingerprint, "shards", s) for s in m.shards]).to_pylist()
    want = {f"train-0000{f}.parquet#{i}:img_{f}_{i}.png": ["even", "odd"][i % 2] for f in range(2) for i in range(5)}
    assert len(rows) == 9 and all(r["slice"] == want[r["source"]] for r in rows)
    with pytest.raises(DatasetError, match=r"no slice column 'nope' \(has \['image', 'captions', 'kind'\]\)"):
        ingest(cfg.model_copy(update={"slice_column": "nope"}))
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "a.png")
    with pytest.raises(DatasetError, match="is a folder of images: slice_column names a Parquet column"):
        ingest(RunConfig(dataset=str(tmp_path / "imgs"), output=str(tmp_path / "o"), slice_column="kind"))


def test_parquet_rows_without_embedded_bytes(tmp_path):
    """Rows that hold an image by path only (relative to the Parquet file's folder, or absolute inside it), a
    path that does not exist and null images: read, or quarantined with the reason; none dropped. A path that
    leads out of the dataset's folder (absolute, ``..``, a symbolic link, a URL) is refused unread unless
    allow_external_paths is set, and no byte of a refused file reaches the outputs."""
    (tmp_path / "ds" / "imgs").mkdir(parents=True)
    Image.new("RGB", (64, 48), "red").save(tmp_path / "ds" / "imgs" / "a.png")
    Image.new("RGB", (64, 48), "green").save(tmp_path / "ds" / "imgs" / "inside.png")
    Image.new("RGB", (64, 48), "blue").save(tmp_path / "abs.png")
    (tmp_path / "secret.txt").write_bytes(b"CANARYFILESECRET_k9Zt2 do not copy")
    os.symlink(tmp_path / "secret.txt", tmp_path / "ds" / "imgs" / "link.png")
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    recs = [
        {"image": {"bytes": None, "path": "imgs/a.png"}, "caption": "red"},
        {"image": {"bytes": None, "path": str(tmp_path / "abs.png")}, "caption": None},
        {"image": {"bytes": None, "path": "imgs/missing.png"}, "caption": "x"},
        {"image": None, "caption": "null image"},
        {"image": {"bytes": None, "path": None}, "caption": "neither"},
        {"image": {"bytes": None, "path": "imgs/pipe"}, "caption": "a FIFO"},
        {"image": {"bytes": None, "path": str(tmp_path / "ds" / "imgs" / "inside.png")}, "caption": "green"},
        {"image": {"bytes": None, "path": "../secret.txt"}, "caption": "up and out"},
        {"image": {"bytes": None, "path": "imgs/link.png"}, "caption": "a link out"},
        {"image": {"bytes": None, "path": "http://127.0.0.1:9/x.png"}, "caption": "a URL"},
    ]
    os.mkfifo(tmp_path / "ds" / "imgs" / "pipe")
    pq.write_table(
        pa.Table.from_pylist(recs, schema=pa.schema([("image", struct), ("caption", pa.string())])),
        tmp_path / "ds" / "train.parquet",
    )
    cfg = RunConfig(dataset=str(tmp_path / "ds" / "train.parquet"), output=str(tmp_path / "out"))
    m = preprocess(ingest(cfg), cfg)
    assert _outcomes(cfg, m) == {
        "train.parquet#0:imgs/a.png": ACCEPTED,
        f"train.parquet#1:{tmp_path / 'abs.png'}": "refused_path",
        "train.parquet#2:imgs/missing.png": "unreadable",
        "train.parquet#3": "empty_file",
        "train.parquet#4": "empty_file",
        "train.parquet#5:imgs/pipe": "unreadable",
        f"train.parquet#6:{tmp_path / 'ds' / 'imgs' / 'inside.png'}": ACCEPTED,
        "train.parquet#7:../secret.txt": "refused_path",
        "train.parquet#8:imgs/link.png": "refused_path",
        "train.parquet#9:http://127.0.0.1:9/x.png": "refused_path",
    }
    store = Store(cfg.output)
    rows = store.read_tables([store.path("datasets", m.dataset_fingerprint, "shards", s) for s in m.shards])
    assert rows.column("references").to_pylist() == [["red"], ["green"]]
    for f in (tmp_path / "out").rglob("*"):  # nothing of the secret file anywhere in the outputs
        assert not f.is_file() or b"CANARYFILESECRET" not in f.read_bytes(), f

    allowed = cfg.model_copy(update={"allow_external_paths": True, "output": str(tmp_path / "out2")})
    outcomes = _outcomes(allowed, preprocess(ingest(allowed), allowed))
    assert outcomes[f"train.parquet#1:{tmp_path / 'abs.png'}"] == ACCEPTED
    assert outcomes["train.parquet#7:../secret.txt"] == "not_an_image"  # read when allowed; its bytes still not copied
    for f in (tmp_path / "out2").rglob("*"):
        assert not f.is_file() or b"CANARYFILESECRET" not in f.read_bytes(), f


def test_parquet_corrupt_row_group_quarantines_its_rows_only(tmp_path):
    """A row group whose pages are damaged under an intact footer: each of its rows is quarantined
    (unreadable, with the error); the other row group's rows go through. A folder whose files
    disagree on the image column is refused at the listing, before any work."""
    images = []
    for colour in ("red", "green", "blue", "white", "black", "grey"):
        Image.new("RGB", (64, 48), colour).save(buf := io.BytesIO(), "PNG")
        images.append(buf.getvalue())
    good = images[-1]
    table = pa.table({"image": images})
    path = tmp_path / "ds" / "data.parquet"
    path.parent.mkdir()
    pq.write_table(table, path, row_group_size=3, compression="snappy")
    meta = pq.ParquetFile(path).metadata
    chunk = meta.row_group(0).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start : start + 32] = b"\xff" * 32  # the first row group's page header, not the footer
    path.write_bytes(bytes(raw))
    cfg = RunConfig(dataset=str(path), output=str(tmp_path / "out"))
    ing = ingest(cfg)
    assert ing.n_inputs == 6
    m = preprocess(ing, cfg)
    out = _outcomes(cfg, m)
    assert [out[f"data.parquet#{i}"] for i in range(3)] == ["unreadable"] * 3, out
    assert [out[f"data.parquet#{i}"] for i in range(3, 6)] == [ACCEPTED] * 3
    store = Store(cfg.output)
    q = store.read_table(store.path("datasets", m.dataset_fingerprint, "quarantine.parquet")).to_pylist()
    assert all("row group 0 could not be read" in r["detail"] for r in q if r["reason"] == "unreadable")

    pq.write_table(pa.table({"img": [good]}), tmp_path / "ds" / "other.parquet")  # a different image column
    with pytest.raises(DatasetError, match=r"other.parquet: no image column"):
        ingest(RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out")))


def test_caption_sidecars_csv_with_bom_jsonl_and_bad_encoding(tmp_path):
    (tmp_path / "ds").mkdir()
    Image.new("RGB", (32, 32), "red").save(tmp_path / "ds" / "a.png")
    Image.new("RGB", (32, 32), "blue").save(tmp_path / "ds" / "b.png")
    sidecar = tmp_path / "ds" / "captions.csv"  # as a spreadsheet exports it: UTF-8 with a byte-order mark
    sidecar.write_bytes("file_name,caption\na.png,un carré rouge\na.png,red\nb.png,blue\n".encode("utf-8-sig"))
    cfg = RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"))
    ing = ingest(cfg)
    assert ing.references == {"a.png": ["un carré rouge", "red"], "b.png": ["blue"]} and ing.n_inputs == 2
    sidecar.unlink()
    (tmp_path / "ds" / "captions.jsonl").write_text('{"file_name": "b.png", "captions": "blue"}\n\n', encoding="utf-8")
    assert ingest(cfg).references == {"b.png": ["blue"]}
    (tmp_path / "ds" / "captions.jsonl").write_bytes('{"file_name": "a.png", "captions": "carré"}\n'.encode("latin-1"))
    with pytest.raises(DatasetError, match=r"captions.jsonl: not UTF-8 text"):
        ingest(cfg)
    (tmp_path / "ds" / "captions.jsonl").write_text('{"file": "a.png"}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"captions.jsonl:1: 'file_name' must be a file name"):
        ingest(cfg)
    # a number where a name belongs crashed later with an unnamed TypeError: refused here, naming the line
    (tmp_path / "ds" / "captions.jsonl").write_text('{"file_name": "b.png", "captions": "blue"}\n{"file_name": 5, '
                                                    '"captions": "x"}\n', encoding="utf-8")  # fmt: skip
    with pytest.raises(DatasetError, match=r"captions.jsonl:2: 'file_name' must be a file name \(text\), got 5"):
        ingest(cfg)
    (tmp_path / "ds" / "captions.jsonl").write_text('{"file_name": "b.png", "captions": ["ok", 7]}\n')
    with pytest.raises(DatasetError, match=r"captions.jsonl:1: 'captions' must be a caption or a list of captions"):
        ingest(cfg)


def test_bad_sources_say_what_and_where(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        ingest(RunConfig(dataset=str(tmp_path / "missing"), output=str(tmp_path / "o")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no files"):
        ingest(RunConfig(dataset=str(tmp_path / "empty"), output=str(tmp_path / "o")))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "pq" / "a.parquet")
    with pytest.raises(DatasetError, match="no image column"):
        ingest(RunConfig(dataset=str(tmp_path / "pq"), output=str(tmp_path / "o")))
    (tmp_path / "pq0").mkdir()
    pq.write_table(pa.table({"image": pa.array([], pa.binary())}), tmp_path / "pq0" / "a.parquet")
    with pytest.raises(DatasetError, match="0 rows"):
        ingest(RunConfig(dataset=str(tmp_path / "pq0"), output=str(tmp_path / "o")))
    (tmp_path / "pqn").mkdir()
    pq.write_table(pa.table({"image": [b"x"], "score": [0.5]}), tmp_path / "pqn" / "a.parquet")
    with pytest.raises(DatasetError, match="caption column 'score' is double"):
        ingest(RunConfig(dataset=str(tmp_path / "pqn"), output=str(tmp_path / "o"), caption_column="score"))


def test_parquet_columns_by_type_and_empty_files(tmp_path, caplog):
    """Of the usual column names, only one of a fitting type is taken (a numeric "text" column is not
    reference captions: it made every row a decode_error); a file with no rows adds none and loses none."""
    (tmp_path / "ds").mkdir()
    jpg = io.BytesIO()
    Image.new("RGB", (40, 30), "red").save(jpg, format="JPEG")
    pq.write_table(
        pa.table({"image": pa.array([], pa.binary()), "text": pa.array([], pa.float64())}),
        tmp_path / "ds" / "a-empty.parquet",
    )
    pq.write_table(pa.table({"image": [jpg.getvalue(), b"junk"], "text": [1.5, 2.0]}), tmp_path / "ds" / "b.parquet")
    cfg = RunConfig(dataset=str(tmp_path / "ds"), output=str(tmp_path / "out"))
    with caplog.at_level("WARNING"):
        ing = ingest(cfg)
        assert ing.caption_column is None and ing.n_inputs == 2
        assert "column 'text' is double, not text" in caplog.text
        m = preprocess(ing, cfg)
    assert _outcomes(cfg, m) == {"b.parquet#0": ACCEPTED, "b.parquet#1": "not_an_image"}
    assert "lost" not in caplog.text


def test_s3_source_and_output(s3_bucket, tmp_path):
    import boto3

    expected = build_corpus(tmp_path / "corpus")
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    for rel in expected:
        s3.upload_file(str(tmp_path / "corpus" / rel), s3_bucket, f"images/{rel}")
    s3.put_object(Bucket=s3_bucket, Key="images/sub dir/", Body=b"")  # a console "folder": not an input
    cfg = RunConfig(dataset=f"s3://{s3_bucket}/images", output=f"s3://{s3_bucket}/out")
    ing = ingest(cfg)
    assert ing.n_inputs == len(expected) and all(f["etag"] for f in ing.files)
    m = preprocess(ing, cfg)
    assert _outcomes(cfg, m) == expected
    assert ingest(cfg).already_preprocessed  # golden skip from the S3 listing (ETags), no decoding
    time.sleep(1.1)
    s3.put_object(Bucket=s3_bucket, Key="images/photo.jpg", Body=b"changed")
    assert not ingest(cfg).already_preprocessed


def _without_root_file_powers() -> None:
    """In a child process before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the capability
    bounding set (prctl PR_CAPBSET_DROP), so that root obeys file permissions after exec."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unlistable_folder_and_hidden_entries_are_accounted_for(tmp_path):
    """A folder that cannot be listed is one input, quarantined as unreadable (fsspec's walk would drop
    it without a word); hidden entries are not inputs but are counted. Permissions do not bind root, so
    as root the listing runs in a child process without root's file powers."""
    import json
    import subprocess
    import sys

    from captionflow.results import IngestResult

    ds = tmp_path / "ds"
    for sub in ("open", "locked", ".git", "open/.thumbs"):
        (ds / sub).mkdir(parents=True)
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 140, 30)).save(buf, "JPEG")
    for rel in ("a.jpg", "open/b.jpg", "locked/c.jpg", ".DS_Store", ".git/config", "open/.thumbs/a.jpg"):
        (ds / rel).write_bytes(buf.getvalue())
    (ds / "locked").chmod(0)
    cfg = RunConfig(dataset=str(ds), output=str(tmp_path / "out"))
    try:
        if os.geteuid() == 0:
            code = (
                "import json, sys; sys.path.insert(0, sys.argv[1]); from captionflow.config import RunConfig;"
                "from captionflow.data.sources import ingest;"
                " print('ING' + json.dumps(ingest(RunConfig(dataset=sys.argv[2], output=sys.argv[3])).to_dict()))"
            )
            p = subprocess.run(
                [sys.executable, "-c", code, str(ROOT), str(ds), cfg.output],
                preexec_fn=_without_root_file_powers,
                capture_output=True,
                text=True,
                timeout=300,
            )
            line = next((x for x in p.stdout.splitlines() if x.startswith("ING")), None)
            assert line, p.stderr[-3000:]
            ing = IngestResult(**json.loads(line[3:]))
        else:
            ing = ingest(cfg)
    finally:
        (ds / "locked").chmod(0o755)
    assert ing.n_inputs == 3 and ing.hidden_skipped == 3
    assert sorted(ing.hidden_examples) == [".DS_Store", ".git/", "open/.thumbs/"]  # hidden folders not walked
    m = preprocess(ing, cfg)  # the folder is listable again by now: quarantined from the listing, never opened
    assert asdict(m.counts) == {"listed": 3, "accepted": 1, "quarantined": 1, "duplicates": 1}
    store = Store(cfg.output)
    q = store.read_table(store.path("datasets", m.dataset_fingerprint, "quarantine.parquet")).to_pylist()
    locked = next(r for r in q if r["source"] == "locked/")
    assert locked["reason"] == "unreadable" and "PermissionError" in locked["detail"], locked


_CRASHING_DECODER = """
import os
from PIL import Image, ImageFile


class _Crash(ImageFile.ImageFile):
    format = "CRASHME"

    def _open(self):
        os.abort()  # a decoder that takes its process down, as a segfault in a native decoder does


Image.register_open("CRASHME", _Crash, lambda prefix: prefix[:8] == b"CRASHME!")


class _Hang(ImageFile.ImageFile):
    format = "HANGME"

    def _open(self):
        import time
        while True:  # a decoder that never returns
            time.sleep(0.1)


Image.register_open("HANGME", _Hang, lambda prefix: prefix[:8] == b"HANGME!!")
"""


@pytest.mark.slow
def test_a_file_that_crashes_or_hangs_its_worker_is_quarantined_not_retried_forever(tmp_path):
    """A file whose decoder kills the worker process (here a real SIGABRT from a Pillow plugin that
    every process of a fresh Ray loads through sitecustomize): Ray Data would restart the worker and
    retry the block forever. The block is retried twice, then each of its files runs alone; the
    poison is quarantined with the reason, every other file goes through. A file whose decoder never
    returns ends its worker after decode_timeout_s and is handled the same way."""
    import json
    import subprocess
    import sys

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_CRASHING_DECODER)
    ds = tmp_path / "ds"
    ds.mkdir()
    for i in range(12):
        Image.new("RGB", (64, 48), (20 * i, 100, 200)).save(ds / f"img_{i:02d}.png")
    (ds / "img_05_poison.jpg").write_bytes(b"CRASHME!" + bytes(100))
    (ds / "img_09_hang.png").write_bytes(b"HANGME!!" + bytes(100))
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from captionflow.config import RunConfig;"
        "from captionflow.data.sources import ingest; from captionflow.stages.preprocess import preprocess;"
        "cfg = RunConfig(dataset=sys.argv[2], output=sys.argv[3], device='cpu', decode_timeout_s=3);"
        "print('MANIFEST' + json.dumps(preprocess(ingest(cfg), cfg).to_json()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), str(ds), str(tmp_path / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("MANIFEST")), None)
    assert line, p.stderr[-4000:]
    m = Manifest.from_json(json.loads(line[len("MANIFEST") :]))
    assert asdict(m.counts) == {"listed": 14, "accepted": 12, "quarantined": 2, "duplicates": 0}
    cfg = RunConfig(dataset=str(ds), output=str(tmp_path / "out"))
    out = _outcomes(cfg, m)
    assert out.pop("img_05_poison.jpg") == "decode_error" and out.pop("img_09_hang.png") == "decode_error"
    assert set(out.values()) == {ACCEPTED}
    store = Store(cfg.output)
    q = store.read_table(store.path("datasets", m.dataset_fingerprint, "quarantine.parquet")).to_pylist()
    assert all("worker process died" in r["detail"] and "decode_timeout_s=3" in r["detail"] for r in q), q
