"""Stage 2, preprocess: decode, check and normalise every listed input; write Parquet shards.

Each input is decoded once here. It ends in exactly one place: an accepted row in a shard
(``shards/part-NNNNN.parquet``) or a row of ``quarantine.parquet`` with a reason from
``captionflow.images.REASONS``. ``manifest.json`` is written last: a dataset folder without it
is unfinished and is rebuilt.
"""

from __future__ import annotations

import time

import pyarrow as pa
from prefect import task

from captionflow.retry import retry_transient

from captionflow.images import normalise_image, Rejected
from captionflow.storage import Store, open_fs
from tasks.ingest import SCHEMA_VERSION, IngestResult

SHARD_SCHEMA = pa.schema([
    ("image_id", pa.string()),
    ("source", pa.string()),
    ("image", pa.binary()),  # RGB JPEG, longest side <= max_image_side
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("orig_format", pa.string()),
    ("orig_width", pa.int32()),
    ("orig_height", pa.int32()),
    ("references", pa.list_(pa.string())),
])
QUARANTINE_SCHEMA = pa.schema([
    ("source", pa.string()), ("reason", pa.string()), ("detail", pa.string()), ("size_bytes", pa.int64()),
])


def preprocess(ing: IngestResult, output: str) -> dict:
    """Build the dataset folder for ``ing`` (or reuse it) and return its manifest."""
    store = Store(output)
    base = ("datasets", ing.dataset_fingerprint)
    if ing.already_preprocessed:
        manifest = store.read_json(*base, "manifest.json")
        manifest["skipped"] = True
        return manifest
    t0 = time.perf_counter()
    store.remove(*base)  # an unfinished or forced rebuild starts clean
    max_side = ing.preprocess_params["max_image_side"]
    shard_rows = ing.preprocess_params["shard_rows"]
    fs, _ = open_fs(ing.source)
    rows: list[dict] = []
    quarantine: list[dict] = []
    seen: dict[str, str] = {}
    shards: list[str] = []

    def flush() -> None:
        if rows:
            name = f"part-{len(shards):05d}.parquet"
            store.write_table(pa.Table.from_pylist(rows, schema=SHARD_SCHEMA), *base, "shards", name)
            shards.append(name)
            rows.clear()

    for f in ing.files:
        try:
            data = fs.cat_file(f["path"])
        except OSError as e:
            quarantine.append({"source": f["name"], "reason": "unreadable", "detail": str(e)[:300], "size_bytes": f["size"]})
            continue
        try:
            norm = normalise_image(data, max_side)
        except Rejected as r:
            quarantine.append({"source": f["name"], "reason": r.reason, "detail": r.detail, "size_bytes": len(data)})
            continue
        if norm.image_id in seen:
            quarantine.append({"source": f["name"], "reason": "duplicate",
                               "detail": f"same content as {seen[norm.image_id]}", "size_bytes": len(data)})
            continue
        seen[norm.image_id] = f["name"]
        rows.append({
            "image_id": norm.image_id, "source": f["name"], "image": norm.data, "width": norm.width,
            "height": norm.height, "orig_format": norm.orig_format, "orig_width": norm.orig_width,
            "orig_height": norm.orig_height, "references": ing.references.get(f["name"], []),
        })
        if len(rows) >= shard_rows:
            flush()
    flush()
    store.write_table(pa.Table.from_pylist(quarantine, schema=QUARANTINE_SCHEMA), *base, "quarantine.parquet")
    accepted = len(seen)
    counts = {
        "listed": len(ing.files), "accepted": accepted,
        "quarantined": sum(1 for q in quarantine if q["reason"] != "duplicate"),
        "duplicates": sum(1 for q in quarantine if q["reason"] == "duplicate"),
        "with_references": sum(1 for name in seen.values() if ing.references.get(name)),
    }
    if counts["accepted"] + counts["quarantined"] + counts["duplicates"] != counts["listed"]:
        raise AssertionError(f"accounting broken: {counts}")  # every input ends in exactly one place
    manifest = {
        "dataset_fingerprint": ing.dataset_fingerprint, "schema_version": SCHEMA_VERSION,
        "source": ing.source, "counts": counts, "shards": shards, "params": ing.preprocess_params,
        "quarantine_reasons": sorted({q["reason"] for q in quarantine}),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    store.write_json(manifest, *base, "manifest.json")
    manifest["skipped"] = False
    return manifest


preprocess_task = task(name="preprocess", retries=2, retry_delay_seconds=[2, 10],
                   retry_condition_fn=retry_transient)(preprocess)
