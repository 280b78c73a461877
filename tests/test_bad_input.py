"""Bad parameters fail fast with a message naming what and where, before Ray starts."""

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


def test_cli_reports_bad_model_and_dataset(prefect_api, tmp_path, capsys):
    import ray

    from captionflow.cli import main

    ray_was_up = ray.is_initialized()  # an earlier test in this process may have started it
    assert main(["run", "--output", str(tmp_path / "o"), "--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["run", "--output", str(tmp_path / "o"), "--dataset", str(tmp_path / "no-such-folder")]) == 2
    err = capsys.readouterr().err
    assert "no-such-folder" in err and "does not exist" in err
    assert ray.is_initialized() == ray_was_up  # rejected before Ray was started
    assert not (tmp_path / "o" / "runs").exists()


def test_cli_rejects_unknown_config_keys(tmp_path, capsys):
    from captionflow.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("modle: builtin\n")
    assert main(["run", "--config", str(cfg)]) == 2
    assert "modle" in capsys.readouterr().err
