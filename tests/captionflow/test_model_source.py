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


def test_a_lora_adapter_resolves_to_its_base_with_a_fingerprint_of_its_own(tmp_path):
    from captionflow.builtin.adapter import build_adapter

    base = resolve_model("builtin")
    a1, a2 = (resolve_model(str(build_adapter(tmp_path / f"a{s}", seed=s))) for s in (1, 2))
    assert a1.path == a2.path == base.path and a1.architecture == base.architecture  # the engines load the base
    assert len({base.fingerprint, a1.fingerprint, a2.fingerprint}) == 3  # never each other's captions
    assert a1.adapter.path == str(tmp_path / "a1") and a1.adapter.rank == 8 and "q_proj" in a1.adapter.targets
    assert base.adapter is None
    # a base given relative to the adapter's folder
    rel = build_adapter(tmp_path / "nested" / "a3", seed=3, base=str(base.path))
    conf = json.loads((rel / "adapter_config.json").read_text())
    (tmp_path / "nested" / "base").symlink_to(base.path)
    conf["base_model_name_or_path"] = "../base"
    (rel / "adapter_config.json").write_text(json.dumps(conf))
    assert resolve_model(str(rel)).path == str((tmp_path / "nested" / "base").resolve())


@pytest.mark.parametrize(
    "change, says",
    [
        ({"target_modules": ["q_proj", "visual.blocks.0.attn.qkv"]}, "adapts the vision tower"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"r": 1024}, "rank r=1024"),
        ({"base_model_name_or_path": None}, "names no base_model_name_or_path"),
        ({"base_model_name_or_path": "/nowhere/base"}, "its base '/nowhere/base': model path"),
    ],
)
def test_an_adapter_that_cannot_be_served_is_one_line_naming_it(tmp_path, change, says):
    from captionflow.builtin.adapter import build_adapter

    folder = build_adapter(tmp_path / "a", seed=1)
    conf = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**conf, **change}))
    with pytest.raises(ModelError) as e:
        resolve_model(str(folder))
    assert says in str(e.value) and str(folder) in str(e.value) and "\n" not in str(e.value)


def test_an_adapter_with_missing_or_truncated_weights_is_refused(tmp_path):
    from captionflow.builtin.adapter import build_adapter

    folder = build_adapter(tmp_path / "a", seed=1)
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelError, match="truncated"):
        resolve_model(str(folder))
    weights.unlink()
    with pytest.raises(ModelError, match="no adapter weights"):
        resolve_model(str(folder))


def test_an_adapter_whose_weights_adapt_the_vision_tower_is_refused(tmp_path):
    """The config may name modules by a pattern; the weights' own names tell."""
    from safetensors.torch import load_file, save_file

    from captionflow.builtin.adapter import build_adapter

    folder = build_adapter(tmp_path / "a", seed=1)
    state = load_file(folder / "adapter_model.safetensors")
    state["base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight"] = next(iter(state.values())).clone()
    save_file(state, folder / "adapter_model.safetensors")
    with pytest.raises(ModelError, match="adapts the vision tower"):
        resolve_model(str(folder))
