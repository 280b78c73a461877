"""Captions produced elsewhere, evaluated like a run's (``captionflow evaluate``).

The file is JSONL or Parquet with a ``caption`` column and, to say which image each caption is of, an
``image_id`` (captionflow's content id) or a ``file_name`` (the image's path in the dataset as captionflow
lists it: relative to a folder, or ``<file>.parquet#<row>`` for a Parquet dataset). The captions are written as
a run of their own - ``runs/<dataset>/ext-<digest of the captions>/external/captions/`` - so that evaluate,
the report and the leaderboard treat them as any checkpoint's; their generation settings are unknown, so they
are compared only with other external captions of the same dataset, and their leaderboard row says
``external``.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from captionflow.data.fingerprint import digest
from captionflow.data.layout import CAPTIONS, EXTERNAL_GENERATION, run_parts, shard_paths
from captionflow.data.sources import jsonl_objects, read_utf8
from captionflow.data.storage import Store, open_fs
from captionflow.errors import DatasetError
from captionflow.results import InferenceResult, Manifest
from captionflow.workers.llm_rows import CAPTION_SCHEMA

KEYS = ("image_id", "file_name")


def read_caption_file(path: str) -> list[dict]:
    """The rows of a JSONL or Parquet caption file; each has ``caption`` and ``image_id`` or ``file_name``."""
    fs, p = open_fs(path)
    if not fs.exists(p):
        raise DatasetError(f"captions file {path!r} does not exist")
    if p.endswith(".parquet"):
        import pyarrow.parquet as pq

        with fs.open(p, "rb") as fh:
            rows = pq.read_table(fh).to_pylist()
    else:
        rows = [obj for _, obj in jsonl_objects(read_utf8(fs, p), path)]
    if not rows:
        raise DatasetError(f"captions file {path!r} has no rows")
    for n, row in enumerate(rows, 1):
        if not isinstance(row.get("caption"), str) or not any(isinstance(row.get(k), str) for k in KEYS):
            raise DatasetError(
                f"{path}: row {n} needs a text 'caption' and an 'image_id' or 'file_name' (has {sorted(row)})"
            )
    return rows


def import_captions(output: str, manifest: Manifest, path: str) -> tuple[InferenceResult, list[str]]:
    """Write the file's captions as a run on ``manifest``'s dataset. Returns the run and the keys of rows that
    match no image of the dataset (an error when none matches). An image captioned twice keeps its first."""
    rows = read_caption_file(path)
    store = Store(output)
    data = store.read_tables(shard_paths(store, manifest), columns=["image_id", "source"])
    ids = set(data["image_id"].to_pylist()) if data else set()
    by_name = dict(zip(data["source"].to_pylist(), data["image_id"].to_pylist())) if data else {}
    captions: dict[str, str] = {}
    unmatched: list[str] = []
    for r in rows:
        image_id = r.get("image_id") if r.get("image_id") in ids else by_name.get(r.get("file_name") or "")
        if image_id is None:
            unmatched.append(str(r.get("image_id") or r.get("file_name")))
        else:
            captions.setdefault(image_id, r["caption"])
    if not captions:
        raise DatasetError(
            f"captions file {path!r}: none of its {len(rows)} rows names an image of dataset {manifest.source!r} "
            f"(first: {unmatched[0]!r}; an image_id, or a file_name as listed, e.g. {next(iter(by_name), '-')!r})"
        )
    fp = "ext-" + digest(sorted(captions.items()))[:16]
    run = run_parts(manifest.dataset_fingerprint, fp, EXTERNAL_GENERATION)
    table = pa.Table.from_pylist(
        [
            {"image_id": i, "caption": c, "finish_reason": "stop", "num_input_tokens": 0, "num_output_tokens": 0,
             "model_fingerprint": fp, "error": "", "attempt": 0}
            for i, c in sorted(captions.items())
        ],
        schema=CAPTION_SCHEMA,
    )  # fmt: skip
    if not store.exists(*run, CAPTIONS, "part-external.parquet"):  # the same captions: the same run, kept
        store.write_table(table, *run, CAPTIONS, "part-external.parquet")
    n = manifest.counts.accepted
    result = InferenceResult(
        run_dir=store.url(*run),
        run_parts=run,
        accepted=n,
        captioned=len(captions),
        failed=n - len(captions),  # images of the dataset the file has no caption for
        resumed_from=0,
        passes=[],
        timings_s={},
        engines="external",
    )
    return result, unmatched


def external_name(path: str, name: str | None) -> str:
    """How the leaderboard names external captions: ``external:<name or the file's name>``."""
    return f"external:{name or Path(path.rstrip('/')).name}"
