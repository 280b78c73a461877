"""The reference-free score: CLIPScore of every caption against its image, computed locally through Ray Data.

``clip_model`` is ``builtin`` (a tiny random CLIP built locally: meaningless scores, real machinery) or a
local CLIP-family checkpoint folder (``CLIPModel``: e.g. a copy of openai/clip-vit-large-patch14). The
preprocessed shards are read with Ray Data and scored by an actor that loads the checkpoint once
(``captionflow/workers/clip_rows.py``); scores are committed like captions, under
``runs/.../clip/<clip-fp>/scores``, so a rerun or a resumed run scores only what is missing.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from typing import Optional

import pyarrow as pa
import pyarrow.compute as pc

from captionflow.config import RunConfig
from captionflow.data.layout import SCORES, read_captions, shard_paths
from captionflow.data.lease import Lease
from captionflow.data.storage import Store
from captionflow.engines.engine import EngineSettings
from captionflow.engines.processor import read_pending
from captionflow.engines.session import ray_session
from captionflow.errors import DatasetError
from captionflow.model_source import ClipModel
from captionflow.results import ClipResult, InferenceResult, Manifest
from captionflow.runs.ledger import Ledger, run_passes
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

            resources, where = scorer_placement(engine, warm=inference.engines.startswith("warm"))

            def rows_for(attempt: int, pending: list[str]):
                ds = read_pending(store.fs, shards, ["image_id", "image"], pending, engine)
                import ray

                return ds.map_batches(
                    ClipScorer,
                    fn_constructor_kwargs={
                        "model_path": clip.path,
                        "captions": captions,
                        "attempt": attempt,
                        **where,
                    },
                    batch_size=CLIP_BATCH,
                    batch_format="pyarrow",
                    compute=ray.data.ActorPoolStrategy(size=1),
                    **resources,
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


def scorer_placement(engine: EngineSettings, warm: bool) -> tuple[dict, dict]:
    """Where the clip-score stage's CLIP runs: its Ray actor's resources, and the scorer's device and threads. The
    captioning is over by then. With engines started for the run on GPUs: on one of their GPUs (a CLIP-L scores
    ~148 images a second on an H200, 4.6 on the 16 cores of its host: bench/clip_prefix.py). Else (on CPU, or with
    warm engines, which keep their GPUs and their Ray resources): on the CPU, with the threads the captioning's
    engines had (``concurrency`` x ``actor_cpus``), its Ray share a map task's, which is free beside a warm
    service's engines too."""
    if engine.preset.engine_gpus and not warm:
        return {"num_cpus": engine.preset.map_cpus, "num_gpus": 1}, {"device": "cuda", "threads": None}
    threads = max(1, int(engine.concurrency * engine.actor_cpus))
    return {"num_cpus": engine.preset.map_cpus}, {"device": "cpu", "threads": threads}


