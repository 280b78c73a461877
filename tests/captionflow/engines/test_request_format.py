"""The run's prompt, rendered once per chat template and kept on disk."""

from __future__ import annotations

import json

from captionflow.engines import request_format
from captionflow.workers.image_prompt import render_image_prompt


def test_the_rendered_prompt_is_kept_and_reused(builtin_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTIONFLOW_CACHE", str(tmp_path))
    request_format.image_prompt.cache_clear()
    first = request_format.image_prompt(str(builtin_model_dir))
    assert first == render_image_prompt(str(builtin_model_dir))
    (kept,) = (tmp_path / "prompts").glob("*.json")
    # what is on disk is what a later process uses: change it and a fresh lookup returns the change
    kept.write_text(json.dumps({"head": "H", "middle": "M", "tail": "T"}))
    request_format.image_prompt.cache_clear()
    assert request_format.image_prompt(str(builtin_model_dir)).render("s", "t") == "HsMtT"
    request_format.image_prompt.cache_clear()
