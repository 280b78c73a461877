"""Storage on any fsspec URI (local path or s3://): atomic writes, JSON and Parquet helpers.

Every output is committed atomically: written to a temporary name and renamed on a local disk,
one PUT on an object store. Readers therefore never see a half-written shard, and a file that
exists is a finished one.
"""

from __future__ import annotations

import errno
import io
import json
import os
import posixpath
import uuid
from collections.abc import Iterable
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

from captionflow.errors import StorageFull


def storage_options(uri: str) -> dict[str, Any]:
    """Options made explicit so that the filesystem object carries them to Ray workers.

    For s3:// the endpoint comes from ``AWS_ENDPOINT_URL`` (S3-compatible stores, the tests' local
    server). Credentials are *not* copied: s3fs/botocore read them from the environment, the
    instance profile or the config files on each machine, so they never travel in a pickled
    filesystem, a log line or an output file.

    Every S3 call has a connect and a read timeout and a bounded number of attempts (botocore's
    ``standard`` retry mode, s3fs's own retries), so that an endpoint that accepts connections and never
    answers fails a call in about a minute and a half instead of hanging a stage:
    ``CAPTIONFLOW_S3_CONNECT_TIMEOUT`` (10 s), ``CAPTIONFLOW_S3_READ_TIMEOUT`` (20 s),
    ``CAPTIONFLOW_S3_ATTEMPTS`` (2 by botocore, each retried twice by s3fs, ``CAPTIONFLOW_S3_RETRIES``).
    """
    if not uri.startswith(("s3://", "s3a://")):
        return {}
    env = os.environ
    opts: dict[str, Any] = {
        "config_kwargs": {
            "connect_timeout": float(env.get("CAPTIONFLOW_S3_CONNECT_TIMEOUT", 10)),
            "read_timeout": float(env.get("CAPTIONFLOW_S3_READ_TIMEOUT", 20)),
            "retries": {"max_attempts": int(env.get("CAPTIONFLOW_S3_ATTEMPTS", 2)), "mode": "standard"},
        },
    }
    bound_s3_retries()
    if env.get("AWS_ENDPOINT_URL"):
        opts["endpoint_url"] = env["AWS_ENDPOINT_URL"]
    return opts


def bound_s3_retries() -> None:
    """s3fs retries a failed call 5 times on top of botocore's attempts (a class attribute, not an option:
    it does not travel with a pickled filesystem), so each process that uses S3 sets it here; and uploads
    go without the ``Expect`` header that lets a silent endpoint hang them (``compat/s3_expect.py``)."""
    try:
        import s3fs
    except ImportError:
        return
    from captionflow.compat.s3_expect import drop_expect_header

    drop_expect_header()
    s3fs.S3FileSystem.retries = int(os.environ.get("CAPTIONFLOW_S3_RETRIES", 2))