class OrderedImages:
    """The image bytes of an order's images, read from the shards a window of the order at a time, in a thread: the
    first ``window`` images, then windows twice as large (at most ``MAX_WINDOW``), each one pass over the shards'
    image column, one shard at a time, keeping that window's images only. It reads at most one window beyond the one
    being taken from, so the driver holds about two windows' bytes, not the whole set's (a golden set's images can
    be most of a dataset). ``take`` waits for the images it asks for and hands each one out once."""

    MAX_WINDOW = 8192

    def __init__(self, store: Store, shards: list[str], order: list[str], window: int = 256):
        self._order, self._rank = order, {i: k for k, i in enumerate(order)}
        self._bytes: dict[str, bytes] = {}
        self._asked = 0  # the highest rank asked for, plus one
        self._loaded = 0  # the ranks below it are read (or absent from the shards)
        self._error: Optional[BaseException] = None
        self._closed = False
        self._cv = threading.Condition()
        args = (store, shards, window)
        self.thread = threading.Thread(target=self._read, args=args, name="captionflow-clip-images", daemon=True)
        self.thread.start()

    def _read(self, store: Store, shards: list[str], window: int) -> None:
        try:
            start, previous = 0, 0
            while start < len(self._order):
                with self._cv:  # no further than one window beyond the one being taken from
                    self._cv.wait_for(lambda p=previous: self._asked > p or p == 0 or self._closed)
                    if self._closed:
                        return
                end = min(len(self._order), start + window)
                wanted = pa.array(self._order[start:end], pa.string())
                found: dict[str, bytes] = {}
                for shard in shards:
                    t = store.read_table(shard, columns=["image_id", "image"])
                    t = t.filter(pc.is_in(t["image_id"], value_set=wanted))
                    found.update(zip(t["image_id"].to_pylist(), t["image"].to_pylist()))
                with self._cv:
                    self._bytes.update(found)
                    self._loaded = end
                    self._cv.notify_all()
                previous, start, window = start, end, min(self.MAX_WINDOW, 2 * window)
        except BaseException as e:  # said where the images are taken
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def close(self) -> None:
        """No more windows: the reading thread ends (a verdict in needs no more images)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def take(self, ids: list[str]) -> dict[str, bytes]:
        need = max(self._rank[i] for i in ids) + 1
        with self._cv:
            self._asked = max(self._asked, need)
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._loaded >= need or self._error is not None)
            if self._error is not None and self._loaded < need:
                raise DatasetError(f"verdict CLIPScore: cannot read the images: {self._error}") from self._error
            missing = [i for i in ids if i not in self._bytes]
            if missing:
                raise DatasetError(f"verdict CLIPScore: image {missing[0]} is not in the dataset's shards")
            return {i: self._bytes.pop(i) for i in ids}


class PrefixClipScore:
    """CLIPScore in the driver, for a sequential verdict (``evaluation/sequential.PrefixVerdict``'s ``score``):
    captions -> each one's CLIPScore against its image, by the ClipScorer the clip-score stage runs in Ray workers
    (the same checkpoint, the same shard images: the verdict's scores are the stage's). The checkpoint loads in a
    background thread while the run's requests start, and the images of the verdict's ``order`` are read window by
    window (``OrderedImages``); each image's embedding is computed once, the first time either side's caption of it
    is scored, and serves the other side too. ``gpu``: on the driver's GPU where it sees one (a CLIP-L on the CPU of
    a 16-core GPU host scores 4.6 images a second, on its H200 148: bench/clip_prefix.py), else on the driver's CPU
    with torch's own threads."""

    def __init__(
        self, clip: ClipModel, store: Store, shards: list[str], order: list[str], gpu: bool = False, window: int = 256
    ):
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="captionflow-clip")
        self._ready = pool.submit(self._load, clip.path, gpu)
        pool.shutdown(wait=False)
        self.images = OrderedImages(store, shards, order, window)
        weakref.finalize(self, self.images.close)  # the verdict dropped: its reading thread ends
        self._embedded: dict = {}

    @staticmethod
    def _load(path: str, gpu: bool) -> ClipScorer:
        import torch

        return ClipScorer(path, {}, threads=None, device="cuda" if gpu and torch.cuda.is_available() else "cpu")

    def __call__(self, captions: dict[str, str]) -> dict[str, float]:
        import torch

        scorer = self._ready.result()
        new = [i for i in captions if i not in self._embedded]
        if new:
            raw = self.images.take(new)
            images, errors = scorer.decode(new, [raw[i] for i in new])
            if errors:
                image_id, error = next(iter(errors.items()))
                raise DatasetError(f"verdict CLIPScore: image {image_id}: {error}")
            self._embedded.update(zip(new, scorer.embed_images([images[i] for i in new])))
        ids = list(captions)
        text = scorer.embed_texts([captions[i] for i in ids])
        return dict(zip(ids, clip_scores(torch.stack([self._embedded[i] for i in ids]), text)))
