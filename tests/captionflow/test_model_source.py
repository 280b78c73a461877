"""The model parameter: resolved and checked before Ray starts, a bad one named with its path."""

from __future__ import annotations

import json

import pytest

from captionflow.model_source import ModelError, resolve_model


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_non_vlm_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ModelError, match="no vision_config"):
        resolve_model(str(tmp_path))


def test_unreadable_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="unreadable"):
        resolve_model(str(tmp_path))
