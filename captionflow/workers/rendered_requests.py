"""Requests rendered for the engine before the engine stage, and handed to it as they are.

A vLLM engine's front end turns every request into what its engine core takes: it tokenises the prompt, runs
the model's HF image processor (normalising, cutting patches) and vLLM's multimodal bookkeeping. That is most
of the CPU a request costs the front end, one process per engine (docs/sizing.md). Here it is done by CPU
actors before the engine stage (``pipeline/render_stage.py``), with vLLM's own renderer built from the engine's
own arguments: ``render`` makes the input vLLM's ``Renderer.render_cmpl`` makes (an ``EngineInput``) and carries
it in the row's ``multimodal_data`` under ``RENDERED``; ``rendered_input`` gives it back in the engine actor,
where ``compat/vllm_warmup`` passes it to ``AsyncLLM.add_request`` - which takes a rendered input as is - instead
of the prompt Ray Data LLM built. The engine receives what its own front end would have made.

Both ends run the same vLLM (the format is vLLM's, pickled); this module imports vLLM only in ``build_renderer``.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

RENDERED = "captionflow_rendered"  # the key of ``multimodal_data`` that carries a rendered request


# What a render actor's renderer changes of the engine's arguments (nothing a request comes out with depends on them):
STANDALONE = {
    # vLLM's processor cache: a front end sends an image it sent before as its hash alone, for its engine core's
    # mirror of what it was sent. A render actor serves several engines and is no core's mirror: a rendered
    # request carries its image's data every time.
    "mm_processor_cache_gb": 0,
    # a thread pool of the engine's size, each thread with a deep copy of the tokenizer (~1-2 s apiece at start-up):
    # the actor renders on one thread
    "renderer_num_workers": 1,
}


def build_renderer(model: str, engine_kwargs: dict[str, Any]):
    """vLLM's renderer for ``model`` with the engine's arguments (the pixel budget, the processor's settings) but
    ``STANDALONE``'s: what the engine's front end renders with, each request standing alone."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    config = EngineArgs(model=model, **{**engine_kwargs, **STANDALONE}).create_engine_config()
    return InputProcessor(config).renderer


def render(renderer, prompt: str, image) -> dict[str, bytes]:
    """The ``multimodal_data`` of a request rendered by ``renderer``: ``prompt`` (text) around one ``image``."""
    (engine_input,) = renderer.render_cmpl([{"prompt": prompt, "multi_modal_data": {"image": image}}])
    return {RENDERED: pickle.dumps(engine_input, protocol=pickle.HIGHEST_PROTOCOL)}


def render_row(renderer, row: dict[str, Any]) -> dict[str, bytes]:
    """``render`` of a request row as the run's preprocess makes it (its ``prompt``, its ``multimodal_data`` image):
    the row's ``multimodal_data`` for the engine. Raises what rendering raised."""
    return render(renderer, row["prompt"], row["multimodal_data"]["image"])


def rendered_input(prompt: Any) -> dict | None:
    """The rendered input a prompt from Ray Data LLM carries (None: a prompt to render as usual). It arrives now."""
    mm = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    if not isinstance(mm, dict) or RENDERED not in mm:
        return None
    engine_input = pickle.loads(mm[RENDERED])
    engine_input["arrival_time"] = time.time()
    return engine_input
