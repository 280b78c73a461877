"""Stage 3, inference: captions through Ray Data LLM (``ray.data.llm``) and the vLLM engine.

Pipeline per pass (one Ray Data job, streaming):
    read_parquet(dataset shards) -> keep pending ids -> build_processor(...)
    [preprocess: chat messages with a data: URL -> PrepareMultimodalStage -> ChatTemplateStage
     (-> TokenizeStage) -> vLLMEngineStage (-> DetokenizeStage) -> postprocess] -> fixed schema

Resume (a small ledger, see README "Resume"): the driver pulls finished rows as they stream out
and commits them in caption shards (``captions/part-*.parquet``, each written atomically). A
rerun reads the ``image_id`` column of the committed shards and only sends the other rows to
the engine, so a killed run loses at most the uncommitted rows and never duplicates one.
Ray Data's own job checkpointing (``CheckpointConfig``) was not used: it tracks rows written by
a ``write_*`` sink, while here rows must also be routed by outcome (captions vs. failures) and
retried in later passes; the ledger keeps that in one place and works on any fsspec store.

Rows whose request fails (``should_continue_on_error``) are written to ``failures/`` with their
error and retried in the next pass, up to ``row_retries`` extra passes; they are never counted
as captioned.
"""

from __future__ import annotations

import functools
import os
import time
import uuid
from typing import Any

import pyarrow as pa
from prefect import task

from captionflow.retry import retry_transient
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from captionflow import vllm_warmup
from captionflow.config import RunConfig
from captionflow.cuda_mps import ensure_mps
from captionflow.fingerprint import digest
from captionflow.llm_rows import CAPTION_SCHEMA, caption_fixed_schema, caption_request, keep_pending, to_caption
from captionflow.model_source import ResolvedModel
from captionflow.presets import (PRESETS, Preset, engines_per_gpu, local_gpu_memory_bytes, local_ray_cpus,
                                 model_weight_bytes)
from captionflow.storage import Store
from tasks.preprocess import shard_paths

# Testing hook: a comma-separated list of image ids whose *first* attempt is sent to the engine
# with invalid sampling parameters (temperature -1), so the real engine rejects that row.
INJECT_ENV = "CAPTIONFLOW_INJECT_ROW_FAILURES"

WORKER_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# Only for a Ray this process starts (a cluster's settings are its own). It has no dashboard, so no
# one reads its Prometheus metrics; collecting them cost every Ray process CPU: off, the preprocess
# stage ran ~7% faster on 2 cores (6 of 6 interleaved pairs, README "Benchmarks"). Set
# RAY_enable_metrics_collection=1 to keep them.
LOCAL_RAY_ENV = {"RAY_enable_metrics_collection": "0"}


class RowsFailed(RuntimeError):
    """Some rows still failed after every retry pass. The flow goes on; ``summary`` counts them."""

    def __init__(self, summary: dict):
        super().__init__(f"{summary['failed']} of {summary['accepted']} rows failed after "
                         f"{len(summary['passes'])} passes (see {summary['run_dir']}/failures)")
        self.summary = summary


def run_paths(cfg: RunConfig, dataset_fp: str, model_fp: str) -> tuple[str, ...]:
    return ("runs", dataset_fp, model_fp, digest(cfg.generation_params()))


_LOCAL_RAY: dict[str, bool] = {}  # "started": this process started the Ray it uses


def init_ray(cfg: RunConfig) -> None:
    """Connect to ``ray_address`` / RAY_ADDRESS, else start a local Ray sized for the pipeline."""
    import ray

    if ray.is_initialized():
        return
    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    # The vLLM processor pre-build hook (import-triggered, otherwise a no-op) is set for the whole job:
    # Ray does not run a setup hook given to a single actor's runtime_env.
    hook = {"worker_process_setup_hook": vllm_warmup.SETUP_HOOK}
    if address:
        ray.init(address=address, runtime_env={"env_vars": WORKER_ENV, **hook}, log_to_driver=False)
        return
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    hint = PRESETS[cfg.device] if cfg.device != "auto" else PRESETS["gpu" if _has_cuda() else "cpu"]
    engines = cfg.concurrency or hint.concurrency * (cfg.engines_per_gpu or hint.max_engines_per_gpu)
    # A local Ray's workers inherit this process's environment (WORKER_ENV is set above). A job
    # runtime_env, even env_vars alone, makes Ray start new workers instead of the ones it prestarted
    # (measured: 2 fresh worker processes, ~2 s of CPU each, before the first task on 2 cores), so the
    # job gets one only where the vLLM hook is needed: the GPU preset (vLLM 0.26 on the GPU host; the
    # CPU build, vLLM 0.29, pre-builds its processor itself).
    ray.init(num_cpus=local_ray_cpus(hint, engines, cfg.ray_num_cpus), include_dashboard=False,
             runtime_env=hook if hint.engine_gpus else None, log_to_driver=False)
    _LOCAL_RAY["started"] = True


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cpu_task_share(cfg: RunConfig) -> float:
    """Logical CPUs that one CPU-bound task or actor (the preprocess pool's) declares, so that at most
    one runs per physical core: a local Ray declares more logical CPUs than cores
    (``presets.local_ray_cpus``); on a cluster one."""
    import ray

    if cfg.ray_address or os.environ.get("RAY_ADDRESS"):
        return 1.0
    physical = os.cpu_count() or 1
    return max(1.0, ray.cluster_resources().get("CPU", physical) / physical)