class Store:
    """A storage root: ``Store("./out")`` or ``Store("s3://bucket/prefix")``."""

    def __init__(self, root: str, **options: Any):
        if "://" not in root:
            root = os.path.abspath(os.path.expanduser(root))
        self.fs, self.root = url_to_fs(root, **{**storage_options(root), **options})
        self.protocol = fs_protocol(self.fs)
        self.is_local = is_local_fs(self.fs)
        self.uri = root
        self._shard_ids: dict[str, list[str]] = {}  # ``shard_ids``'

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url(self, *parts: str) -> str:
        p = self.path(*parts)
        return p if self.is_local else f"{self.protocol}://{p}"

    def exists(self, *parts: str) -> bool:
        p = self.path(*parts)
        if not self.is_local:
            self.fs.invalidate_cache(p)
        return self.fs.exists(p)

    def ls(self, *parts: str, suffix: str = "") -> list[str]:
        """Full paths under a folder, sorted; empty when the folder does not exist. Object stores are asked
        afresh (not fsspec's listing cache): other writers add files."""
        p = self.path(*parts)
        if not self.is_local:
            self.fs.invalidate_cache(p)
        try:
            found = self.fs.ls(p, detail=False)
        except FileNotFoundError:  # never there, or its last object deleted meanwhile by another writer
            return []
        return sorted(x for x in found if x.endswith(suffix))

    def write_bytes(self, data: bytes, *parts: str) -> str:
        """Atomically write ``data``; returns the path."""
        return self._write(lambda fh: fh.write(data), *parts)

    def _write(self, fill, *parts: str) -> str:
        return write_atomically(self.fs, self.path(*parts), fill)

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def write_json(self, obj: Any, *parts: str) -> str:
        return self.write_bytes((json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode(), *parts)

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def write_text(self, text: str, *parts: str) -> str:
        return self.write_bytes(text.encode("utf-8"), *parts)

    def write_table(self, table: pa.Table, *parts: str) -> str:
        """Atomically write one Parquet file (``write_parquet``)."""
        return write_parquet(self.fs, self.path(*parts), table)

    def read_table(self, path: str, columns: Iterable[str] | None = None) -> pa.Table:
        """Read one Parquet file given its full path (as returned by ``ls``)."""
        cols = list(columns) if columns else None
        # local files by path: read through a Python file object, pyarrow 26 could abort the process at exit
        # ("terminate called without an active exception")
        if self.is_local:
            return pq.read_table(path, columns=cols)
        with self.fs.open(path, "rb") as fh:
            return pq.read_table(fh, columns=cols)

    def read_tables(self, paths: Iterable[str], columns: Iterable[str] | None = None) -> pa.Table | None:
        tables = [self.read_table(p, columns) for p in paths]
        return pa.concat_tables(tables, promote_options="default") if tables else None

    def read_unique(
        self, paths: Iterable[str], columns: Iterable[str] | None = None, key: str = "image_id"
    ) -> pa.Table | None:
        """Rows of some Parquet files, each ``key`` once (the first, in path order): two writers that raced
        past a lease cannot make a row count twice."""
        paths = list(paths)
        t = self.read_tables(paths, columns)
        if t is None or t.num_rows == 0:
            return t
        import pyarrow.compute as pc

        seen_at = pc.index_in(t[key], value_set=t[key])  # position of the first row with the same key
        keep = pc.equal(seen_at, pa.array(range(t.num_rows), pa.int32()))
        return t.filter(keep) if not pc.all(keep).as_py() else t

    def shard_ids(self, paths: Iterable[str]) -> dict[str, list[str]]:
        """The ``image_id`` column of each of a preprocessed dataset's shards, by path: read at once (16 at a time),
        then kept (a dataset's shards do not change once its manifest is written)."""
        import concurrent.futures

        paths = list(paths)
        todo = [p for p in dict.fromkeys(paths) if p not in self._shard_ids]
        if todo:
            with concurrent.futures.ThreadPoolExecutor(min(16, len(todo))) as pool:
                for p, t in zip(todo, pool.map(lambda p: self.read_table(p, ["image_id"]), todo)):
                    self._shard_ids[p] = t.column("image_id").to_pylist()
        return {p: self._shard_ids[p] for p in paths}

    def dataset_ids(self, paths: Iterable[str]) -> set[str]:
        """Every image id of a preprocessed dataset's shards (``shard_ids``: read once, then kept)."""
        return set().union(*self.shard_ids(paths).values())

    def ids(self, paths: Iterable[str]) -> set[str]:
        """The values of the ``image_id`` column of some Parquet files."""
        t = self.read_tables(list(paths), columns=["image_id"])
        return set(t.column("image_id").to_pylist()) if t is not None else set()

    def remove(self, *parts: str) -> None:
        p = self.path(*parts)
        if self.fs.exists(p):
            self.fs.rm(p, recursive=True)


def fs_protocol(fs: fsspec.AbstractFileSystem) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def is_local_fs(fs: fsspec.AbstractFileSystem) -> bool:
    return fs_protocol(fs) in ("file", "local")


def write_atomically(fs: fsspec.AbstractFileSystem, path: str, fill) -> str:
    """Atomically create the file at ``path`` with what ``fill(file)`` writes: locally into a hidden temporary
    file, fsynced and renamed into place; on object stores into memory, then one PUT, visible whole or not at
    all. Returns ``path``."""
    if is_local_fs(fs):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # hidden temporary name: directory readers (pyarrow, Spark, DuckDB) skip dot-files
        tmp = posixpath.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as fh:
                fill(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):  # "[Errno 28] No space left on device", and no path
                raise StorageFull(e.errno, f"no space left to write {path} ({os.strerror(e.errno)})", path) from None
            raise
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    else:
        buf = io.BytesIO()
        fill(buf)
        fs.pipe_file(path, buf.getvalue())
    return path


def write_parquet(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table) -> str:
    """Atomically write one Parquet file: zstd, except binary columns (encoded images, already compressed:
    zstd and dictionary encoding only cost CPU there, 2.5x the whole write's), which also get no min/max
    statistics (of JPEG bytes: meaningless). Written straight to the file where it is local, not through a
    buffer copied twice."""
    media = {f.name for f in table.schema if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type)}
    plain = [c for c in table.column_names if c not in media]

    def fill(fh) -> None:
        pq.write_table(
            table,
            fh,
            compression={c: "none" if c in media else "zstd" for c in table.column_names},
            use_dictionary=plain,
            write_statistics=plain,
        )

    return write_atomically(fs, path, fill)


def open_fs(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path) for any URI or local path."""
    if "://" not in uri:
        uri = os.path.abspath(os.path.expanduser(uri))
    return url_to_fs(uri, **storage_options(uri))


def local_special(path: str, info: dict) -> tuple[dict, str]:
    """A local entry that is not a plain file (fsspec lists it as type "other"): a symbolic link
    to a file is read through (``info`` gets the target's size and mtime, problem ""); anything
    else comes back with the problem that keeps it from being opened (reading a FIFO blocks forever)."""
    import stat

    link = f"symbolic link to {info['destination']!r}" if info.get("islink") else ""
    try:
        st = os.stat(path)  # follows links
    except OSError as e:
        return info, f"broken {link}: {type(e).__name__}: {e.strerror}" if link else f"{type(e).__name__}: {e}"
    if stat.S_ISREG(st.st_mode):
        return {**info, "size": st.st_size, "mtime": st.st_mtime}, ""
    what = (
        "a directory (not followed: links can loop)"
        if stat.S_ISDIR(st.st_mode)
        else "a FIFO"
        if stat.S_ISFIFO(st.st_mode)
        else "a socket"
        if stat.S_ISSOCK(st.st_mode)
        else "a device"
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
        else "not a regular file"
    )
    return info, f"{link}: {what}" if link else f"not a regular file: {what}"
