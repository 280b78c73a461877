"""Storage on any fsspec URI: atomic writes, listings, Parquet and JSON, on disk and on S3 (moto)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

from captionflow.data.storage import Store, open_fs, storage_options


def test_local_writes_are_atomic_and_listed_in_order(tmp_path):
    store = Store(str(tmp_path / "root"))
    store.write_json({"b": 1, "a": [1, 2]}, "x", "m.json")
    store.write_text("hello", "x", "r.md")
    store.write_bytes(b"\0\1", "x", "blob.bin")
    assert store.read_json("x", "m.json") == {"a": [1, 2], "b": 1}
    assert store.read_bytes("x", "r.md") == b"hello"
    assert [p.rsplit("/", 1)[-1] for p in store.ls("x")] == ["blob.bin", "m.json", "r.md"]
    assert store.ls("x", suffix=".json") == [store.path("x", "m.json")]
    assert store.ls("nope") == []
    assert not [f for f in os.listdir(tmp_path / "root" / "x") if f.startswith(".")]  # no temporary left
    store.remove("x")
    assert not store.exists("x")


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    store = Store(str(tmp_path))

    def boom(fh):
        fh.write(b"half")
        raise OSError(28, "No space left on device")

    try:
        store._write(boom, "half.bin")
    except OSError:
        pass
    assert os.listdir(tmp_path) == []


def test_parquet_tables_ids_and_binary_columns(tmp_path):
    store = Store(str(tmp_path))
    store.write_table(pa.table({"image_id": ["a", "b"], "image": [b"\xff\xd8", b"\xff\xd8"]}), "s", "p0.parquet")
    store.write_table(pa.table({"image_id": ["c"], "extra": [1]}), "s", "p1.parquet")
    both = store.read_tables(store.ls("s", suffix=".parquet"))
    assert both.num_rows == 3 and set(both.column_names) == {"image_id", "image", "extra"}
    assert store.ids(store.ls("s", suffix=".parquet")) == {"a", "b", "c"}
    assert store.read_tables([]) is None
    meta = pq.read_metadata(store.path("s", "p0.parquet")).row_group(0)
    cols = {meta.column(i).path_in_schema: meta.column(i) for i in range(meta.num_columns)}
    assert cols["image"].compression == "UNCOMPRESSED" and cols["image_id"].compression == "ZSTD"


def test_s3_store_round_trip_without_credentials_in_its_options(s3_bucket):
    store = Store(f"s3://{s3_bucket}/root")
    assert store.url("a", "b.json") == f"s3://{s3_bucket}/root/a/b.json"
    store.write_json({"ok": True}, "a", "b.json")
    assert store.read_json("a", "b.json") == {"ok": True} and store.exists("a", "b.json")
    opts = storage_options(store.uri)
    assert opts["endpoint_url"] == os.environ["AWS_ENDPOINT_URL"]
    assert "testing" not in repr(opts) and not any("key" in k or "secret" in k for k in opts)  # no secret travels
    assert opts["config_kwargs"]["read_timeout"] > 0 and opts["config_kwargs"]["connect_timeout"] > 0
    fs, path = open_fs(f"s3://{s3_bucket}/root/a/b.json")
    assert fs.cat_file(path) == store.read_bytes("a", "b.json")


def test_a_full_disk_names_the_file_and_stays_permanent(tmp_path):
    """A real full filesystem (a 64 KiB tmpfs): the error names the file being written, is one line, leaves no
    temporary file, and the retry policy still sees ENOSPC (never retried)."""
    import errno
    import subprocess

    import pyarrow as pa
    import pytest

    from captionflow.data.storage import Store
    from captionflow.errors import CaptionflowError, StorageFull
    from tasks.policy import is_permanent

    root = tmp_path / "tiny"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(root)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        store = Store(str(root))
        store.write_json({"small": 1}, "ok.json")  # what fits is written
        big = pa.table({"b": [bytes(range(256)) * 1024] * 4})  # 1 MiB, uncompressible
        with pytest.raises(StorageFull) as e:
            store.write_table(big, "runs", "part-1.parquet")
        assert str(e.value) == f"no space left to write {root}/runs/part-1.parquet (No space left on device)"
        assert isinstance(e.value, CaptionflowError) and e.value.errno == errno.ENOSPC and is_permanent(e.value)
        assert sorted(p.name for p in (root / "runs").iterdir()) == []  # no partial or temporary file
        assert (root / "ok.json").read_text()  # data already written stays
    finally:
        subprocess.run(["umount", str(root)], check=False)
