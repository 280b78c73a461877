"""Engine and resource presets for CPU and GPU, and the Ray resource sizing they imply.

Ray schedules by *logical* CPUs: every stage here declares its CPU share, and a local Ray is started
with ``max(physical cores, ceil(sum of the declared shares) + 1)`` logical CPUs, so that every stage
can be placed at once on a small machine (``engines/session.py``; docs/sizing.md). The shares are
bookkeeping: the busy process is the vLLM engine, which sizes its own threads to the physical cores.

The GPU preset runs as many engines per GPU as fit in memory (weights + a fixed KV cache + overhead each),
at most ``max_engines_per_gpu``: one vLLM 0.26 engine cannot fill the GPU even with a full queue (its engine
core's busy loop is CPU-bound: ~230 images/s at 224 px with an H100 ~75% busy, and its one front-end process
prepares only ~120 images/s), while four under CUDA MPS keep it ~98% busy at ~1.1x that ceiling. Images reach the
engines already fitted to the model's patch grid by Ray Data's CPU stages spread over the host. The rule
and the measurements are in docs/sizing.md; ``engines_per_gpu`` overrides it. The warm engine service
runs the same layout (``EngineSettings.service_engines``).
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
    cpu_stage_cpus: float  # each Ray Data LLM CPU stage actor (tokenize/detokenize, when tokenize_in_ray)
    map_cpus: float  # each plain map/read task
    # Most tasks at once of each plain map/read operator. Bounded so that a small, steady set of Ray
    # worker processes runs them: unbounded, Ray Data launched ~15 postprocess tasks at once when the
    # first results arrived, Ray started a new worker process for each (~1-2 s of CPU apiece, all 16
    # cores busy for ~4 s), and the engines' front ends starved: the GPU fell to 12-50% busy on an H100.
    # The maps are light.
    map_concurrency: int
    engine_cpus: float
    engine_gpus: int
    tokenize_in_ray: bool  # separate tokenize/detokenize stages (else vLLM does it in-engine)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    cpu_stage_concurrency: int = 1  # most actors of each Ray Data LLM CPU stage (autoscaling from 1)
    max_engines_per_gpu: int = 1
    kv_cache_bytes: int = 0  # fixed KV cache of each engine when several share a GPU
    engine_overhead_bytes: int = 0  # activations, CUDA graphs, vision encoder workspace per engine
    # Batches Ray Data hands each engine actor at once (None: Ray's default, 2 x max_concurrent_batches):
    # enough queued behind the batches in flight that the engine's queue never runs dry between them.
    max_tasks_in_flight_per_actor: int | None = None
    # Threads of the engine front end that process images (vLLM's renderer_num_workers); 0: one per two of
    # the host's cores per GPU, between 2 and 16.
    renderer_workers: int = 1
    # The engine processes' environment beyond the run's (``EngineSettings.env``)
    engine_env: dict[str, str] = field(default_factory=dict)


CPU = Preset(
    name="cpu",
    batch_size=8,
    concurrency=1,
    max_concurrent_batches=2,
    max_num_seqs=16,
    max_model_len=1024,
    max_pixels=224 * 224,
    cpu_stage_cpus=0.25,
    map_cpus=0.25,
    map_concurrency=2,
    engine_cpus=1.0,
    engine_gpus=0,
    tokenize_in_ray=False,
    # enforce_eager: torch.compile warm-up costs ~40 s on 2 cores for no gain on a tiny model.
    # kv_cache_memory_bytes: a fixed KV budget instead of vLLM's "fraction of node memory" check.
    engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 512 * 2**20, "dtype": "float32"},
    # VLLM_ENABLE_V1_MULTIPROCESSING 0: vLLM's CPU worker runs inside the engine core's process instead of a third
    # process of its own (the core is still a process apart from the Ray actor: AsyncLLM always spawns it). Every
    # engine start spawned, and imported torch and vLLM in, actor, core and worker one after the other: on 2 cores
    # the demo run's inference stage took 56.3 s with the worker apart and 40.4 s without, the captions equal.
    engine_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
)
GPU = Preset(
    name="gpu",
    batch_size=32,
    concurrency=1,
    # 48 batches of 32: 1,536 rows in each engine, 512 running and 1,024 waiting (processor.max_pending_requests).
    # Every caption has the same length, so an engine's requests finish in waves; with 512 it ran empty after each
    # wave until the next rows had come through the pipeline and its front end (docs/sizing.md)
    max_concurrent_batches=48,
    max_num_seqs=512,
    max_model_len=4096,
    max_pixels=448 * 448,
    cpu_stage_cpus=1.0,
    map_cpus=0.5,
    map_concurrency=4,
    engine_cpus=4.0,
    engine_gpus=1,
    # tokenize in the engine, from the chat-templated text, as raw vLLM does: two fewer Ray actors per
    # pipeline; tokenising is a small part of the engine's input processing.
    tokenize_in_ray=False,
    # max_num_batched_tokens: vLLM's default depends on who builds the engine - 16384 on an H100 for
    # vllm.LLM, 2048 for the AsyncLLM that Ray Data LLM builds - so an image prompt (~300 tokens)
    # prefills a few at a time per step unless it is set. engine_cpus: Ray gives each engine actor
    # OMP_NUM_THREADS = its CPUs, and the image processor's torch ops run on them.
    # prefix caching: every request starts with the same system prompt; chunked prefill: long image
    # prompts do not stall running decodes; no processor cache: every image is new (it only costs hashing).
    # OMP_NUM_THREADS 1 (engine_env): Ray gives each engine actor OMP_NUM_THREADS = its CPUs (4), and every thread
    # of the front end's renderer pool ran the image processor's torch ops on 4 OpenMP threads that spin between
    # ops. On a 4 x H200 host (64 cores), 16 engines: the engine actors used ~37 cores and the host ~99% with the
    # GPUs 5-33% busy, 310 images/s; with 1 thread each, ~3 cores, 770 images/s on the same 16,000 images.
    # compilation_config: CUDA graphs of the whole model, without torch.compile. On the H100 host (224 px, 4
    # engines, the same machine) an engine's init took 26 s instead of 59-61 s (compiling 30-32 s), and the engines
    # captioned no slower: a warm run's 5,000 images in 19.7 s from the first request against 22.1 s, the inference
    # stage at N=8,000 307 images/s steady against 267 (docs/benchmarks.md). engine_kwargs
    # {"compilation_config": {"mode": 3}} compiles (keyed on the architecture: engine.compile_cache_dir). The graphs'
    # batch sizes: engine.graph_sizes.
    engine_kwargs={
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "gpu_memory_utilization": 0.9,
        "mm_processor_cache_gb": 0,
        "max_num_batched_tokens": 16384,
        "compilation_config": {"mode": 0, "cudagraph_mode": "FULL"},
    },
    # 4: the most that one H100's memory holds for a 3B model (7 + 4 + 4 GiB each); fewer leave the GPU
    # partly idle (docs/sizing.md)
    max_engines_per_gpu=4,
    kv_cache_bytes=4 * 2**30,  # each engine's when several share a GPU (engines_per_gpu > 1)
    engine_overhead_bytes=4 * 2**30,
    max_tasks_in_flight_per_actor=48,  # the backlog waits in the engine, already processed (not in the actor)
    renderer_workers=0,
    engine_env={"OMP_NUM_THREADS": "1"},
)
PRESETS = {"cpu": CPU, "gpu": GPU}

# Plain Ray Data tasks in the inference pipeline: read, filter, preprocess map, postprocess map, final map.
N_MAP_TASKS = 5


def pipeline_cpus(preset: Preset, concurrency: int, gpus: int = 1) -> float:
    """Sum of the logical CPUs every stage of the inference pipeline declares (CPU stages at full size) for
    ``concurrency`` engines over ``gpus`` GPUs: the engines, and a task of each plain map/read operator per GPU."""
    n_cpu_stages = 2 if preset.tokenize_in_ray else 0  # tokenize + detokenize (requests come rendered)
    return (
        n_cpu_stages * preset.cpu_stage_concurrency * preset.cpu_stage_cpus
        + N_MAP_TASKS * preset.map_cpus * max(1, gpus)
        + concurrency * preset.engine_cpus
    )


def model_weight_bytes(model_path: str, quantization: str | None = None) -> int | None:
    """Bytes of the checkpoint's weights on a GPU: its weight files (a stand-in: its parameter count in bf16);
    with ``quantization`` fp8 of a 16-bit checkpoint, vLLM's online FP8 keeps the embeddings (and an untied LM
    head) in 16 bits and stores every other weight in one byte. None where neither is known."""
    import json
    from pathlib import Path

    root = Path(model_path)
    files = [p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt")] if root.is_dir() else []
    meta = root / "captionflow_model.json"
    config = _config(root)
    stored_fp8 = ((config or {}).get("quantization_config") or {}).get("quant_method") == "fp8"
    if files:
        stored = sum(p.stat().st_size for p in files)
    elif meta.is_file() and (params := int(json.loads(meta.read_text()).get("parameters") or 0)):
        # a stand-in: its parameters in bf16, or (stored in FP8) one byte each but the embeddings' two
        stored = params + embedding_params(config or {}) if stored_fp8 else 2 * params
    else:
        return None
    if quantization != "fp8" or (config or {}).get("quantization_config"):  # a pre-quantized checkpoint: as it is
        return stored
    embedding = 2 * embedding_params(config or {})  # bytes, kept in 16 bits
    return embedding + (stored - embedding) // 2


def _config(root) -> dict | None:
    import json

    try:
        return json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None


def embedding_params(config: dict) -> int:
    """The token embedding's parameters, and the LM head's where it is not tied to it."""
    text = config.get("text_config") or config
    vocab, hidden = int(text.get("vocab_size") or 0), int(text.get("hidden_size") or 0)
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    return vocab * hidden * (1 if tied else 2)


GIB = 2**30


def too_large(preset: Preset, weight_bytes: int | None, gpu_memory_bytes: int, tensor_parallel_size: int = 1,
              quantization: str | None = None, fp8_bytes: int | None = None) -> str | None:  # fmt: skip
    """Why one engine of a model with ``weight_bytes`` (over ``tensor_parallel_size`` GPUs) cannot fit a GPU of
    ``gpu_memory_bytes`` - its weights, the preset's KV cache and activations over the 90% of the GPU an engine may
    use - and what would fit it (``fp8_bytes``: its weights in FP8); None where it fits (or nothing is known)."""
    if not preset.engine_gpus or not weight_bytes or not gpu_memory_bytes:
        return None
    room, extra = 0.9 * gpu_memory_bytes, preset.kv_cache_bytes + preset.engine_overhead_bytes
    if weight_bytes / tensor_parallel_size + extra <= room:
        return None
    ways = []
    if quantization != "fp8" and fp8_bytes and fp8_bytes / tensor_parallel_size + extra <= room:
        ways.append(f"quantization fp8 (~{fp8_bytes / GIB:.0f} GiB of weights)")
    ways.append(f"a GPU of {math.ceil((weight_bytes / tensor_parallel_size + extra) / 0.9 / GIB)} GiB or more")
    tp = next((t for t in (2, 4, 8) if t > tensor_parallel_size and weight_bytes / t + extra <= room), None)
    if tp:
        ways.append(f"tensor_parallel_size {tp} on a host with {tp} GPUs")
    return (
        f"its weights take ~{weight_bytes / GIB:.0f} GiB"
        + (f" ({weight_bytes / tensor_parallel_size / GIB:.0f} per GPU)" if tensor_parallel_size > 1 else "")
        + f", with {extra / GIB:.0f} GiB of KV cache and activations more than the {room / GIB:.0f} GiB an engine "
        f"may use of a {gpu_memory_bytes / GIB:.0f} GiB GPU; it fits with " + ", or ".join(ways)
    )


# Weights from which one engine runs per GPU (32B and 72B, in bf16 or FP8): its forward passes keep the GPU busy,
# and the KV cache gets the rest of the memory (several engines are for small models, whose one front end cannot
# feed the GPU). A rule from the model sizes; not yet measured on a GPU (docs/sizing.md).
ONE_ENGINE_BYTES = 24 * 2**30


def engines_per_gpu(
    preset: Preset,
    weight_bytes: int | None,
    gpu_memory_bytes: int | None,
    tensor_parallel_size: int = 1,
    override: int | None = None,
) -> int:
    """How many engine replicas share one GPU (see the module docstring)."""
    if override:
        return override
    if preset.engine_gpus == 0 or preset.max_engines_per_gpu <= 1 or tensor_parallel_size > 1:
        return 1
    if not weight_bytes or not gpu_memory_bytes or weight_bytes >= ONE_ENGINE_BYTES:
        return 1
    per_engine = weight_bytes + preset.kv_cache_bytes + preset.engine_overhead_bytes
    return max(1, min(preset.max_engines_per_gpu, int(0.9 * gpu_memory_bytes // per_engine)))


def local_ray_cpus(preset: Preset, concurrency: int, override: int | None = None, gpus: int = 1) -> int:
    if override:
        return override
    return max(os.cpu_count() or 1, math.ceil(pipeline_cpus(preset, concurrency, gpus)) + 1)
