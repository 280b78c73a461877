"""Checkpoints of one base captioned in one pass: LoRA adapters over it (and the base itself), each image's
requests for every checkpoint side by side in the engines' batches (vLLM's multi-LoRA batching), each caption
committed to its checkpoint's own run folder.

    SharedPass(cfg, manifest, models, engine, progress).run()
      hold every checkpoint's run folder (``CaptionPass.lease``) -> each one's run.json, ledger, reuse
      (``CaptionPass.open``) -> the keys (checkpoint, image) not committed yet -> the base staged once, engines
      with a LoRA slot for each adapter (``resolve_engine(together=...)``) -> passes: each image read once, fanned
      out to the checkpoints that need it (``for_checkpoints``), the rows routed back by ``model_fingerprint``
      (``runs.ledger.Ledgers``) -> each checkpoint's ``InferenceResult``

The run folders are exactly those each checkpoint's own run uses (a LoRA slot count is not in the generation
fingerprint: ``SPEED_ONLY``), so the caption flow of each checkpoint afterwards finds its captions committed and
goes on to score them (``flows/compare_flow.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from typing import Optional

from captionflow.config import RunConfig
from captionflow.engines.engine import EngineSettings
from captionflow.engines.processor import build_vlm_processor, fitted_folder, map_task_kwargs, read_pending
from captionflow.engines.session import ray_session
from captionflow.engines.staging import staged
from captionflow.model_source import ResolvedModel
from captionflow.results import InferenceResult, Manifest
from captionflow.runs.ledger import Ledgers, Progress, run_passes
from captionflow.stages.caption_pass import CaptionPass
from captionflow.workers.llm_rows import caption_fixed_schema, for_checkpoints, to_caption

log = logging.getLogger("captionflow.inference")


def shareable(models: Sequence[ResolvedModel]) -> Optional[str]:
    """Why ``models`` cannot be captioned in one pass, or None: two or more distinct checkpoints, one base (the
    adapters' and, where it is among them, the base itself), at least one adapter."""
    if len({m.fingerprint for m in models}) < 2:
        return "fewer than two distinct checkpoints"
    if len({m.path for m in models}) > 1:
        return "not all of them are LoRA adapters of one base (or that base)"
    if not any(m.adapter for m in models):
        return "none of them is a LoRA adapter"
    return None


class SharedPass:
    """``models`` (``shareable``) captioned on ``engine``'s engines in one pass over the dataset."""

    def __init__(
        self,
        cfg: RunConfig,
        manifest: Manifest,
        models: Sequence[ResolvedModel],
        engine: EngineSettings,
        progress: Optional[Progress] = None,
    ):
        if why := shareable(models):
            raise ValueError(f"a shared pass: {why}")
        unique = {m.fingerprint: m for m in models}
        self.cfg, self.models, self.engine, self.progress = cfg, list(models), engine, progress
        self.passes = [CaptionPass(cfg, manifest, m, engine) for m in unique.values()]

    def run(self) -> list[InferenceResult]:
        """Caption what each checkpoint lacks; each of ``models``' result, in their order (a checkpoint named twice:
        its result twice)."""
        t_start = time.perf_counter()
        passes = []
        with contextlib.ExitStack() as held:
            opened = [p.open(held.enter_context(p.lease())) for p in self.passes]
            ledgers = Ledgers({p.model.fingerprint: o[0] for p, o in zip(self.passes, opened)})
            done = {(p.model.fingerprint, i) for p, o in zip(self.passes, opened) for i in o[1]}
            todo = {(p.model.fingerprint, i) for p in self.passes for i in p.ids}
            if self.progress:
                self.progress(len(done & todo), len(done & todo), len(todo), 0.0)
            if todo - done:
                passes = self._passes(ledgers, todo, done)
        seconds = round(time.perf_counter() - t_start, 2)
        results = {}
        for p, (_, _, resumed_from, reused) in zip(self.passes, opened):
            p.timings["inference_s"] = seconds
            p.engines = f"shared pass ({len(self.passes)} checkpoints of one base)"
            mine = {i for fp, i in done if fp == p.model.fingerprint}
            results[p.model.fingerprint] = p._result(passes, mine, resumed_from, reused, None)
        return [results[m.fingerprint] for m in self.models]

    def _passes(self, ledgers: Ledgers, todo: set, done: set):
        cfg, first = self.cfg, self.passes[0]
        t0 = time.perf_counter()
        local = ray_session(cfg).started_here
        first.timings["ray_init_s"] = round(time.perf_counter() - t0, 2)
        log.info("captioning %d checkpoints of %s in one pass (LoRA slots: %s)", len(self.passes),
                 first.model.path, self.engine.engine_kwargs.get("max_loras"))  # fmt: skip
        with staged(first.model.path, self.engine.compile_dir, local=local) as path:
            return run_passes(ledgers, todo, done, cfg.row_retries, self._rows(path), self.progress)

    def _rows(self, model_path: str):
        """``rows_for(attempt, pending)`` over (fingerprint, image id) keys: each pending image read once and sent
        for each checkpoint that lacks it, under Ray Data LLM's ``model`` column: the adapter's folder, or the
        engines' own checkpoint (``model_path``) for the base."""
        cfg, engine, first = self.cfg, self.engine, self.passes[0]
        store, shards = first.store, first.shards
        fitted = fitted_folder(cfg, store, first.manifest, engine)
        models = {p.model.fingerprint: p.model.adapter.path if p.model.adapter else model_path for p in self.passes}

        def rows_for(attempt: int, pending: list[tuple[str, str]]):
            wanted: dict[str, list[str]] = {}
            for fp, image_id in pending:
                wanted.setdefault(image_id, []).append(fp)
            some = {i: fps for i, fps in wanted.items() if len(fps) < len(models)}  # the others: every checkpoint
            processor = build_vlm_processor(
                engine,
                model_path,
                preprocess=first.request(attempt, engine),
                postprocess=functools.partial(to_caption, max_tokens=cfg.max_tokens, model_fp="", attempt=attempt),
                rows=len(pending),
            )
            ds = read_pending(store.fs, shards, ["image_id", "image"], sorted(wanted), engine, fitted)
            ds = ds.flat_map(functools.partial(for_checkpoints, models=models, some=some), **map_task_kwargs(engine))
            ds = ds.repartition(target_num_rows_per_block=engine.batch_size)
            return processor(ds).map(
                functools.partial(caption_fixed_schema, model_fp="", attempt=attempt), **map_task_kwargs(engine)
            )

        return rows_for
