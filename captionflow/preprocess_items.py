"""The per-item work of the preprocess stage, run in Ray workers.

Kept apart from ``tasks/preprocess.py`` on purpose: a Ray worker imports the module of the
function it runs, and this one needs only Pillow, pyarrow and fsspec, not Prefect (importing
Prefect costs each worker over a second of CPU, a large share of a small job on few cores).
"""

from __future__ import annotations

import pyarrow as pa

from captionflow.images import Rejected, normalise_image

RESULT_SCHEMA = pa.schema([  # one row per image: accepted (image_id set) or rejected (reason set)
    ("source", pa.string()), ("image_id", pa.string()), ("image", pa.binary()), ("width", pa.int32()),
    ("height", pa.int32()), ("orig_format", pa.string()), ("orig_width", pa.int32()), ("orig_height", pa.int32()),
    ("references", pa.list_(pa.string())), ("reason", pa.string()), ("detail", pa.string()), ("size_bytes", pa.int64()),
])


def _result(source: str, data: bytes, refs: list[str], max_side: int, max_pixels: int) -> dict:
    row = {"source": source, "image_id": "", "image": b"", "width": 0, "height": 0, "orig_format": "",
           "orig_width": 0, "orig_height": 0, "references": refs, "reason": "", "detail": "",
           "size_bytes": len(data)}
    try:
        n = normalise_image(data, max_side, max_pixels)
    except Rejected as r:
        row.update(reason=r.reason, detail=r.detail)
        return row
    row.update(image_id=n.image_id, image=n.data, width=n.width, height=n.height, orig_format=n.orig_format,
               orig_width=n.orig_width, orig_height=n.orig_height)
    return row


def process_item(item: dict, *, fs, kind: str, image_column: str | None, caption_column: str | None,
                  references: dict, max_side: int, max_pixels: int) -> list[dict]:
    """One work item -> result rows (accepted: image_id set; rejected: reason set)."""
    if kind == "images":
        try:
            data = fs.cat_file(item["path"])
        except OSError as e:
            return [{**_result(item["name"], b"", [], max_side, max_pixels), "reason": "unreadable",
                     "detail": f"{type(e).__name__}: {e}"[:300], "size_bytes": item["size"]}]
        return [_result(item["name"], data, references.get(item["name"], []), max_side, max_pixels)]
    import pyarrow.parquet as pq

    with fs.open(item["path"], "rb") as fh:
        cols = [image_column] + ([caption_column] if caption_column else [])
        t = pq.ParquetFile(fh).read_row_group(item["row_group"], columns=cols)
    out = []
    images = t.column(image_column).to_pylist()
    caps = t.column(caption_column).to_pylist() if caption_column else [None] * len(images)
    for i, (img, cap) in enumerate(zip(images, caps)):
        source = f"{item['name']}#{item['first_row'] + i}"
        if isinstance(img, dict):
            source = f"{source}:{img.get('path')}" if img.get("path") else source
            img = img.get("bytes")
        refs = [cap] if isinstance(cap, str) else [str(c) for c in cap] if cap else []
        out.append(_result(source, img or b"", refs, max_side, max_pixels))
    return out


class ItemProcessor:
    """``process_item`` over a block of work items, with the stage's parameters bound: the callable
    class that the preprocess stage's Ray Data actor pool runs (see ``tasks/preprocess.py`` for why
    actors, not tasks). A block in, one Arrow table of results out, built here with its schema
    (a per-row ``flat_map`` had Ray Data hand each row over and infer the column types)."""

    def __init__(self, **params):
        self.params = params

    def __call__(self, items: pa.Table) -> pa.Table:
        rows = [row for item in items.to_pylist() for row in process_item(item, **self.params)]
        return pa.Table.from_pylist(rows, schema=RESULT_SCHEMA)
