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
    engine_cpus: float
    engine_gpus: int
    tokenize_in_ray: bool  # separate tokenize/detokenize stages (else vLLM does it in-engine)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


CPU = Preset(
    name="cpu", batch_size=8, concurrency=1, max_concurrent_batches=2, max_num_seqs=16, max_model_len=1024,
    max_pixels=224 * 224, cpu_stage_cpus=0.25, map_cpus=0.25, engine_cpus=1.0, engine_gpus=0,
    tokenize_in_ray=False,
    # enforce_eager: torch.compile warm-up costs ~40 s on 2 cores for no gain on a tiny model.
    # kv_cache_memory_bytes: a fixed KV budget instead of vLLM's "fraction of node memory" check.
    engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 512 * 2**20, "dtype": "float32"},
)
GPU = Preset(
    name="gpu", batch_size=64, concurrency=1, max_concurrent_batches=8, max_num_seqs=256, max_model_len=4096,
    max_pixels=448 * 448, cpu_stage_cpus=1.0, map_cpus=0.5, engine_cpus=1.0, engine_gpus=1,
    tokenize_in_ray=True,
    engine_kwargs={"enable_prefix_caching": True, "enable_chunked_prefill": True, "gpu_memory_utilization": 0.9},
)
PRESETS = {"cpu": CPU, "gpu": GPU}

# Plain Ray Data tasks in the inference pipeline: read, filter, preprocess map, postprocess map, final map.
N_MAP_TASKS = 5


def pipeline_cpus(preset: Preset, concurrency: int) -> float:
    """Sum of the logical CPUs every stage of the inference pipeline declares."""
    n_cpu_stages = 2 + (2 if preset.tokenize_in_ray else 0)  # multimodal prep + chat template (+ tok/detok)
    return n_cpu_stages * preset.cpu_stage_cpus + N_MAP_TASKS * preset.map_cpus + concurrency * preset.engine_cpus


def local_ray_cpus(preset: Preset, concurrency: int, override: int | None = None) -> int:
    if override:
        return override
    return max(os.cpu_count() or 1, math.ceil(pipeline_cpus(preset, concurrency)) + 1)
