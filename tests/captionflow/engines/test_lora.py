"""LoRA adapters on real vLLM engines (CPU): one engine serves the base and several adapters of it in the same
batches, each request getting what an engine of its own gives it."""

from __future__ import annotations

import numpy as np
import pytest

from captionflow.config import RunConfig
from captionflow.engines.engine import lora_kwargs, resolve_engine
from captionflow.engines.presets import CPU
from captionflow.engines.processor import build_vlm_processor
from captionflow.engines.session import ray_session
from captionflow.model_source import resolve_model
from captionflow.workers.llm_rows import to_caption

pytestmark = pytest.mark.slow

IMAGES = 8


def _request(row: dict) -> dict:
    pixels = np.random.default_rng(int(row["image_id"][3:])).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    request = {
        "image_id": row["image_id"],
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>describe",
        "multimodal_data": {"image": pixels},
        "sampling_params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
    }
    return {**request, "model": row["adapter"]} if row["adapter"] else request


def _captions(engine, model_path: str, rows: list[dict]) -> dict[tuple[str, str], str]:
    import ray

    processor = build_vlm_processor(
        engine,
        model_path,
        preprocess=_request,
        postprocess=lambda r: {
            **to_caption(r, max_tokens=8, model_fp="", attempt=0),
            "adapter": r.get("model") if r.get("model") != model_path else "",
        },
    )
    ds = ray.data.from_items(rows).repartition(target_num_rows_per_block=len(rows))  # one batch: all mixed
    return {(r["image_id"], r["adapter"] or ""): r["caption"] for r in processor(ds).take_all()}


def test_one_engine_serves_the_base_and_two_adapters_in_one_batch_as_engines_of_their_own(tmp_path):
    from captionflow.builtin.adapter import build_adapter

    cfg = RunConfig(device="cpu", batch_size=3 * IMAGES, concurrency=1)
    ray_session(cfg)
    base = resolve_model("builtin")
    a1, a2 = (resolve_model(str(build_adapter(tmp_path / f"a{s}", seed=s))) for s in (1, 2))
    images = [f"img{i:02d}" for i in range(IMAGES)]

    # the engine a run of one adapter gets, and the same with a slot for each of two adapters (and the spare)
    one = resolve_engine(cfg, a1, CPU)
    assert lora_kwargs([a1], CPU) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
    assert {k: one.engine_kwargs[k] for k in ("enable_lora", "max_lora_rank", "max_loras")} == lora_kwargs([a1], CPU)
    both = resolve_engine(cfg, base, CPU, together=[base, a1, a2])
    assert both.engine_kwargs["max_loras"] == 3 and both.output_params() == one.output_params()
    mixed = _captions(
        both, base.path, [{"image_id": i, "adapter": a} for i in images for a in ("", a1.adapter.path, a2.adapter.path)]
    )
    plain = _captions(resolve_engine(cfg, base, CPU), base.path, [{"image_id": i, "adapter": ""} for i in images])
    only_a1 = _captions(one, base.path, [{"image_id": i, "adapter": a1.adapter.path} for i in images])

    assert len(mixed) == 3 * IMAGES
    for i in images:
        base_caption, c1, c2 = (mixed[(i, a)] for a in ("", a1.adapter.path, a2.adapter.path))
        assert len({base_caption, c1, c2}) == 3, i  # each adapter changes the captions, differently
        assert base_caption == plain[(i, "")], i  # the base beside two adapters: the base's own (the spare slot)
        assert c1 == only_a1[(i, a1.adapter.path)], i  # an adapter beside others: its own
