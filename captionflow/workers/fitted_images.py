"""A dataset's images fitted to an engine's patch grid, kept beside its shards for the next run.

Every request carries its image as the RGB array the engine's image processor takes (``images.engine_image``:
decoded, resized to the patch grid). For a golden set - the same images, every checkpoint of an architecture -
that work is the same every run, and on a GPU host it competes for the CPU with the engines' front ends. So a
run's read task fits each dataset shard that has rows to caption once and keeps the arrays, raw and
uncompressed, in one Parquet file per shard under ``datasets/<dataset-fp>/fitted/<key>/`` (``key``: the grid,
this format and Pillow's version - anything that changes a pixel); the next run with the same grid reads them
instead of decoding. The arrays are exactly what decoding gives, so captions do not depend on whether they came
from here.

A file is used only when its ``image_id`` column equals its shard's, row for row, and it was fitted from a shard of
the same size; otherwise (a shard rebuilt, a file cut short or unreadable) the shard is fitted again and the file
replaced. Files are written atomically.
Runs decide which datasets get one (``engine_image_cache_max_images``: the arrays take ~150 KB an image at
224 px, ~600 KB at 448 px).
"""

from __future__ import annotations

import posixpath
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

FORMAT = "fitted-rgb/1"
RGB, HEIGHT, WIDTH = "fitted_rgb", "fitted_height", "fitted_width"  # what replaces a row's "image"
SHARD_BYTES = b"captionflow.shard_bytes"  # the size of the shard a file was fitted from (its metadata)
SCHEMA = pa.schema([("image_id", pa.string()), (RGB, pa.binary()), (HEIGHT, pa.int32()), (WIDTH, pa.int32())])


def cache_key(grid: tuple[int, int, int]) -> str:
    """The folder name of a grid's fitted images."""
    import PIL

    from captionflow.data.fingerprint import digest

    return digest({"grid": list(grid), "format": FORMAT, "pillow": PIL.__version__})


def fitted_path(folder: str, shard: str) -> str:
    """The fitted images of ``shard`` (a dataset shard's path) in ``folder``."""
    return posixpath.join(folder, posixpath.basename(shard))


def fit_table(table: pa.Table, grid: tuple[int, int, int]) -> pa.Table:
    """``table``'s images (``image_id``, ``image``: encoded bytes) fitted to ``grid``, as ``SCHEMA``."""
    from captionflow.workers.images import engine_image

    rgb, heights, widths = [], [], []
    for data in table["image"].to_pylist():
        a = engine_image(data, grid)
        rgb.append(a.tobytes())
        heights.append(a.shape[0])
        widths.append(a.shape[1])
    return pa.table(
        [table["image_id"], pa.array(rgb, pa.binary()), pa.array(heights, pa.int32()), pa.array(widths, pa.int32())],
        schema=SCHEMA,
    )


def _parquet(fs, path: str, columns: list[str]) -> pa.Table:
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as fh:
        return pq.read_table(fh, columns=columns)


def _fitted(fs, path: str, ids: pa.ChunkedArray, shard_bytes: int) -> Optional[pa.Table]:
    """The fitted images at ``path`` when they are those of a shard of ``shard_bytes`` bytes with the images
    ``ids``, row for row; else None (absent, cut short, not Parquet, another shard's)."""
    try:
        images = _parquet(fs, path, SCHEMA.names)
    except (OSError, pa.ArrowException):
        return None
    meta = images.schema.metadata or {}
    if (
        meta.get(SHARD_BYTES) != str(shard_bytes).encode()
        or not images.schema.remove_metadata().equals(SCHEMA)
        or not images["image_id"].equals(ids)
    ):
        return None
    return images


def read_fitted_shard(
    fs, shard: str, fitted: str, columns: list[str], pending: pa.Array, grid: tuple[int, int, int]
) -> pa.Table:
    """The ``pending`` rows of ``shard`` with ``columns``, its ``image`` replaced by ``RGB``/``HEIGHT``/``WIDTH``:
    read from ``fitted`` when that file matches the shard, else fitted here (the whole shard, when it has a
    pending row) and written there."""
    from captionflow.data.storage import write_parquet

    table = _parquet(fs, shard, ["image_id", *(c for c in columns if c not in ("image_id", "image"))])
    keep = pc.is_in(table["image_id"], value_set=pending)
    if not pc.any(keep).as_py():
        return _joined(table.slice(0, 0), SCHEMA.empty_table())
    shard_bytes = fs.size(shard)
    images = _fitted(fs, fitted, table["image_id"], shard_bytes)
    if images is None:
        images = fit_table(_parquet(fs, shard, ["image_id", "image"]), grid)
        write_parquet(fs, fitted, images.replace_schema_metadata({SHARD_BYTES: str(shard_bytes)}))
    return _joined(table, images).filter(keep)


def _joined(table: pa.Table, images: pa.Table) -> pa.Table:
    """``table``'s columns, then ``images``' fitted image columns (row for row)."""
    for name in (RGB, HEIGHT, WIDTH):
        table = table.append_column(SCHEMA.field(name), images[name])
    return table


def fitted_array(row: dict):
    """Pops a row's fitted image (``RGB``, ``HEIGHT``, ``WIDTH``): the array, or None when the row has none."""
    import numpy as np

    data = row.pop(RGB, None)
    if data is None:
        return None
    return np.frombuffer(data, np.uint8).reshape(row.pop(HEIGHT), row.pop(WIDTH), 3).copy()
