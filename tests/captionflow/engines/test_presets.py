"""Presets and the engine settings resolved from them once."""

from __future__ import annotations

from captionflow.config import RunConfig
from captionflow.engines.engine import resolve_engine
from captionflow.engines.presets import CPU, GPU, PRESETS, local_ray_cpus, pipeline_cpus
from captionflow.model_source import resolve_model


def test_presets_keep_the_engine_fed():
    for p in PRESETS.values():
        # enough requests in flight per replica to fill the vLLM scheduler
        assert p.batch_size * p.max_concurrent_batches >= p.max_num_seqs, p.name


def test_a_local_ray_has_room_for_every_stage_at_once():
    assert local_ray_cpus(CPU, 1) >= pipeline_cpus(CPU, 1) + 1
    assert local_ray_cpus(CPU, 1, override=7) == 7


def test_a_local_ray_on_g_gpus_has_room_for_every_gpus_engines_and_their_reads(monkeypatch):
    """Sized for one GPU's engines, a local Ray on a 2-GPU 32-core host (and a 4-GPU 64-core one) gave the engines
    every CPU: the reads never ran and the run hung with every engine loaded (H200 hosts, 2026-11-28)."""
    from captionflow.engines.session import local_num_cpus

    for gpus in (1, 2, 4, 8):
        monkeypatch.setattr("os.cpu_count", lambda gpus=gpus: 16 * gpus)  # the lent hosts: 16 cores per GPU
        cpus = local_num_cpus(RunConfig(device="gpu"), GPU, gpus)
        engines = gpus * GPU.max_engines_per_gpu
        # every engine and, beside them, at least one task of each plain operator per GPU
        assert cpus >= engines * GPU.engine_cpus + gpus * 5 * GPU.map_cpus, (gpus, cpus)
    tp = local_num_cpus(RunConfig(device="gpu", tensor_parallel_size=2, engines_per_gpu=1), GPU, 4)
    assert tp >= 2 * GPU.engine_cpus + 2 * 5 * GPU.map_cpus  # two engines of two GPUs each
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert local_num_cpus(RunConfig(device="cpu"), CPU, 0) == local_ray_cpus(CPU, 1)  # CPU: as before
    # a verdict on the judge's score or the pairwise win on CPU: the judge's engine beside the captioner's, and room
    judged = RunConfig(device="cpu", verdict="sequential", verdict_score="pairwise", pairwise_against="previous")
    assert local_num_cpus(judged, CPU, 0) == local_ray_cpus(CPU, 2) >= 2 * CPU.engine_cpus + 2 * 5 * CPU.map_cpus


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


def test_gpu_layout_shares_each_gpu_between_the_engines_that_feed_it(builtin_model_dir):
    model = resolve_model("builtin")
    e = resolve_engine(RunConfig(gpu_memory_gib=80, cuda_mps="off"), model, GPU, gpus=2, local_ray=True)
    assert e.engines_per_gpu == GPU.max_engines_per_gpu and e.concurrency == 2 * e.engines_per_gpu
    assert e.gpu_share == 1.0 / e.engines_per_gpu
    assert e.engine_kwargs["kv_cache_memory_bytes"] == GPU.kv_cache_bytes  # fixed: they share the GPU
    assert e.engine_kwargs["renderer_num_workers"] >= 2 and e.engine_kwargs["mm_processor_cache_gb"] == 0
    assert e.service_engines() == (e, 2 * e.engines_per_gpu)  # the warm service: the same engines, kept warm
    # ... and with the judge's engines beside them, half of each GPU's engines each, every one of the same share
    halves, n = e.service_engines(beside_judge=True)
    assert n == e.engines_per_gpu and halves.gpu_share == e.gpu_share and halves.engine_kwargs == e.engine_kwargs
    cpu = resolve_engine(RunConfig(device="cpu"), model, CPU)
    assert cpu.service_engines(beside_judge=True) == (cpu, 1)  # on CPU, the engines a run starts for each
    # the request-building tasks scale with the GPUs the engines span (one count for any G capped G GPUs at one's rate)
    one_gpu = resolve_engine(RunConfig(gpu_memory_gib=80, cuda_mps="off"), model, GPU, gpus=1, local_ray=True)
    assert one_gpu.map_concurrency == GPU.map_concurrency and e.map_concurrency == 2 * GPU.map_concurrency
    assert resolve_engine(RunConfig(), model, CPU).map_concurrency == CPU.map_concurrency
    one = e.single_engine()  # one engine owns its GPU
    assert one.engines_per_gpu == 1 and one.gpu_share == 1.0 and one.concurrency == 2 and one.mps == "off"
    assert "kv_cache_memory_bytes" not in one.engine_kwargs  # alone on its GPU, it sizes its KV cache itself
    assert one.engine_kwargs["gpu_memory_utilization"] == GPU.engine_kwargs["gpu_memory_utilization"]
    assert one.compile_dir == e.compile_dir and one.output_params() == e.output_params()
    assert one.single_engine() is one
    assert e.engine_kwargs["compilation_config"]["cache_dir"].endswith(
        model.architecture + "/" + e.engine_kwargs["compilation_config"]["cache_dir"].rsplit("/", 1)[-1]
    )
    graphs = e.engine_kwargs["compilation_config"]
    assert graphs["mode"] == 0 and graphs["cudagraph_mode"] == "FULL"  # CUDA graphs, no torch.compile
    sizes = graphs["cudagraph_capture_sizes"]  # bounded by the batches the engine runs, not vLLM's 51 sizes
    assert sizes == sorted(set(sizes)) and sizes[-1] == e.engine_kwargs["max_num_seqs"] and len(sizes) < 51
    small = resolve_engine(RunConfig(gpu_memory_gib=80, max_num_seqs=100), model, GPU, gpus=2)
    assert small.engine_kwargs["compilation_config"]["cudagraph_capture_sizes"][-2:] == [96, 100]
    compiled = resolve_engine(
        RunConfig(gpu_memory_gib=80, cuda_mps="off", engine_kwargs={"compilation_config": {"mode": 3}}), model, GPU, 2
    )
    cc = compiled.engine_kwargs["compilation_config"]  # torch.compile asked for: the preset's graph mode goes
    assert cc["mode"] == 3 and "cudagraph_mode" not in cc and cc["cache_dir"] == graphs["cache_dir"]
    assert cc["cudagraph_capture_sizes"] == sizes and compiled.output_params() == e.output_params()
    alone = resolve_engine(RunConfig(engines_per_gpu=1, gpu_memory_gib=80, cuda_mps="off"), model, GPU, gpus=2)
    assert alone.engines_per_gpu == 1 and alone.concurrency == 2 and alone.gpu_share == 1.0
    assert "kv_cache_memory_bytes" not in alone.engine_kwargs and alone.single_engine() is alone


