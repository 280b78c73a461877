"""Fingerprints name folders: they change with every input that can change a result, and only those."""

from __future__ import annotations

import os
import shutil

import pytest
from PIL import Image

from captionflow.config import RunConfig
from captionflow.data.fingerprint import generation_fingerprint
from captionflow.data.sources import ingest
from captionflow.engines.engine import resolve_engine
from captionflow.engines.presets import CPU, GPU
from captionflow.model_source import resolve_model


def test_two_datasets_with_the_same_names_sizes_and_times_are_two_datasets(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    Image.new("RGB", (32, 32), "red").save(a / "x.png")
    shutil.copytree(a, b)  # copytree keeps mtimes; b's content could differ, its place does
    os.utime(b / "x.png", (os.stat(a / "x.png").st_atime, os.stat(a / "x.png").st_mtime))
    fa = ingest(RunConfig(dataset=str(a), output=str(tmp_path / "out"))).dataset_fingerprint
    fb = ingest(RunConfig(dataset=str(b), output=str(tmp_path / "out"))).dataset_fingerprint
    assert fa != fb


def _gen_fp(builtin_model_dir, preset=CPU, **options):
    cfg = RunConfig(**options)
    return generation_fingerprint(cfg, resolve_engine(cfg, resolve_model("builtin"), preset))


@pytest.mark.parametrize(
    "change",
    [
        {"max_pixels": 112 * 112},
        {"max_model_len": 2048},
        {"engine_kwargs": {"dtype": "bfloat16"}},
        {"engine_kwargs": {"load_format": "dummy"}},
        {"max_tokens": 16},
        {"prompt": "What is this?"},
        {"seed": 3},
    ],
)
def test_every_setting_that_changes_a_caption_changes_the_run(builtin_model_dir, change):
    assert _gen_fp(builtin_model_dir, **change) != _gen_fp(builtin_model_dir)


def test_the_device_changes_the_run(builtin_model_dir):
    assert _gen_fp(builtin_model_dir, preset=GPU, gpu_memory_gib=80) != _gen_fp(builtin_model_dir, preset=CPU)


@pytest.mark.parametrize(
    "change", [{"max_num_seqs": 4}, {"batch_size": 2}, {"engine_kwargs": {"max_num_batched_tokens": 4096}}]
)
def test_speed_settings_do_not_change_the_run(builtin_model_dir, change):
    assert _gen_fp(builtin_model_dir, **change) == _gen_fp(builtin_model_dir)


def test_file_digests_hash_the_matching_files_of_a_folder_by_name(tmp_path):
    import hashlib

    from captionflow.data.fingerprint import file_digests

    (tmp_path / "tokenizer.json").write_text("t")
    (tmp_path / "tokenizer_config.json").write_text("c")
    (tmp_path / "model.safetensors").write_bytes(b"w")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "tokenizer.json").write_text("nested")
    got = file_digests(tmp_path, ("tokenizer*", "chat_template.jinja"))
    assert got == {
        "tokenizer.json": hashlib.sha256(b"t").hexdigest(),
        "tokenizer_config.json": hashlib.sha256(b"c").hexdigest(),
    }  # weights, folders and absent names left out
    (tmp_path / "tokenizer.json").write_text("t2")
    assert file_digests(tmp_path, ("tokenizer*",))["tokenizer.json"] != got["tokenizer.json"]
    assert file_digests(tmp_path / "missing", ("*",)) == {}
