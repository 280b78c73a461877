"""How a run's requests reach the engine: each a prompt rendered from the checkpoint's chat template once per
checkpoint (``workers/image_prompt.py``) and the image as an RGB array fitted to the model's patch grid
(``workers/images.engine_image``), so the engine stage takes them as they are - no multimodal-preparation or
chat-template stage, no image decoding on the engine's front end (docs/sizing.md).

The rendered prompt is kept on disk (``<captionflow cache>/prompts``) keyed on the files it comes from, so
that a run whose checkpoint's template was rendered before - every checkpoint of a fine-tuning run - need not
load the processor.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile

from captionflow.data.cache import default_cache_dir
from captionflow.data.fingerprint import digest, file_digests
from captionflow.workers.image_prompt import TEMPLATE_FILES, ImagePrompt, render_image_prompt

# Part of every generation fingerprint (EngineSettings.output_params): a change here is a change of captions.
REQUEST_FORMAT = "image-prompt-rendered-once/1"


def _template_key(model_path: str) -> str:
    import importlib.metadata

    files = file_digests(model_path, TEMPLATE_FILES)
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = ""
    return digest({"files": files, "transformers": transformers, "format": REQUEST_FORMAT})


@functools.lru_cache(maxsize=8)
def image_prompt(model_path: str) -> ImagePrompt:
    """``model_path``'s ``ImagePrompt``: from the disk cache, else rendered (and kept)."""
    path = default_cache_dir() / "prompts" / f"{_template_key(model_path)}.json"
    try:
        return ImagePrompt(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        pass
    prompt = render_image_prompt(model_path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".prompt-")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(prompt), fh)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: rendered again next time
    return prompt
