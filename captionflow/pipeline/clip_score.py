"""The reference-free score: CLIPScore of every caption against its image, computed locally through Ray Data.

``clip_model`` is ``builtin`` (a tiny random CLIP built locally: meaningless scores, real machinery) or a
local CLIP-family checkpoint folder (``CLIPModel``: e.g. a copy of openai/clip-vit-large-patch14). The
preprocessed shards are read with Ray Data and scored by an actor that loads the checkpoint once
(``captionflow/workers/clip_rows.py``); scores are committed like captions, under
``runs/.../clip/<clip-fp>/scores``, so a rerun or a resumed run scores only what is missing.
"""

from __future__ import annotations

import time

from captionflow.config import RunConfig
from captionflow.data.layout import SCORES, read_captions, shard_paths
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.model_source import ClipModel
from captionflow.pipeline.engine import EngineSettings
from captionflow.pipeline.ledger import Ledger, run_passes
from captionflow.pipeline.processor import read_pending
from captionflow.pipeline.session import ray_session
from captionflow.results import ClipResult, InferenceResult, Manifest
from captionflow.workers.clip_rows import CLIP_SCHEMA, ClipScorer

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
