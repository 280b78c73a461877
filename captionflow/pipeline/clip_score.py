"""The reference-free score: CLIPScore of every caption against its image, computed locally through Ray Data.

``clip_model`` is ``builtin`` (a tiny random CLIP built locally: meaningless scores, real machinery) or a
local CLIP-family checkpoint folder (``CLIPModel``: e.g. a copy of openai/clip-vit-large-patch14). The
preprocessed shards are read with Ray Data and scored by an actor that loads the checkpoint once
(``captionflow/workers/clip_rows.py``); scores are committed like captions, under
``runs/.../clip/<clip-fp>/scores``, so a rerun or a resumed run scores only what is missing.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from captionflow.config import RunConfig
from captionflow.data.layout import SCORES, read_captions, shard_paths
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.errors import DatasetError
from captionflow.model_source import ClipModel
from captionflow.pipeline.engine import EngineSettings
from captionflow.pipeline.ledger import Ledger, run_passes
from captionflow.pipeline.processor import read_pending
from captionflow.pipeline.session import ray_session
from captionflow.results import ClipResult, InferenceResult, Manifest
from captionflow.workers.clip_rows import CLIP_SCHEMA, ClipScorer, clip_scores

CLIP_BATCH = 32


def clip_parts(run: tuple[str, ...], clip: ClipModel) -> tuple[str, ...]:
    return (*run, "clip", clip.fingerprint)


def run_clip(
    cfg: RunConfig, manifest: Manifest, inference: InferenceResult, clip: ClipModel, engine: EngineSettings
) -> ClipResult:
    t0 = time.perf_counter()
    store = Store(cfg.output)
    run = tuple(inference.run_parts)
    base = clip_parts(run, clip)
    captions = read_captions(store, run)
    with Lease(
        store, "/".join(base), what=f"the CLIP score folder {store.url(*base)}", wait_s=cfg.lease_wait_s
    ) as lease:
        ledger = Ledger(
            store, base, SCORES, CLIP_SCHEMA, cfg.commit_rows, lease=lease,
            stall_timeout_s=cfg.stall_timeout_s, what="CLIP score",
        )  # fmt: skip
        done = ledger.committed()
        if set(captions) - done:
            ray_session(cfg)
            shards = shard_paths(store, manifest)
            preset = engine.preset

            def rows_for(attempt: int, pending: list[str]):
                ds = read_pending(store.fs, shards, ["image_id", "image"], pending, engine)
                import ray

                return ds.map_batches(
                    ClipScorer,
                    fn_constructor_kwargs={"model_path": clip.path, "captions": captions, "attempt": attempt},
                    batch_size=CLIP_BATCH,
                    batch_format="pyarrow",
                    num_cpus=preset.map_cpus,
                    compute=ray.data.ActorPoolStrategy(size=1),
                )

            run_passes(ledger, set(captions), done, cfg.row_retries, rows_for)
    t = store.read_unique(store.ls(*base, SCORES, suffix=".parquet"))
    values = [r["clip_score"] for r in (t.to_pylist() if t is not None else []) if r["image_id"] in captions]
    return ClipResult(
        clip_model=clip.source,
        clip_dir=store.url(*base),
        scored=len(values),
        failed=len(captions) - len(values),
        mean=sum(values) / len(values) if values else None,
        seconds=round(time.perf_counter() - t0, 2),
    )


class PrefixClipScore:
    """CLIPScore in the driver, for a sequential verdict (``evaluation/sequential.PrefixVerdict``'s ``score``):
    captions -> each one's CLIPScore against its image, by the ClipScorer the clip-score stage runs in Ray workers
    (the same checkpoint, the same shard images: the verdict's scores are the stage's). The checkpoint and the
    images of ``ids`` (one read of the shards' image column) load in a background thread while the run's requests
    start; each image's embedding is computed once, the first time either side's caption of it is scored, and
    serves the other side too (its bytes are dropped then). ``gpu``: on the driver's GPU where it sees one (a
    CLIP-L on the CPU of a 16-core GPU host scores 4.6 images a second, on its H200 148: bench/clip_prefix.py),
    else on the driver's CPU with torch's own threads."""

    def __init__(self, clip: ClipModel, store: Store, shards: list[str], ids: Iterable[str], gpu: bool = False):
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="captionflow-clip")
        self._ready = pool.submit(self._load, clip.path, store, shards, sorted(ids), gpu)
        pool.shutdown(wait=False)
        self._embedded: dict = {}

    @staticmethod
    def _load(path: str, store: Store, shards: list[str], ids: list[str], gpu: bool):
        import torch

        device = "cuda" if gpu and torch.cuda.is_available() else "cpu"
        scorer = ClipScorer(path, {}, threads=None, device=device)
        t = store.read_tables(shards, columns=["image_id", "image"])
        t = t.filter(pc.is_in(t["image_id"], value_set=pa.array(ids, pa.string())))
        return scorer, dict(zip(t["image_id"].to_pylist(), t["image"].to_pylist()))

    def __call__(self, captions: dict[str, str]) -> dict[str, float]:
        import torch

        scorer, raw = self._ready.result()
        new = [i for i in captions if i not in self._embedded]
        if new:
            images, errors = scorer.decode(new, [raw.pop(i) for i in new])
            if errors:
                image_id, error = next(iter(errors.items()))
                raise DatasetError(f"verdict CLIPScore: image {image_id}: {error}")
            self._embedded.update(zip(new, scorer.embed_images([images[i] for i in new])))
        ids = list(captions)
        text = scorer.embed_texts([captions[i] for i in ids])
        return dict(zip(ids, clip_scores(torch.stack([self._embedded[i] for i in ids]), text)))
