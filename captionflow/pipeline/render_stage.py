"""The Ray Data LLM stage that renders requests for the engines on CPU actors (``render_actors``).

Inserted before the engine stage of a run's processor: each of ``render_actors`` actors builds vLLM's renderer
from the engine's own arguments once, then turns each request row (the rendered prompt, the image array) into
what the engine's front end would have made of it (``workers/rendered_requests.py``). The front ends then only
forward requests, so one engine's front end is no longer the limit of what the engine is fed; the rendering is
spread over the host's cores, one process per actor (docs/sizing.md). A row that cannot be rendered becomes an
error row with the reason; the engine stage passes error rows on untouched.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from ray.llm._internal.batch.stages.base import StatefulStage, StatefulStageUDF

from captionflow.compat.vllm_warmup import processor_ready
from captionflow.pipeline.engine import EngineSettings
from captionflow.workers.rendered_requests import RENDERED, build_renderer, render_row
from captionflow.workers.worker_log import say

READY = "render stage: renderer ready"


class RenderStageUDF(StatefulStageUDF):
    def __init__(self, data_column: str, expected_input_keys: list[str], model: str, engine_kwargs: dict[str, Any]):
        t0 = time.perf_counter()
        super().__init__(data_column, expected_input_keys)
        self.renderer = build_renderer(model, engine_kwargs)
        processor_ready(self.renderer)
        say(f"{READY} in {time.perf_counter() - t0:.1f} s")

    async def udf(self, batch: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        for row in batch:
            out: dict[str, Any] = {self.IDX_IN_BATCH_COLUMN: row[self.IDX_IN_BATCH_COLUMN]}
            try:
                out["multimodal_data"] = render_row(self.renderer, row)
            except Exception as e:  # this row only: the rest of the batch goes on
                out["multimodal_data"] = {RENDERED: b""}  # one type for the column
                out["__inference_error__"] = f"rendering the request for the engine failed: {e!r}"[:2000]
            yield out


class RenderStage(StatefulStage):
    """Takes the request rows a run's preprocess makes; gives them with ``multimodal_data`` rendered."""

    fn: type[StatefulStageUDF] = RenderStageUDF

    def get_required_input_keys(self) -> dict[str, str]:
        return {"prompt": "The rendered prompt.", "multimodal_data": "The image, as an array."}


def render_before_engines(processor, engine: EngineSettings, model_path: str, env_vars: dict[str, str]) -> None:
    """Put a ``RenderStage`` of ``engine.render_actors`` actors (environment ``env_vars``) right before
    ``processor``'s engine stage."""
    import ray.data

    stage = RenderStage(
        fn_constructor_kwargs={"model": model_path, "engine_kwargs": dict(engine.engine_kwargs)},
        map_batches_kwargs={
            "zero_copy_batch": True,
            "num_cpus": engine.preset.cpu_stage_cpus,
            "compute": ray.data.ActorPoolStrategy(size=engine.render_actors),
            # one image-processing thread per actor: the actors are the parallelism
            "runtime_env": {"env_vars": {**env_vars, "OMP_NUM_THREADS": "1"}},
        },
    )
    stages: OrderedDict = OrderedDict()
    for name, existing in processor.stages.items():
        if name.startswith("vLLMEngineStage"):
            stages["RenderStage"] = stage
        stages[name] = existing
    if "RenderStage" not in stages:
        raise ValueError(f"no engine stage to render for among {list(processor.stages)}")
    processor.stages = stages
