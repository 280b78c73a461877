"""Engine and resource presets for CPU and GPU, and the Ray resource sizing they imply.

Ray schedules by *logical* CPUs. Ray Data LLM runs one actor per stage (multimodal preparation,
chat template, optional tokenize/detokenize) plus the engine actor, and plain tasks for read,
filter and the pre/post maps. Left at Ray's defaults (1 CPU each) on a 2-core machine, the
actors take every CPU and the map tasks wait forever ("Active & requested resources: 3/2 CPU").

So every stage here declares its CPU share explicitly, and a local Ray is started with
``max(physical cores, ceil(sum of the declared shares) + 1)`` logical CPUs: every stage can be
placed at once, and the operating system shares the physical cores between them. This is safe
because the shares are bookkeeping: the busy process is the vLLM engine, which sizes its own
threads to the physical cores. ``ray_num_cpus`` overrides the number.

Engines per GPU (GPU preset). One vLLM engine does its multimodal input processing (the image
processor: resize, normalise, patchify) in one Python process, and for a small VLM that process,
not the GPU, is the bottleneck (shared/GPU-HOST.md: raw vLLM kept an H100 ~26% busy). So the GPU
preset runs several engine replicas on each GPU (each a Ray actor holding ``1/k`` of the GPU, its
own fixed KV cache), which spreads input processing over k processes. k is chosen from the
model's weight size: as many engines as fit in 90% of the GPU's memory, at most
``max_engines_per_gpu``; ``engines_per_gpu`` overrides it. Measured on an H100 (README, GPU
benchmark): 4 engines under CUDA MPS, all fed, with the HF processor pre-built while they start
(captionflow/vllm_warmup.py), gave 85 images/s (stage) and 82.5 (whole flow) with the GPU ~80% busy,
2.2x raw vLLM, at the preset's 448x448 pixel budget; 209-220 images/s (3.0-3.2x raw) at 224x224.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Preset:
    name: str
    batch_size: int
    concurrency: int
    max_concurrent_batches: int
    max_num_seqs: int
    max_model_len: int
    max_pixels: int
    cpu_stage_cpus: float  # each Ray Data LLM CPU stage actor
    map_cpus: float  # each plain map/read task
    # Most tasks at once of each plain map/read operator. Bounded so that a small, steady set of Ray
    # worker processes runs them: unbounded, Ray Data launched ~15 postprocess tasks at once when the
    # first results arrived, Ray started a new worker process for each (~1-2 s of CPU apiece, all 16
    # cores busy for ~4 s), and the engines' front ends starved: the GPU fell to 12-50% busy
    # (measured on the H100 host with top, README "GPU benchmark"). The maps are light.
    map_concurrency: int
    engine_cpus: float
    engine_gpus: int
    tokenize_in_ray: bool  # separate tokenize/detokenize stages (else vLLM does it in-engine)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    cpu_stage_concurrency: int = 1  # most actors of each Ray Data LLM CPU stage (autoscaling from 1)
    max_engines_per_gpu: int = 1
    kv_cache_bytes: int = 0  # fixed KV cache of each engine when several share a GPU
    engine_overhead_bytes: int = 0  # activations, CUDA graphs, vision encoder workspace per engine
    # Batches Ray Data hands each engine actor at once (None: Ray's default, 2 x max_concurrent_batches).
    # Equal to max_concurrent_batches, the remaining batches wait in Ray Data's queue and go to whichever
    # engine frees a slot first, instead of piling up behind the first engine that finished starting.
    max_tasks_in_flight_per_actor: int | None = None


CPU = Preset(
    name="cpu", batch_size=8, concurrency=1, max_concurrent_batches=2, max_num_seqs=16, max_model_len=1024,
    max_pixels=224 * 224, cpu_stage_cpus=0.25, map_cpus=0.25, map_concurrency=2, engine_cpus=1.0, engine_gpus=0,
    tokenize_in_ray=False,
    # enforce_eager: torch.compile warm-up costs ~40 s on 2 cores for no gain on a tiny model.
    # kv_cache_memory_bytes: a fixed KV budget instead of vLLM's "fraction of node memory" check.
    engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 512 * 2**20, "dtype": "float32"},
)
GPU = Preset(
    name="gpu", batch_size=32, concurrency=1, max_concurrent_batches=12, max_num_seqs=256, max_model_len=4096,
    max_pixels=448 * 448, cpu_stage_cpus=1.0, map_cpus=0.5, map_concurrency=4, engine_cpus=2.0, engine_gpus=1,
    # tokenize in the engine, from the chat-templated text, as raw vLLM does: two fewer Ray actors per
    # pipeline; tokenising is a small part of the engine's input processing (profile: README, GPU benchmark).
    tokenize_in_ray=False,
    # max_num_batched_tokens: vLLM's default depends on who builds the engine - 16384 on an H100 for
    # vllm.LLM, 2048 for the AsyncLLM that Ray Data LLM builds - so an image prompt (~300 tokens)
    # prefills a few at a time per step unless it is set. engine_cpus 2: Ray gives each engine actor
    # OMP_NUM_THREADS = its CPUs, and the image processor's torch ops run on them.
    # prefix caching: every request starts with the same system prompt; chunked prefill: long image
    # prompts do not stall running decodes; no processor cache: every image is new (it only costs hashing).
    engine_kwargs={"enable_prefix_caching": True, "enable_chunked_prefill": True, "gpu_memory_utilization": 0.9,
                   "mm_processor_cache_gb": 0, "max_num_batched_tokens": 16384},
    cpu_stage_concurrency=4, max_engines_per_gpu=4, kv_cache_bytes=4 * 2**30, engine_overhead_bytes=4 * 2**30,
    # 12 batches of 32 per engine: max_num_seqs running plus half as many waiting, and no more (see above).
    max_tasks_in_flight_per_actor=12,
)
PRESETS = {"cpu": CPU, "gpu": GPU}

# Plain Ray Data tasks in the inference pipeline: read, filter, preprocess map, postprocess map, final map.
N_MAP_TASKS = 5


def pipeline_cpus(preset: Preset, concurrency: int) -> float:
    """Sum of the logical CPUs every stage of the inference pipeline declares (CPU stages at full size)."""
    n_cpu_stages = 2 + (2 if preset.tokenize_in_ray else 0)  # multimodal prep + chat template (+ tok/detok)
    return (n_cpu_stages * preset.cpu_stage_concurrency * preset.cpu_stage_cpus + N_MAP_TASKS * preset.map_cpus
            + concurrency * preset.engine_cpus)


def model_weight_bytes(model_path: str) -> int | None:
    """Bytes of the checkpoint's weights: its weight files, else a stand-in's parameter count in bf16."""
    import json
    from pathlib import Path

    root = Path(model_path)
    files = [p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")] if root.is_dir() else []
    if files:
        return sum(p.stat().st_size for p in files)
    meta = root / "captionflow_model.json"
    if meta.is_file():
        params = json.loads(meta.read_text()).get("parameters")
        return int(params) * 2 if params else None
    return None


def engines_per_gpu(preset: Preset, weight_bytes: int | None, gpu_memory_bytes: int | None,
                    tensor_parallel_size: int = 1, override: int | None = None) -> int:
    """How many engine replicas share one GPU (see the module docstring)."""
    if override:
        return override
    if preset.engine_gpus == 0 or preset.max_engines_per_gpu <= 1 or tensor_parallel_size > 1:
        return 1
    if not weight_bytes or not gpu_memory_bytes:
        return 1
    per_engine = weight_bytes + preset.kv_cache_bytes + preset.engine_overhead_bytes
    return max(1, min(preset.max_engines_per_gpu, int(0.9 * gpu_memory_bytes // per_engine)))


def local_gpu_memory_bytes() -> int | None:
    """Memory of this machine's first GPU (None without one), read through NVML where it is installed so
    that the driver process does not open a CUDA context of its own (it would hold GPU memory all run)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if pynvml.nvmlDeviceGetCount() > 0:
                return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except Exception:
        pass
    return None


def local_ray_cpus(preset: Preset, concurrency: int, override: int | None = None) -> int:
    if override:
        return override
    return max(os.cpu_count() or 1, math.ceil(pipeline_cpus(preset, concurrency)) + 1)
