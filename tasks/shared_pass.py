"""Stage 3 for checkpoints of one base, before their runs: their captions in one shared pass (``compare``)."""

from __future__ import annotations

from typing import Optional

from prefect import get_run_logger, task

from captionflow.config import RunConfig
from captionflow.data.storage import Store
from captionflow.model_source import ResolvedModel
from captionflow.results import InferenceResult, Manifest
from captionflow.stages.inference import caption_run_parts
from captionflow.stages.shared_pass import SharedPass
from tasks.inference import ProgressArtifact
from tasks.policy import TIMEOUT_S, retry_transient


@task(
    name="shared-pass",
    timeout_seconds=TIMEOUT_S["shared-pass"],
    retries=1,
    retry_delay_seconds=[10],
    retry_condition_fn=retry_transient,
)
def shared_pass_task(
    cfg: RunConfig, manifest: Manifest, models: list[ResolvedModel]
) -> Optional[list[InferenceResult]]:
    """LoRA adapters of one base (and the base) captioned in one pass, each into its own run folder
    (``stages/shared_pass.py``): the runs of each afterwards find their captions committed. A rerun after a
    failure captions only what each checkpoint lacks. None where a warm engine service runs (and ``warm_engines``
    is not off): its engines hold the GPUs, and each checkpoint's run uses them in turn."""
    from captionflow.engines.engine import resolve_engine
    from captionflow.engines.presets import PRESETS
    from captionflow.engines.session import ray_session
    from captionflow.preflight import resolve_device
    from captionflow.service.controller import describe

    if cfg.warm_engines != "off":
        ray_session(cfg)
        if describe() is not None:
            get_run_logger().info("a warm engine service runs: each checkpoint's run uses it in turn, no shared pass")
            return None

    device, gpus, local = resolve_device(cfg)
    engine = resolve_engine(cfg, models[0], PRESETS[device], gpus, local, together=models)
    store = Store(cfg.output)
    folders = "+".join(store.path(*caption_run_parts(cfg, manifest, m, engine)) for m in models)
    with ProgressArtifact(folders) as progress:
        return SharedPass(cfg, manifest, models, engine, progress).run()
