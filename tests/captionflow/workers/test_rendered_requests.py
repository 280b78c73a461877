"""Requests rendered before the engine stage: vLLM's own renderer (the CPU build), what the engine then gets."""

from __future__ import annotations

import numpy as np

from captionflow.builtin.demo_data import DEMO_CAPTIONS, ensure_demo_dataset
from captionflow.config import RunConfig
from captionflow.model_source import resolve_model
from captionflow.pipeline.engine import resolve_engine
from captionflow.pipeline.presets import CPU
from captionflow.pipeline.request_format import image_prompt
from captionflow.workers.images import engine_image
from captionflow.workers.rendered_requests import RENDERED, build_renderer, render, rendered_input


def _engine_request_parts(request):
    (feature,) = request.mm_features
    data = {k: v.data for k, v in feature.data.items()}
    return request.prompt_token_ids, feature.mm_hash, feature.mm_position, data


def test_a_rendered_request_reaches_the_engine_as_its_own_front_end_would_make_it(builtin_model_dir):
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    model = resolve_model("builtin")
    engine = resolve_engine(RunConfig(device="cpu", render_actors=1), model, CPU)
    assert engine.render_actors == 1
    prompt = image_prompt(model.path).render("You describe images.", "Describe the image.")
    names = sorted(DEMO_CAPTIONS)[:2]
    images = [
        engine_image((ensure_demo_dataset() / n).read_bytes(), engine.image_grid) for n in names
    ]  # as the run's request builders make them
    renderer = build_renderer(model.path, engine.engine_kwargs)
    front_end = InputProcessor(EngineArgs(model=model.path, **engine.engine_kwargs).create_engine_config())
    params = SamplingParams(max_tokens=8, temperature=0.0)

    parts = []
    for i, image in enumerate(images):
        mm = render(renderer, prompt, image)
        assert set(mm) == {RENDERED} and isinstance(mm[RENDERED], bytes)
        came = rendered_input({"prompt": prompt, "multi_modal_data": mm})
        assert came is not None and came["type"] == "multimodal"
        ours = front_end.process_inputs(f"a{i}", came, params, ("generate",))
        theirs = front_end.process_inputs(
            f"b{i}", {"prompt": prompt, "multi_modal_data": {"image": image}}, params, ("generate",)
        )
        mine, own = _engine_request_parts(ours), _engine_request_parts(theirs)
        assert mine[:3] == own[:3]  # tokens, the image's hash (prefix caching) and its place in the prompt
        assert mine[3].keys() == own[3].keys() and all(
            np.array_equal(np.asarray(mine[3][k]), np.asarray(own[3][k])) for k in own[3]
        )  # pixel values and grid, bit for bit
        parts.append(mine)
    # two different images: two different requests (nothing cached across them)
    assert parts[0][1] != parts[1][1]
    assert not np.array_equal(np.asarray(parts[0][3]["pixel_values"]), np.asarray(parts[1][3]["pixel_values"]))


def test_a_prompt_not_rendered_before_is_left_to_the_front_end():
    assert rendered_input({"prompt": "p", "multi_modal_data": {"image": np.zeros((4, 4, 3), np.uint8)}}) is None
    assert rendered_input({"prompt": "p"}) is None
    assert rendered_input("just text") is None


def test_an_image_rendered_twice_carries_its_data_both_times(builtin_model_dir):
    """A rendered request stands alone: whichever engine gets it, whatever that engine saw before. vLLM's own front
    end sends a repeated image as its hash only (its engine core keeps a mirror of what it was sent); a render
    actor serves several engines and is none's mirror, so it always sends the data (a dataset may hold the same
    image twice: the second copy went as a bare hash to an engine that had never seen it)."""
    import pickle

    model = resolve_model("builtin")
    engine = resolve_engine(RunConfig(device="cpu", render_actors=1), model, CPU)
    assert engine.engine_kwargs.get("mm_processor_cache_gb", 4) != 0  # the engines keep vLLM's cache
    prompt = image_prompt(model.path).render("You describe images.", "Describe the image.")
    image = engine_image((ensure_demo_dataset() / sorted(DEMO_CAPTIONS)[0]).read_bytes(), engine.image_grid)
    renderer = build_renderer(model.path, engine.engine_kwargs)
    first, second = (pickle.loads(render(renderer, prompt, image)[RENDERED]) for _ in range(2))
    for rendered in (first, second):
        (item,) = rendered["mm_kwargs"]["image"]
        assert item is not None and "pixel_values" in item
    assert first["mm_hashes"] == second["mm_hashes"]