def test_a_warm_engine_serves_every_run_whose_captions_it_would_write(builtin_model_dir, monkeypatch):
    """The service's spec ignores layout, memory, the compile cache's place and vLLM's logging environment
    (a run and the service it used disagreed on an H100: the service was replaced instead of hot-swapped)."""
    from captionflow.service.controller import engine_spec

    model = resolve_model("builtin")
    monkeypatch.delenv("VLLM_NO_USAGE_STATS", raising=False)
    run = resolve_engine(RunConfig(gpu_memory_gib=80, cuda_mps="off"), model, GPU, gpus=1)
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "1")  # set in the process once it has started Ray
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "1")
    service = resolve_engine(RunConfig(gpu_memory_gib=80, engines_per_gpu=1, cuda_mps="off"), model, GPU, gpus=1)
    assert service.compile_dir == run.compile_dir
    assert engine_spec(model, service) == engine_spec(model, run) == engine_spec(model, run.single_engine())
    other = resolve_engine(RunConfig(gpu_memory_gib=80, max_model_len=2048), model, GPU, gpus=1)
    assert engine_spec(model, other) != engine_spec(model, run)  # a setting that can change captions
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")  # can change the graphs: another cache
    assert resolve_engine(RunConfig(gpu_memory_gib=80), model, GPU, gpus=1).compile_dir != run.compile_dir


def test_compiled_graphs_are_keyed_on_the_architecture_not_the_checkpoint_path(builtin_model_dir, tmp_path):
    import shutil

    from captionflow.builtin.model import build_builtin_model

    a = resolve_model("builtin")
    b = resolve_model(str(build_builtin_model(tmp_path / "step-2000", seed=1)))  # other weights, same architecture
    copy = tmp_path / "copy"
    shutil.copytree(a.path, copy)
    cache = lambda m, **o: resolve_engine(RunConfig(gpu_memory_gib=80, **o), m, GPU, gpus=1).engine_kwargs[
        "compilation_config"
    ]["cache_dir"]
    assert cache(a) == cache(b) == cache(resolve_model(str(copy)))  # any checkpoint, any path: the same graphs
    assert cache(a, max_model_len=2048) != cache(a)  # other engine settings: other graphs
    assert cache(a, compile_cache_dir=str(tmp_path / "shared")).startswith(str(tmp_path / "shared"))


def test_the_captions_fingerprint_does_not_depend_on_the_hosts_cores(builtin_model_dir, monkeypatch):
    """The front end's image threads follow the host's cores; the same checkpoint and settings on another host
    make the same captions (a run there reuses them; the warm service's engines serve it)."""
    model = resolve_model("builtin")
    cfg = RunConfig(gpu_memory_gib=80, cuda_mps="off")
    made = {}
    for cores in (64, 8):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        made[cores] = resolve_engine(cfg, model, GPU, gpus=1, local_ray=True)
    assert made[64].engine_kwargs["renderer_num_workers"] != made[8].engine_kwargs["renderer_num_workers"]
    assert made[64].output_params() == made[8].output_params()
