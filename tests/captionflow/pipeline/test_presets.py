"""Presets and the engine settings resolved from them once."""

from __future__ import annotations

from captionflow.config import RunConfig
from captionflow.model_source import resolve_model
from captionflow.pipeline.engine import resolve_engine
from captionflow.pipeline.presets import CPU, GPU, PRESETS, local_ray_cpus, pipeline_cpus


def test_presets_keep_the_engine_fed():
    for p in PRESETS.values():
        # enough requests in flight per replica to fill the vLLM scheduler
        assert p.batch_size * p.max_concurrent_batches >= p.max_num_seqs, p.name


def test_a_local_ray_has_room_for_every_stage_at_once():
    assert local_ray_cpus(CPU, 1) >= pipeline_cpus(CPU, 1) + 1
    assert local_ray_cpus(CPU, 1, override=7) == 7


def test_engine_settings_take_the_preset_then_the_runs_overrides(builtin_model_dir):
    model = resolve_model("builtin")
    e = resolve_engine(RunConfig(), model, CPU)
    assert (e.batch_size, e.max_concurrent_batches, e.concurrency, e.max_pixels) == (
        CPU.batch_size,
        CPU.max_concurrent_batches,
        1,
        CPU.max_pixels,
    )
    assert e.engine_kwargs["enforce_eager"] is True and e.engine_kwargs["mm_processor_kwargs"] == {
        "max_pixels": CPU.max_pixels
    }
    assert e.gpu_share == 0 and e.mps == "off"
    cfg = RunConfig(
        batch_size=3, max_pixels=56 * 56, max_num_seqs=4, engine_kwargs={"enforce_eager": False, "max_num_seqs": 5}
    )
    e = resolve_engine(cfg, model, CPU)
    assert e.batch_size == 3 and e.max_pixels == 56 * 56
    assert e.engine_kwargs["mm_processor_kwargs"] == {"max_pixels": 56 * 56}
    assert e.engine_kwargs["enforce_eager"] is False and e.engine_kwargs["max_num_seqs"] == 5  # engine_kwargs win


def test_gpu_engine_layout_follows_the_cluster_and_the_weights(builtin_model_dir):
    model = resolve_model("builtin")  # ~1M parameters: four engines fit on any GPU
    e = resolve_engine(RunConfig(gpu_memory_gib=80, cuda_mps="off"), model, GPU, gpus=2, local_ray=True)
    assert e.engines_per_gpu == GPU.max_engines_per_gpu and e.concurrency == 2 * GPU.max_engines_per_gpu
    assert e.gpu_share == 1 / GPU.max_engines_per_gpu
    assert e.engine_kwargs["kv_cache_memory_bytes"] == GPU.kv_cache_bytes
    one = resolve_engine(RunConfig(engines_per_gpu=1, gpu_memory_gib=80), model, GPU, gpus=2)
    assert one.engines_per_gpu == 1 and one.concurrency == 2 and "kv_cache_memory_bytes" not in one.engine_kwargs
