"""Preflight: what fails cheaply fails first, in one line naming what and where, before Ray or vLLM starts."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from captionflow.config import RunConfig
from captionflow.errors import DatasetError, ModelError
from captionflow.preflight import OptionError, OutputError, PlacementError, preflight


@pytest.fixture
def no_ray():
    import ray

    up = ray.is_initialized()
    yield
    assert ray.is_initialized() == up  # nothing here started Ray


def _fast(fn, *args):
    t0 = time.monotonic()
    try:
        return fn(*args)
    finally:
        assert time.monotonic() - t0 < 10


def test_a_good_run_passes_and_resolves_its_engine(builtin_model_dir, tmp_path, no_ray):
    checked = _fast(preflight, RunConfig(output=str(tmp_path), device="cpu", judge=True))
    assert checked.judge == checked.model and checked.engine.preset.name == "cpu"
    assert checked.engine.max_pixels == checked.engine.engine_kwargs["mm_processor_kwargs"]["max_pixels"]


def test_an_output_that_cannot_be_written(builtin_model_dir, tmp_path, s3_server, no_ray):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match=r"output '.*file/out' cannot be written"):
        _fast(preflight, RunConfig(output=str(tmp_path / "file" / "out")))
    with pytest.raises(OutputError, match=r"s3://no-such-bucket-cf/out.*bucket does not exist"):
        _fast(preflight, RunConfig(output="s3://no-such-bucket-cf/out"))


def test_the_output_check_leaves_no_folder_it_made_and_keeps_one_that_was_there(tmp_path):
    """``captionflow serve`` writes no outputs: its check of the default output root left an empty
    ./captionflow-out behind."""
    from captionflow.preflight import check_output

    check_output(str(tmp_path / "new" / "out"))
    assert not (tmp_path / "new").exists()
    (tmp_path / "there").mkdir()
    check_output(str(tmp_path / "there"))
    assert (tmp_path / "there").is_dir() and not list((tmp_path / "there").iterdir())


def test_missing_dataset(builtin_model_dir, tmp_path, no_ray):
    with pytest.raises(DatasetError, match="does not exist"):
        _fast(preflight, RunConfig(output=str(tmp_path), dataset=str(tmp_path / "nope")))


def test_truncated_or_incomplete_checkpoints(builtin_model_dir, tmp_path, no_ray):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(builtin_model_dir, ckpt)
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"model.safetensors.*truncated"):
        _fast(preflight, RunConfig(output=str(tmp_path / "o"), model=str(ckpt)))
    weights.write_bytes(b"\xff" * 8 + data[8:100])
    with pytest.raises(ModelError, match="not a complete safetensors file"):
        _fast(preflight, RunConfig(output=str(tmp_path / "o"), model=str(ckpt)))
    weights.write_bytes(data)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00002.safetensors"}}))
    with pytest.raises(ModelError, match="missing shard.*model-00002"):
        _fast(preflight, RunConfig(output=str(tmp_path / "o"), model=str(ckpt)))


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"engine_kwargs": {"max_num_seq": 8}},
            r"'max_num_seq' is not an argument of the installed vLLM.*max_num_seqs",
        ),
        (  # recorded in run.json as if used, without effect on the captions: refused, naming the parameter
            {"engine_kwargs": {"mm_processor_kwargs": {"max_pixels": 4096}}},
            r"'mm_processor_kwargs' is set by captionflow: use max_pixels",
        ),
        ({"max_pixels": 1}, r"max_pixels 1 is below the smallest image"),
        ({"max_model_len": 64}, r"max_model_len 64 is too small: one request needs about \d+ tokens"),
        ({"prompt": "describe " * 14_000}, r"max_model_len 1024 is too small"),
        ({"max_model_len": 999_999}, r"more than the model's max_position_embeddings"),
    ],
)
def test_options_out_of_range_are_named(builtin_model_dir, tmp_path, options, message, no_ray):
    with pytest.raises(OptionError, match=message):
        _fast(preflight, RunConfig(output=str(tmp_path), device="cpu", **options))


def test_a_gpu_run_on_a_machine_without_one(builtin_model_dir, tmp_path, monkeypatch, no_ray):
    import captionflow.preflight as p

    monkeypatch.setattr(p, "local_gpus", lambda: 0)
    with pytest.raises(PlacementError, match="device 'gpu': this machine has no GPU"):
        _fast(preflight, RunConfig(output=str(tmp_path), device="gpu"))


def test_a_storage_endpoint_that_never_answers_fails_in_bounded_time(builtin_model_dir, tmp_path, monkeypatch):
    """An S3 endpoint that accepts connections and then says nothing: the probe write gives up after the read
    timeout and the bounded attempts, naming the output, instead of hanging."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept_and_hold():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept_and_hold, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setenv("CAPTIONFLOW_S3_READ_TIMEOUT", "1")
    monkeypatch.setenv("CAPTIONFLOW_S3_RETRIES", "1")
    t0 = time.monotonic()
    try:
        with pytest.raises(OutputError, match=r"output 's3://hung/out' cannot be written.*(Timeout|timed out)"):
            preflight(RunConfig(output="s3://hung/out"))
    finally:
        stop.set()
        server.close()
        for c in held:
            c.close()
    assert time.monotonic() - t0 < 30


def test_a_model_too_large_for_the_gpu_is_one_line_before_any_engine_and_fp8_is_a_setting_of_its_own(tmp_path):
    """The 72B stand-in on a GPU of 80 GiB (gpu_memory_gib stands in for the GPU this machine does not have), with the
    GPU preset: refused in one line naming what would fit it; in FP8 on 141 GiB it fits, one engine, and its
    captions are apart from 16-bit ones (FP8 is in the generation fingerprint)."""
    from captionflow.builtin.standin import build_standin
    from captionflow.data.fingerprint import generation_fingerprint
    from captionflow.engines.engine import resolve_engine
    from captionflow.engines.presets import GPU
    from captionflow.errors import ModelTooLarge
    from captionflow.model_source import resolve_model

    model = resolve_model(str(build_standin("qwen2.5-vl-72b", tmp_path / "72b")), dummy_weights=True)
    cfg = RunConfig(device="gpu", gpu_memory_gib=80, engine_kwargs={"load_format": "dummy"})
    with pytest.raises(ModelTooLarge, match=r"^model .*72b: its weights take ~137 GiB.* tensor_parallel_size 4") as e:
        resolve_engine(cfg, model, GPU, gpus=1)
    assert "\n" not in str(e.value)
    fp8 = cfg.model_copy(update={"gpu_memory_gib": 141, "quantization": "fp8", "kv_cache_dtype": "fp8"})
    engine = resolve_engine(fp8, model, GPU, gpus=1)
    assert engine.engines_per_gpu == 1 and engine.engine_kwargs["quantization"] == "fp8"
    assert engine.engine_kwargs["kv_cache_dtype"] == "fp8"
    bf16 = resolve_engine(cfg.model_copy(update={"gpu_memory_gib": 1000}), model, GPU, gpus=1)
    assert "quantization" not in bf16.engine_kwargs
    assert generation_fingerprint(fp8, engine) != generation_fingerprint(cfg, bf16)


def test_fp8_on_the_cpu_is_refused_in_one_line(builtin_model_dir, tmp_path, no_ray):
    with pytest.raises(OptionError, match="FP8 needs a GPU"):
        _fast(preflight, RunConfig(output=str(tmp_path), device="cpu", quantization="fp8"))
