"""Stage 1, ingest: list the inputs, read reference captions, fingerprint the dataset.

Every listed input is accounted for downstream: it ends as exactly one accepted row or one
quarantine row (checked by preprocess). When the dataset folder for this fingerprint already
holds a finished manifest, the expensive decode pass is skipped (golden sets).
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict, dataclass, field

from prefect import task

from captionflow.retry import retry_transient

from captionflow.config import RunConfig
from captionflow.demo_data import ensure_demo_dataset
from captionflow.fingerprint import digest
from captionflow.storage import Store, open_fs

SCHEMA_VERSION = 1
SIDECAR_NAMES = ("captions.jsonl", "captions.csv")


class DatasetError(ValueError):
    """The dataset parameter names nothing usable."""


@dataclass
class Listing:
    source: str  # resolved URI of the folder
    files: list[dict]  # {"path", "name", "size", "mtime"} sorted by name
    references: dict[str, list[str]] = field(default_factory=dict)  # relative name -> captions


@dataclass
class IngestResult:
    dataset_fingerprint: str
    dataset_dir: str  # URI under the output root
    source: str
    files: list[dict]
    references: dict[str, list[str]]
    preprocess_params: dict
    already_preprocessed: bool

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_dataset(dataset: str) -> str:
    return str(ensure_demo_dataset()) if dataset == "demo" else dataset


def _read_sidecar(fs, path: str) -> dict[str, list[str]]:
    raw = fs.cat_file(path).decode("utf-8")
    refs: dict[str, list[str]] = {}
    if path.endswith(".jsonl"):
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                caps = rec["captions"]
                refs[rec["file_name"]] = [caps] if isinstance(caps, str) else [str(c) for c in caps]
            except (ValueError, KeyError, TypeError) as e:
                raise DatasetError(f"{path}:{n}: expected {{'file_name', 'captions'}}: {e}") from None
    else:
        for row in csv.DictReader(io.StringIO(raw)):
            if "file_name" not in row or "caption" not in row:
                raise DatasetError(f"{path}: CSV needs the columns file_name, caption")
            refs.setdefault(row["file_name"], []).append(row["caption"])
    return refs


def list_folder(uri: str) -> Listing:
    """Recursive listing of a folder (local or fsspec URI); hidden files and sidecars excluded."""
    fs, root = open_fs(uri)
    if not fs.exists(root):
        raise DatasetError(f"dataset {uri!r} does not exist")
    if not fs.isdir(root):
        raise DatasetError(f"dataset {uri!r} is not a folder")
    files, refs = [], {}
    for path, info in sorted(fs.find(root, detail=True).items()):
        rel = path[len(root):].lstrip("/")
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        if rel in SIDECAR_NAMES:
            refs.update(_read_sidecar(fs, path))
            continue
        mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or ""
        files.append({"path": path, "name": rel, "size": int(info.get("size") or 0),
                      "mtime": str(mtime), "etag": str(info.get("ETag") or "")})
    if not files:
        raise DatasetError(f"dataset {uri!r} contains no files")
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    source = root if protocol in ("file", "local") else f"{protocol}://{root}"
    return Listing(source=source, files=files, references=refs)


def ingest(cfg: RunConfig) -> IngestResult:
    """List the dataset and decide whether its preprocessed form already exists."""
    listing = list_folder(resolve_dataset(cfg.dataset))
    params = {"max_image_side": cfg.max_image_side, "shard_rows": cfg.shard_rows, "schema_version": SCHEMA_VERSION}
    fp = digest({
        "files": [(f["name"], f["size"], f["mtime"], f["etag"]) for f in listing.files],
        "references": listing.references,
        "params": params,
    })
    store = Store(cfg.output)
    manifest_ok = False
    if store.exists("datasets", fp, "manifest.json") and not cfg.force_preprocess:
        manifest = store.read_json("datasets", fp, "manifest.json")
        manifest_ok = manifest.get("dataset_fingerprint") == fp and manifest.get("schema_version") == SCHEMA_VERSION
    return IngestResult(
        dataset_fingerprint=fp, dataset_dir=store.url("datasets", fp), source=listing.source,
        files=listing.files, references=listing.references, preprocess_params=params,
        already_preprocessed=manifest_ok,
    )


ingest_task = task(name="ingest", retries=2, retry_delay_seconds=[2, 10],
                   retry_condition_fn=retry_transient)(ingest)
