"""The output root's layout: where every stage reads and writes, under any fsspec URI.

    datasets/<dataset-fp>/                  manifest.json (written last), shards/part-NNNNN.parquet, quarantine.parquet
                                            fitted/<grid-key>/part-NNNNN.parquet (images fitted to an engine's grid)
    runs/<dataset-fp>/<model-fp>/<generation-fp>/
                                            run.json, captions/, failures/, scores.parquet, metrics.json, report.md,
                                            report.html, chart.png
                                            judge/<judge-fp>/scores/, judge/<judge-fp>/failures/
    leaderboard.parquet                     one row per (dataset, model, generation)
    .prefect-cache/                         Prefect's persisted stage results (keyed on the fingerprints)

Folders are named by content fingerprints (``captionflow.data.fingerprint``), so a rerun with the same
inputs finds its outputs, and different inputs never share a folder.
"""

from __future__ import annotations

from typing import Optional

SCHEMA_VERSION = 1  # of a preprocessed dataset folder; part of the dataset fingerprint
MANIFEST = "manifest.json"
QUARANTINE = "quarantine.parquet"
SHARDS = "shards"
FITTED = "fitted"  # a dataset's images fitted to an engine's patch grid (workers/fitted_images.py)
CAPTIONS, FAILURES, SCORES = "captions", "failures", "scores"
LEADERBOARD = "leaderboard.parquet"
RESULTS_CACHE = ".prefect-cache"
EXTERNAL_GENERATION = "external"  # the generation "fingerprint" of captions produced elsewhere (captionflow evaluate)


def dataset_parts(dataset_fp: str) -> tuple[str, ...]:
    return ("datasets", dataset_fp)


def shard_paths(store, manifest) -> list[str]:
    """Full paths of a dataset's committed shards, in order (``manifest``: a Manifest)."""
    return [store.path(*dataset_parts(manifest.dataset_fingerprint), SHARDS, s) for s in manifest.shards]


def run_parts(dataset_fp: str, model_fp: str, generation_fp: str) -> tuple[str, ...]:
    return ("runs", dataset_fp, model_fp, generation_fp)


def judge_parts(run: tuple[str, ...], judge_fp: str) -> tuple[str, ...]:
    return (*run, "judge", judge_fp)


# ---------------------------------------------------------------- is a stage's output still there?
# Each returns None when storage holds everything a finished stage left, else what is missing: a cached
# stage result is only reused when its outputs are intact (tasks/results.py).
def missing_dataset(store, dataset_fp: str) -> Optional[str]:
    base = dataset_parts(dataset_fp)
    if not store.exists(*base, MANIFEST):
        return f"{store.url(*base, MANIFEST)} does not exist"
    listed = store.read_json(*base, MANIFEST).get("shards", [])
    present = {p.rsplit("/", 1)[-1] for p in store.ls(*base, SHARDS, suffix=".parquet")}
    lost = [s for s in listed if s not in present]
    if lost:
        return f"{len(lost)} of the {len(listed)} shards in {store.url(*base, SHARDS)} are gone (first: {lost[0]})"
    if not store.exists(*base, QUARANTINE):
        return f"{store.url(*base, QUARANTINE)} does not exist"
    return None


def missing_rows(store, base: tuple[str, ...], kind: str, wanted: set[str]) -> Optional[str]:
    """Rows of ``wanted`` without a committed result under ``base/kind``."""
    lack = wanted - store.ids(store.ls(*base, kind, suffix=".parquet"))
    return f"{len(lack)} of {len(wanted)} rows have no committed {kind} in {store.url(*base)}" if lack else None


def missing_files(store, base: tuple[str, ...], names: tuple[str, ...]) -> Optional[str]:
    gone = [n for n in names if not store.exists(*base, n)]
    return f"{', '.join(gone)} missing in {store.url(*base)}" if gone else None


def read_scores(folder: str, column: str) -> dict[str, float]:
    """image id -> its score (``column``), of the scores committed under a score folder (a judge's, a CLIP's)."""
    from captionflow.data.storage import Store

    store = Store(folder)
    t = store.read_unique(store.ls(SCORES, suffix=".parquet"), columns=["image_id", column])
    return dict(zip(t["image_id"].to_pylist(), t[column].to_pylist())) if t is not None else {}


def read_captions(store, run: tuple[str, ...]) -> dict[str, str]:
    """image id -> caption, of the captions committed under a run folder (each image once)."""
    t = store.read_unique(store.ls(*run, CAPTIONS, suffix=".parquet"), columns=["image_id", "caption"])
    return dict(zip(t["image_id"].to_pylist(), t["caption"].to_pylist())) if t is not None else {}


def caption_failures(store, run: tuple[str, ...]) -> set[str]:
    """The images of a run folder whose caption failed (the engine rejected every attempt so far) and that have no
    caption committed."""
    failed = store.ids(store.ls(*run, FAILURES, suffix=".parquet"))
    return failed - store.ids(store.ls(*run, CAPTIONS, suffix=".parquet")) if failed else set()