def choose_preset(cfg: RunConfig) -> Preset:
    if cfg.device != "auto":
        return PRESETS[cfg.device]
    import ray

    return PRESETS["gpu"] if ray.cluster_resources().get("GPU", 0) > 0 else PRESETS["cpu"]


def engine_layout(cfg: RunConfig, model: ResolvedModel, preset: Preset) -> dict[str, Any]:
    """Engine replicas, their share of a GPU and the engine kwargs that follow (see presets.py)."""
    import ray

    if preset.engine_gpus == 0:
        return {"concurrency": cfg.concurrency or preset.concurrency, "engines_per_gpu": 1, "gpu_share": 0.0,
                "engine_kwargs": {}, "env": {}}
    gpu_mem = int(cfg.gpu_memory_gib * 2**30) if cfg.gpu_memory_gib else (local_gpu_memory_bytes() or 80 * 2**30)
    k = engines_per_gpu(preset, model_weight_bytes(model.path), gpu_mem, cfg.tensor_parallel_size, cfg.engines_per_gpu)
    gpus = int(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0
    concurrency = cfg.concurrency or max(1, gpus // cfg.tensor_parallel_size) * k
    kwargs: dict[str, Any] = {}
    env: dict[str, str] = {}
    if k > 1:
        # Each engine checks at start that its share of the GPU is free, and gets a fixed KV cache
        # instead of profiling "the rest of the GPU" (which the other engines are filling meanwhile).
        kwargs = {"gpu_memory_utilization": round(0.9 / k, 3), "kv_cache_memory_bytes": preset.kv_cache_bytes}
        if _LOCAL_RAY.get("started"):  # the GPUs are this machine's: run the engines under CUDA MPS
            env = ensure_mps(cfg.cuda_mps)
    return {"concurrency": concurrency, "engines_per_gpu": k, "gpu_share": 1.0 / k, "engine_kwargs": kwargs,
            "env": env}


def map_task_kwargs(preset: Preset) -> dict[str, Any]:
    """Resources and concurrency of every plain map/read task of the LLM passes (see presets.py)."""
    import ray.data

    return {"num_cpus": preset.map_cpus, "compute": ray.data.TaskPoolStrategy(size=preset.map_concurrency)}


def build_vlm_processor(cfg: RunConfig, model: ResolvedModel, preset: Preset, preprocess, postprocess):
    """A Ray Data LLM processor for one VLM, sized by ``preset``; the row functions decide the task.

    Shared by captioning and the LLM judge: images go in as ``data:`` URLs through
    ``prepare_multimodal_stage``, every CPU stage declares its share (see presets.py), and rows
    that fail individually come out with ``__inference_error__`` instead of failing the batch.
    """
    from ray.data.llm import build_processor, vLLMEngineProcessorConfig

    layout = engine_layout(cfg, model, preset)
    engine_kwargs: dict[str, Any] = {
        "max_num_seqs": cfg.max_num_seqs or preset.max_num_seqs,
        "max_model_len": cfg.max_model_len or preset.max_model_len,
        "limit_mm_per_prompt": {"image": 1, "video": 0},
        # the image budget, set once for the engine (also what its start-up memory profile assumes per
        # image) and not repeated per request
        "mm_processor_kwargs": {"max_pixels": cfg.max_pixels or preset.max_pixels},
        "tensor_parallel_size": cfg.tensor_parallel_size,
        **preset.engine_kwargs,
        **layout["engine_kwargs"],
        **cfg.engine_kwargs,
    }
    cpu_stage = {"enabled": True, "num_cpus": preset.cpu_stage_cpus, "concurrency": preset.cpu_stage_concurrency}
    extra: dict[str, Any] = {}
    concurrency: int | tuple[int, int] = layout["concurrency"]
    if preset.engine_gpus == 0:
        # Without this, the engine actor asks Ray for one GPU per replica and never starts on CPU.
        extra["placement_group_config"] = {"bundles": [{"CPU": preset.engine_cpus}] * cfg.tensor_parallel_size}
    else:
        if layout["engines_per_gpu"] > 1:
            extra["placement_group_config"] = {"bundles": [{"CPU": preset.engine_cpus, "GPU": layout["gpu_share"]}]}
        # Start every replica at once: an engine takes a minute to start, too slow to autoscale into.
        concurrency = (concurrency, concurrency)
    max_batches = cfg.max_concurrent_batches or preset.max_concurrent_batches
    if preset.max_tasks_in_flight_per_actor:
        extra["max_tasks_in_flight_per_actor"] = max(preset.max_tasks_in_flight_per_actor, max_batches)
    config = vLLMEngineProcessorConfig(
        model_source=model.path,
        engine_kwargs=engine_kwargs,
        batch_size=cfg.batch_size or preset.batch_size,
        concurrency=concurrency,
        max_concurrent_batches=max_batches,
        accelerator_type=cfg.accelerator_type,
        should_continue_on_error=True,
        log_engine_metrics=False,
        runtime_env={"env_vars": {**WORKER_ENV, **layout["env"]}},
        prepare_multimodal_stage={**cpu_stage, "model_config_kwargs": {"limit_mm_per_prompt": {"image": 1, "video": 0}}},
        chat_template_stage=cpu_stage,
        tokenize_stage={**cpu_stage, "enabled": preset.tokenize_in_ray},
        detokenize_stage={**cpu_stage, "enabled": preset.tokenize_in_ray},
        **extra,
    )
    map_kwargs = map_task_kwargs(preset)
    return build_processor(config, preprocess=preprocess, postprocess=postprocess,
                           preprocess_map_kwargs=map_kwargs, postprocess_map_kwargs=map_kwargs)


def build_caption_processor(cfg: RunConfig, model: ResolvedModel, preset: Preset, attempt: int,
                            fail_ids: frozenset = frozenset()):
    sampling = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
                "ignore_eos": cfg.ignore_eos}
    return build_vlm_processor(
        cfg, model, preset,
        preprocess=functools.partial(caption_request, system_prompt=cfg.system_prompt, prompt=cfg.prompt,
                                     sampling=sampling, fail_ids=fail_ids),
        postprocess=functools.partial(to_caption, max_tokens=cfg.max_tokens, model_fp=model.fingerprint,
                                      attempt=attempt),
    )


def read_pending(store: Store, shard_paths: list[str], columns: list[str], pending: list[str], preset: Preset,
                 rows_per_block: int):
    """A Ray dataset of the dataset shards' rows whose image_id is in ``pending``.

    Re-blocked to ``rows_per_block`` rows (a streaming split, no shuffle): a shard is one Parquet
    block of up to ``shard_rows`` rows, and without the split the engine would only see - and
    the driver only commit - whole shards, so nothing would stream and a kill would lose a shard.
    """
    import ray
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    # pyarrow's own S3 filesystem ignores AWS_ENDPOINT_URL: hand Ray the fsspec one explicitly.
    ds = ray.data.read_parquet(shard_paths, filesystem=PyFileSystem(FSSpecHandler(store.fs)), columns=columns,
                               num_cpus=preset.map_cpus, concurrency=preset.map_concurrency)
    ds = ds.map_batches(functools.partial(keep_pending, pending=pa.array(pending, pa.string())),
                        batch_format="pyarrow", **map_task_kwargs(preset))
    return ds.repartition(target_num_rows_per_block=rows_per_block)


def ids_in(store: Store, files: list[str]) -> set[str]:
    t = store.read_tables(files, columns=["image_id"])
    return set(t.column("image_id").to_pylist()) if t is not None else set()


def run_inference(cfg: RunConfig, manifest: dict, model: ResolvedModel) -> dict:
    """Caption every accepted row not yet captioned; returns counts and timings."""
    t_start = time.perf_counter()
    store = Store(cfg.output)
    ds_fp = manifest["dataset_fingerprint"]
    run = run_paths(cfg, ds_fp, model.fingerprint)
    shards = shard_paths(store, manifest)
    all_ids = ids_in(store, shards)
    store.write_json({"model": model.source, "model_path": model.path, "model_fingerprint": model.fingerprint,
                      "architecture": model.architecture, "dataset_fingerprint": ds_fp,
                      "generation": cfg.generation_params()}, *run, "run.json")
    done = ids_in(store, store.ls(*run, "captions", suffix=".parquet"))
    resumed_from = len(done & all_ids)
    timings: dict[str, float] = {}
    passes = []
    inject = frozenset(x for x in os.environ.get(INJECT_ENV, "").split(",") if x)

    pending = sorted(all_ids - done)
    if pending:
        t0 = time.perf_counter()
        init_ray(cfg)
        timings["ray_init_s"] = round(time.perf_counter() - t0, 2)
        preset = choose_preset(cfg)
        progress_id = _progress_artifact(len(all_ids), len(done & all_ids))
        for attempt in range(cfg.row_retries + 1):
            pending = sorted(all_ids - done)
            if not pending:
                break
            t_pass = time.perf_counter()
            ds = read_pending(store, shards, ["image_id", "image"], pending, preset,
                              cfg.batch_size or preset.batch_size)
            processor = build_caption_processor(cfg, model, preset, attempt,
                                                fail_ids=inject if attempt == 0 else frozenset())
            out = processor(ds).map(functools.partial(caption_fixed_schema, model_fp=model.fingerprint, attempt=attempt),
                                    **map_task_kwargs(preset))
            n_ok, n_failed, first_row_s = stream_and_commit(
                out, store, run, ("captions", "failures"), CAPTION_SCHEMA, done, cfg.commit_rows,
                progress=lambda n_pass: _progress_update(progress_id, len(done & all_ids), len(all_ids), t_pass, n_pass))
            passes.append({"attempt": attempt, "sent": len(pending), "captioned": n_ok, "failed": n_failed,
                           "seconds": round(time.perf_counter() - t_pass, 2), "first_row_s": first_row_s})
        timings["inference_s"] = round(time.perf_counter() - t_start, 2)
    captioned = len(done & all_ids)
    summary = {
        "run_dir": store.url(*run), "run_parts": list(run), "accepted": len(all_ids), "captioned": captioned,
        "failed": len(all_ids) - captioned, "resumed_from": resumed_from, "passes": passes, "timings_s": timings,
    }
    if summary["failed"]:
        raise RowsFailed(summary)  # a failed task state is never cached; the next run retries those rows
    return summary


def stream_and_commit(out, store: Store, base: tuple[str, ...], kinds: tuple[str, str], schema: pa.Schema,
                      done: set, commit_rows: int, progress=None) -> tuple[int, int, float | None]:
    """The ledger: pull rows from a Ray dataset as they finish and commit them in shards.

    Rows without ``error`` go to ``base/kinds[0]`` in shards of ``commit_rows`` (their ids are
    added to ``done``), failed rows to ``base/kinds[1]``. Returns (ok, failed, seconds to first row).
    """
    t0 = time.perf_counter()
    ok_rows: list[dict] = []
    failed_rows: list[dict] = []
    first_row_s = None
    n_ok = 0
    for row in out.iter_rows():
        if first_row_s is None:
            first_row_s = round(time.perf_counter() - t0, 2)
        (failed_rows if row["error"] else ok_rows).append(row)
        if len(ok_rows) >= commit_rows:
            n_ok += _commit(store, base, kinds[0], ok_rows, done, schema)
            if progress:
                progress(n_ok)
    n_ok += _commit(store, base, kinds[0], ok_rows, done, schema)
    n_failed = _commit(store, base, kinds[1], failed_rows, None, schema)
    if progress:
        progress(n_ok)
    return n_ok, n_failed, first_row_s


def _commit(store: Store, base: tuple[str, ...], kind: str, rows: list[dict], done: set | None,
            schema: pa.Schema) -> int:
    """Write ``rows`` as one atomically committed shard; record their ids in ``done``."""
    if not rows:
        return 0
    n = len(rows)
    store.write_table(pa.Table.from_pylist(rows, schema=schema), *base, kind,
                      f"part-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.parquet")
    if done is not None:
        done.update(r["image_id"] for r in rows)
    rows.clear()
    return n


def _progress_artifact(total: int, done: int):
    from prefect.context import get_run_context

    try:
        get_run_context()
    except Exception:  # called as a plain function, outside a flow/task run: nothing to report to
        return None
    try:
        return create_progress_artifact(progress=100.0 * done / max(total, 1), key="inference-progress",
                                        description=f"captioned {done}/{total}")
    except Exception:  # outside a flow run there is nothing to report to
        return None


def _progress_update(artifact_id, done: int, total: int, t_pass: float, n_pass: int) -> None:
    if artifact_id is None:
        return
    rate = n_pass / max(time.perf_counter() - t_pass, 1e-9)
    eta = (total - done) / rate if rate > 0 else float("inf")
    try:
        update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / max(total, 1),
                                 description=f"captioned {done}/{total}, {rate:.2f} rows/s, ETA {eta:.0f} s")
    except Exception:
        pass


inference_task = task(name="inference", retries=1, retry_delay_seconds=[10],
                      retry_condition_fn=retry_transient)(run_inference)
