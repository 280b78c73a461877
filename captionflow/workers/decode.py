"""The per-item work of the preprocess stage, run in Ray workers.

A Ray worker imports the module of the function it runs: this one needs only Pillow, pyarrow and
fsspec, not Prefect or Ray (importing Prefect costs each worker over a second of CPU, a large share of
a small job on few cores). The driver's side is ``captionflow/stages/preprocess.py``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pyarrow as pa

from captionflow.workers.images import Rejected, normalise_image

RESULT_SCHEMA = pa.schema(
    [  # one row per image: accepted (image_id set) or rejected (reason set)
        ("item", pa.int64()),  # the work item it came from (the driver finds items whose block was lost)
        ("source", pa.string()),
        ("image_id", pa.string()),
        ("image", pa.binary()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("orig_format", pa.string()),
        ("orig_width", pa.int32()),
        ("orig_height", pa.int32()),
        ("references", pa.list_(pa.string())),
        ("slice", pa.string()),  # the slice_column's value of a Parquet row (None: no slice column)
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("size_bytes", pa.int64()),
    ]
)


def _row(source: str, refs: list[str], reason: str, detail: str, size: int) -> dict:
    """A result row, so far without an image (a rejected input keeps it so)."""
    return {
        "item": -1,
        "source": source,
        "image_id": "",
        "image": b"",
        "width": 0,
        "height": 0,
        "orig_format": "",
        "orig_width": 0,
        "orig_height": 0,
        "references": refs,
        "slice": None,
        "reason": reason,
        "detail": detail[:300],
        "size_bytes": size,
    }


_DECODING: list = [None]  # (monotonic start, source) of the image this process is decoding now, if any
_TIMEOUT: list = [0.0]  # decode_timeout_s of the stage that used this process last (a pooled worker serves many)
_WATCHDOG: list = []  # the watchdog thread of this process, once started


def _watch() -> None:
    while True:
        seconds = _TIMEOUT[0]
        time.sleep(min(1.0, seconds / 4) if seconds else 1.0)
        now = _DECODING[0]
        if seconds and now is not None and time.monotonic() - now[0] > seconds:
            sys.stderr.write(
                f"captionflow: {now[1]!r} still decoding after {seconds:g} s (decode_timeout_s):"
                " ending this worker process\n"
            )
            sys.stderr.flush()
            os._exit(75)  # a decoder stuck in C cannot be interrupted; the stage treats this as a crash


def start_watchdog(seconds: float | None) -> None:
    """End this process when one image takes longer than ``seconds`` to decode and normalise: a file
    that hangs its decoder then costs its worker, like one that crashes it (see ``captionflow/stages/preprocess.py``:
    the block is retried, then its items run alone, and the one that hangs again is quarantined).
    One thread per process; each call sets the limit it applies from then on (None or 0: none)."""
    _TIMEOUT[0] = float(seconds or 0)
    if seconds and not _WATCHDOG:
        _WATCHDOG.append(threading.Thread(target=_watch, daemon=True, name="decode-watchdog"))
        _WATCHDOG[0].start()


def _result(source: str, data: bytes, refs: list[str], max_side: int, max_pixels: int, max_bytes: int) -> dict:
    row = _row(source, refs, "", "", len(data))
    _DECODING[0] = (time.monotonic(), source)
    try:
        if len(data) > max_bytes:
            raise Rejected("too_large", f"{len(data)} bytes > budget {max_bytes}")
        n = normalise_image(data, max_side, max_pixels)
    except Rejected as r:
        row.update(reason=r.reason, detail=r.detail)
        return row
    except Exception as e:  # whatever else a hostile file provokes costs this input, never the run
        row.update(reason="decode_error", detail=f"unexpected {type(e).__name__} while normalising: {e}")
        return row
    finally:
        _DECODING[0] = None
    row.update(
        image_id=n.image_id,
        image=n.data,
        width=n.width,
        height=n.height,
        orig_format=n.orig_format,
        orig_width=n.orig_width,
        orig_height=n.orig_height,
    )
    return row


def process_item(
    item: dict,
    *,
    fs,
    kind: str,
    image_column: str | None,
    caption_column: str | None,
    references: dict,
    slice_column: str | None = None,
    max_side: int,
    max_pixels: int,
    max_bytes: int,
    root: str = "",
    allow_external_paths: bool = False,
) -> list[dict]:
    """One work item -> result rows (accepted: image_id set; rejected: reason set)."""
    path = item["path"].decode("utf-8", "surrogateescape")
    if kind == "images":
        refs = references.get(item["name"], [])
        if item["problem"]:  # listed, but must not be opened (a FIFO would block this worker forever)
            return [_row(item["name"], refs, "unreadable", item["problem"], item["size"])]
        if item["size"] > max_bytes:  # known from the listing: not read at all
            return [_row(item["name"], refs, "too_large", f"{item['size']} bytes > budget {max_bytes}", item["size"])]
        try:
            data = fs.cat_file(path)
        except Exception as e:  # OSError, or what a storage client lets through (botocore's own errors)
            return [_row(item["name"], refs, "unreadable", f"{type(e).__name__}: {e}", item["size"])]
        return [_result(item["name"], data, refs, max_side, max_pixels, max_bytes)]
    out: list[dict] = []
    try:
        with fs.open(path, "rb") as fh:
            for i, img, cap, sl in _rows_of(fh, item["row_group"], image_column, caption_column, slice_column):
                row = _parquet_row(
                    item, i, img, cap, fs, path, max_side, max_pixels, max_bytes, root, allow_external_paths
                )
                row["slice"] = None if sl is None else str(sl)
                out.append(row)
    except Exception as e:  # corrupt pages under an intact footer, a file changed or gone since the listing
        if out:  # rows already done stay done; the rest of the row group is what could not be read
            done = len(out)
            return out + failed_rows(
                {**item, "first_row": item["first_row"] + done, "rows": item["rows"] - done},
                "unreadable",
                f"row group {item['row_group']} could not be read past row {done}: {type(e).__name__}: {e}",
            )
        return failed_rows(
            item, "unreadable", f"row group {item['row_group']} could not be read: {type(e).__name__}: {e}"
        )
    return out


def _parquet_row(
    item: dict,
    i: int,
    img,
    cap,
    fs,
    path: str,
    max_side: int,
    max_pixels: int,
    max_bytes: int,
    root: str,
    allow_external_paths: bool,
) -> dict:
    source = f"{item['name']}#{item['first_row'] + i}"
    refs = [cap] if isinstance(cap, str) else [str(c) for c in cap if c is not None] if cap else []
    if isinstance(img, dict):  # Hugging Face datasets' Image feature: {bytes, path}
        ref = img.get("path")
        source = f"{source}:{ref}" if ref else source
        img = img.get("bytes")
        if img is None and ref:  # an image stored by path, not embedded
            return _by_path(fs, path, ref, source, refs, max_side, max_pixels, max_bytes, root, allow_external_paths)
    if img is None:
        return _row(source, refs, "empty_file", "the image is null in this row", 0)
    return _result(source, img, refs, max_side, max_pixels, max_bytes)


ROWS_AT_ONCE = 32  # rows of a row group decoded from Parquet at a time


def _rows_of(fh, row_group: int, image_column: str, caption_column: str | None, slice_column: str | None):
    """(row in the row group, image, caption, slice) a few rows at a time, read through a 1 MiB buffer: a worker
    holds a part of the row group, not the whole column chunk decoded at once (a 137 MB row group read whole
    peaked at 4.4x its size, read like this at 2.4x)."""
    import pyarrow.parquet as pq

    wanted = [image_column, caption_column, slice_column]
    cols = list(dict.fromkeys(c for c in wanted if c))
    pf = pq.ParquetFile(fh, pre_buffer=False, buffer_size=2**20)
    i = 0
    for batch in pf.iter_batches(batch_size=ROWS_AT_ONCE, row_groups=[row_group], columns=cols):
        values = [batch.column(cols.index(c)).to_pylist() if c else [None] * batch.num_rows for c in wanted]
        for img, cap, sl in zip(*values):
            yield i, img, cap, sl
            i += 1


def failed_rows(item: dict, reason: str, detail: str) -> list[dict]:
    """One rejected row for every input of a work item (an image file, or each row of a row group)."""
    if item["row_group"] < 0:
        return [_row(item["name"], [], reason, detail, item["size"])]
    return [_row(f"{item['name']}#{item['first_row'] + i}", [], reason, detail, 0) for i in range(item["rows"])]


class _Refused(Exception):
    """A path row that names something outside the dataset."""


def _confine(fs, parquet_path: str, ref: str, root: str, allow: bool) -> tuple:
    """(filesystem, path) a path row may be read from: relative to the Parquet file's folder unless absolute,
    and - unless ``allow`` (allow_external_paths) - under the dataset's own folder on the same store, never a
    URL, never through a symbolic link that leads out of it."""
    import os
    import posixpath

    from captionflow.data.storage import open_fs

    if "://" in ref:
        if not allow:
            raise _Refused(
                f"{ref!r} is a URL; path rows may only name files in the dataset's folder "
                "(allow_external_paths reads it)"
            )
        return open_fs(ref)
    path = posixpath.normpath(ref if ref.startswith("/") else posixpath.join(posixpath.dirname(parquet_path), ref))
    if allow:
        return fs, path
    top = fs._strip_protocol(root).rstrip("/") if root else posixpath.dirname(parquet_path)
    if not (path + "/").startswith(top + "/"):
        raise _Refused(
            f"{ref!r} leads to {path!r}, outside the dataset's folder {top!r} (allow_external_paths reads it)"
        )
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        real, real_top = os.path.realpath(path), os.path.realpath(top)
        if not (real + "/").startswith(real_top.rstrip("/") + "/"):
            raise _Refused(
                f"{ref!r} is a symbolic link to {real!r}, outside the dataset's folder (allow_external_paths reads it)"
            )
    return fs, path


def _by_path(
    fs,
    parquet_path: str,
    ref: str,
    source: str,
    refs: list[str],
    max_side: int,
    max_pixels: int,
    max_bytes: int,
    root: str = "",
    allow: bool = False,
) -> dict:
    """A row whose image is only a path: read it if it may be read (``_confine``)."""
    from captionflow.data.storage import local_special

    try:
        rfs, rpath = _confine(fs, parquet_path, ref, root, allow)
    except _Refused as r:
        return _row(source, refs, "refused_path", str(r), 0)
    try:
        info, problem = rfs.info(rpath), ""
        if info.get("type") != "file":  # a local link is read through; a FIFO would block this worker forever
            info, problem = local_special(rpath, info) if info.get("type") == "other" else (info, "not a file")
        if problem:
            return _row(source, refs, "unreadable", f"{ref}: {problem}", 0)
        size = int(info.get("size") or 0)
        if size > max_bytes:
            return _row(source, refs, "too_large", f"{ref}: {size} bytes > budget {max_bytes}", size)
        data = rfs.cat_file(rpath)
    except Exception as e:  # missing file, no access, unknown protocol
        return _row(
            source, refs, "unreadable", f"no image bytes in the row; its path {ref!r}: {type(e).__name__}: {e}", 0
        )
    return _result(source, data, refs, max_side, max_pixels, max_bytes)


MMAP_THRESHOLD = 32 * 2**20  # allocations above this go straight to mmap and back to the OS when freed
TRIM_THRESHOLD = 64 * 2**20  # freed memory at the top of a heap kept for reuse, up to this much


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next image instead of handing it back to the OS.

    The actor runs its blocks on a thread of its own, so its allocations come from a glibc thread
    arena; with the default, dynamic thresholds that arena's heap shrank after nearly every image and
    the next decode faulted its ~1 MB of pixel buffers in again: 60-350 page faults per 640x480 image
    against 8 in a plain loop, and up to 20% more CPU per image. Fixed thresholds keep up
    to TRIM_THRESHOLD of freed memory per heap, while a buffer over MMAP_THRESHOLD (a huge image) is
    still returned as soon as it is freed. No effect (False) where the C library has no ``mallopt``."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own allocator policy stays
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, TRIM_THRESHOLD))


class ItemProcessor:
    """``process_item`` over a block of work items, with the stage's parameters bound: the callable
    class that the preprocess stage's Ray Data actor pool runs (see ``captionflow/stages/preprocess.py`` for why
    actors, not tasks). A block in, one Arrow table of results out, built here with its schema
    (a per-row ``flat_map`` had Ray Data hand each row over and infer the column types)."""

    def __init__(self, decode_timeout_s: float | None = None, **params):
        from captionflow.data.storage import bound_s3_retries

        bound_s3_retries()
        self.params = params
        keep_freed_memory()
        start_watchdog(decode_timeout_s)

    def __call__(self, items: pa.Table) -> pa.Table:
        rows = []
        for item in items.to_pylist():
            try:
                out = process_item(item, **self.params)
            except Exception as e:  # a surprise costs this item (an image, or a row group), never its block
                out = failed_rows(item, "decode_error", f"unexpected {type(e).__name__} while processing it: {e}")
            for row in out:
                row["item"] = item["item"]
                rows.append(row)
        return pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)


def process_alone(item: dict, params: dict) -> pa.Table:
    """One work item in a Ray task of its own: the preprocess stage's second chance for the items of a
    block whose worker died (a decoder crash takes its whole block with it)."""
    return ItemProcessor(**params)(pa.Table.from_pylist([item]))
