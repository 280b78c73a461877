"""Checks that fail cheaply, before Ray, a decoder or an engine starts: each failure one line naming what and where.

In order: the output root takes a write (probe file written and removed), the dataset exists, the
checkpoint is complete (``model_source``: config, weights, safetensors headers and sizes), the engine
arguments are ones the installed vLLM knows (read from its source, without importing it), the numeric
options fit the model (pixel budget against the image processor's smallest image, context length against
what one request needs), and the device and cluster can place the engines.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
import logging
import math
import shutil
import time
import uuid
from pathlib import Path

from captionflow.compat.driver_imports import prewarm
from captionflow.compat.vllm_modelinfo import prefetch as prefetch_model_info
from captionflow.config import RunConfig
from captionflow.data.storage import Store
from captionflow.engines.device import local_gpus
from captionflow.engines.engine import EngineSettings, engine_env, resolve_engine
from captionflow.engines.presets import PRESETS
from captionflow.engines.request_format import image_prompt
from captionflow.engines.session import cluster_address
from captionflow.errors import CaptionflowError, DatasetError
from captionflow.model_source import ResolvedModel, local_model_path, resolve_clip, resolve_model
from captionflow.results import PreflightResult

log = logging.getLogger("captionflow.preflight")


class OutputError(CaptionflowError, OSError):
    """The output root cannot be written."""


class OptionError(CaptionflowError, ValueError):
    """An option is out of range for the model or unknown to the installed engine."""


class PlacementError(CaptionflowError, RuntimeError):
    """The machine or cluster cannot place the engines the run asks for."""


def preflight(cfg: RunConfig, prewarm_imports: bool = True) -> PreflightResult:
    """``prewarm_imports``: on a Ray cluster (a warm engine service's included) and on a local GPU, the inference
    stage's imports start in the background meanwhile (``compat.driver_imports.prewarm``): its engines start only
    after them (on the 2-core CPU VM every core is busy with the run's first stages: no gain, so not there); on a
    cluster, idle workers of the run's job import what its pipeline's first tasks import (``worker_prewarm``), and a
    warm engine service that no other run holds is taken for this run and starts loading its checkpoint
    (``service.start_early``). On a local Ray, vLLM's inspection of the model class starts in a background process
    when it is not cached yet (``compat.vllm_modelinfo``)."""
    check_inputs(cfg)
    model = resolve_model(cfg.model, dummy_weights=cfg.dummy_weights())
    judge = None
    if cfg.judge or cfg.pairwise_against:
        same = cfg.judge_model in (None, cfg.model)
        judge = model if same else resolve_model(cfg.judge_model, dummy_weights=cfg.dummy_weights())
        if judge.adapter is not None:
            raise OptionError(
                f"judge_model: {judge.source} is a LoRA adapter, which captionflow does not judge with; set "
                "judge_model to a full checkpoint (the adapter's base, or a merged one)"
            )
    clip = resolve_clip(cfg.clip_model) if cfg.clip_model else None
    if cfg.coco_java and not shutil.which("java"):
        raise OptionError("coco_java needs Java on the PATH (PTB tokenizer and METEOR run on the JVM)")
    device, gpus, local = resolve_device(cfg)
    if device == "cpu" and (cfg.quantization or cfg.kv_cache_dtype != "auto"):
        raise OptionError(
            f"quantization {cfg.quantization} / kv_cache_dtype {cfg.kv_cache_dtype}: FP8 needs a GPU (this run's "
            "device is the CPU); leave them unset"
        )
    if prewarm_imports and (not local or device == "gpu"):
        prewarm(serve=cfg.warm_engines != "off")
    engine = resolve_engine(cfg, model, PRESETS[device], gpus, local)
    if prewarm_imports and not local:  # a new job on the cluster: idle workers of its own import ahead
        prewarm_workers(cfg, engine)
    check_ranges(cfg, model, engine)
    for path in {model.path, judge.path if judge else model.path}:
        image_prompt(path)  # the chat template rendered once for every request (or why it cannot be)
    judge_engine = resolve_engine(cfg, judge, PRESETS[device], gpus, local) if judge else None
    check_placement(cfg, engine, local)
    if local:  # vLLM's inspection of the model class, cached while the run's first stages run (its engines ask)
        for architecture in {m.architecture for m in (model, judge) if m}:
            prefetch_model_info(architecture, engine_env(cfg))
    elif prewarm_imports:  # every check passed: a warm engine service starts loading the checkpoint now
        from captionflow.service import hold as service

        service.start_early(cfg, model, engine)
    return PreflightResult(model=model, judge=judge, engine=engine, judge_engine=judge_engine, clip=clip)


def check_margin(cfg: RunConfig) -> None:
    """The sequential verdict's margin means something for every score it may compare ('auto': CIDEr-D, or
    CLIPScore where clip_model is set): at least 0 and below half the score's range."""
    from captionflow.evaluation.sequential import VERDICT_SCORES

    scores = {"auto": ["cider"] + (["clip"] if cfg.clip_model else [])}.get(cfg.verdict_score, [cfg.verdict_score])
    for score in scores:
        try:
            VERDICT_SCORES[score].check_margin(cfg.verdict_margin)
        except ValueError as e:
            raise OptionError(str(e)) from None


def check_inputs(cfg: RunConfig, models: list[str] | None = None) -> None:
    """What needs neither Ray, an engine, a download nor a Prefect server: the output root can be written, the
    dataset exists, each local model folder (``models``; default the run's model and judge) exists, the engine
    arguments are vLLM's, a CLIPScore verdict has its CLIP model, a judge or pairwise one its judge. The command line
    runs it before it starts a flow, so that a user error is one line and starts nothing; preflight runs it
    first."""
    if cfg.verdict == "sequential" and cfg.verdict_score == "clip" and not cfg.clip_model:
        raise OptionError("verdict_score clip needs clip_model (a local CLIP checkpoint folder, or builtin)")
    if cfg.verdict == "sequential" and cfg.verdict_score == "pairwise" and not cfg.pairwise_against:
        raise OptionError("verdict_score pairwise needs pairwise_against (the baseline the judge compares with)")
    if cfg.verdict == "sequential" and cfg.verdict_score == "judge" and not cfg.judge:
        raise OptionError("verdict_score judge needs judge (the judge's 1-5 score of every caption)")
    if cfg.verdict == "sequential":
        check_margin(cfg)
    check_output(cfg.output)
    check_dataset(cfg.dataset)
    if models is None:
        models = [cfg.model] + ([cfg.judge_model] if cfg.judge_model and (cfg.judge or cfg.pairwise_against) else [])
    for m in models:
        local_model_path(m)
    check_engine_kwargs(cfg.engine_kwargs)


def prewarm_workers(cfg: RunConfig, engine: EngineSettings) -> None:
    """Workers for the inference pipeline's first tasks (its reads, its requests), at most half the cluster's
    CPUs."""
    from captionflow.engines.session import ray_session
    from captionflow.engines.worker_prewarm import start

    cpus = ray_session(cfg).resources().get("CPU", 1)
    start(min(engine.map_concurrency + 4, int(cpus // 2)))


# ---------------------------------------------------------------- storage
def check_output(output: str) -> None:
    """A probe file written and removed under the output root: a missing bucket, wrong credentials, a
    read-only or full disk are found here, not after the images were decoded."""
    try:
        store = Store(output)
        # the folders the probe makes: a command that writes nothing there (captionflow serve) leaves none behind
        root = Path(store.path())
        made = [p for p in (root, *root.parents) if not p.exists()] if store.is_local else []
        name = f".captionflow-probe-{uuid.uuid4().hex}"
        store.write_bytes(b"probe", name)
        store.remove(name)
        for folder in made:  # the deepest first
            folder.rmdir()
    except Exception as e:
        raise OutputError(f"output {output!r} cannot be written: {type(e).__name__}: {str(e)[:300]}") from None


def check_dataset(dataset: str) -> None:
    if dataset == "demo":
        return
    from captionflow.data.storage import open_fs

    try:
        fs, root = open_fs(dataset)
        exists = fs.exists(root)
    except Exception as e:
        raise DatasetError(f"dataset {dataset!r}: cannot access it ({type(e).__name__}: {str(e)[:300]})") from None
    if not exists:
        raise DatasetError(f"dataset {dataset!r} does not exist")


# ---------------------------------------------------------------- engine arguments and ranges
@functools.lru_cache(maxsize=1)
def vllm_engine_args() -> frozenset[str]:
    """The engine arguments the installed vLLM accepts: the fields of ``EngineArgs``, read from its source
    (importing vLLM takes 10-30 s; parsing one file, milliseconds). Empty when vLLM is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    path = Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name in ("EngineArgs", "AsyncEngineArgs"):
            names |= {i.target.id for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
    return frozenset(names)


# Engine arguments captionflow sets itself from a run parameter: given in engine_kwargs they would be recorded as the
# run's (run.json) without acting as the user expects (images reach the engine already fitted to max_pixels' grid).
OWN_ENGINE_ARGS = {"mm_processor_kwargs": "max_pixels (the image budget; images are fitted to it before the engine)"}


def check_engine_kwargs(engine_kwargs: dict) -> None:
    for key, instead in OWN_ENGINE_ARGS.items():
        if key in engine_kwargs:
            raise OptionError(f"engine_kwargs: {key!r} is set by captionflow: use {instead}")
    known = vllm_engine_args()
    if not known:
        return
    for key in engine_kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise OptionError(f"engine_kwargs: {key!r} is not an argument of the installed vLLM{hint}")


def _image_processor(model: ResolvedModel) -> dict:
    path = Path(model.path) / "preprocessor_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _count_tokens(model: ResolvedModel, text: str) -> int:
    path = Path(model.path) / "tokenizer.json"
    if path.is_file():
        try:
            from tokenizers import Tokenizer

            return len(Tokenizer.from_file(str(path)).encode(text).ids)
        except Exception:
            pass
    return math.ceil(len(text.encode("utf-8")) / 4)  # without a tokenizer: a low estimate, so no false alarm


def check_ranges(cfg: RunConfig, model: ResolvedModel, engine: EngineSettings) -> None:
    proc = _image_processor(model)
    factor = int(proc.get("patch_size", 14)) * int(proc.get("merge_size", 2))
    smallest = int(proc.get("min_pixels") or (proc.get("size") or {}).get("shortest_edge") or factor * factor)
    if engine.max_pixels < max(smallest, factor * factor):
        raise OptionError(
            f"max_pixels {engine.max_pixels} is below the smallest image the model's processor makes "
            f"({max(smallest, factor * factor)} pixels: min_pixels in {model.path}/preprocessor_config.json)"
        )
    max_len = int(engine.engine_kwargs.get("max_model_len") or 0)
    cfg_file = Path(model.path) / "config.json"
    conf = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    positions = (conf.get("text_config") or {}).get("max_position_embeddings") or conf.get("max_position_embeddings")
    if max_len and positions and max_len > positions:
        raise OptionError(f"max_model_len {max_len} is more than the model's max_position_embeddings {positions}")
    image_tokens = engine.max_pixels // (factor * factor)
    text = cfg.system_prompt + "\n" + cfg.prompt
    # a token stands for at least one byte of text: the prompt's bytes bound its tokens, and the tokenizer (for
    # Qwen2-VL a 10 MB file, slow to load on every run's critical path) is read only when that bound does not fit
    prompt_tokens = len(text.encode("utf-8")) + 16  # + the chat template's
    if max_len and image_tokens + prompt_tokens + cfg.max_tokens > max_len:
        prompt_tokens = _count_tokens(model, text) + 16
    need = image_tokens + prompt_tokens + cfg.max_tokens
    if max_len and need > max_len:
        raise OptionError(
            f"max_model_len {max_len} is too small: one request needs about {need} tokens (image up to "
            f"{image_tokens} at max_pixels {engine.max_pixels}, prompt {prompt_tokens}, max_tokens {cfg.max_tokens})"
        )


# ---------------------------------------------------------------- device and placement
def resolve_device(cfg: RunConfig) -> tuple[str, int, bool]:
    """(device preset name, GPUs, local Ray) without starting a local Ray: this machine's GPUs through
    NVML; a cluster's from Ray (connecting to it)."""
    if cluster_address(cfg):
        from captionflow.engines.session import ray_session

        gpus = ray_session(cfg).gpus()
        local = False
    else:
        gpus = local_gpus()
        local = True
    device = cfg.device if cfg.device != "auto" else ("gpu" if gpus else "cpu")
    if device == "gpu" and local and not gpus:
        raise PlacementError(
            "device 'gpu': this machine has no GPU that NVML or torch can see "
            "(use device 'cpu' or 'auto', or ray_address for a GPU cluster)"
        )
    return device, gpus, local


def engine_demand(engine: EngineSettings) -> dict[str, float]:
    preset = engine.preset
    per_actor_gpu = engine.gpu_share if preset.engine_gpus else 0.0
    gpus = engine.concurrency * per_actor_gpu * engine.tensor_parallel_size if preset.engine_gpus else 0.0
    return {"CPU": engine.concurrency * engine.actor_cpus, "GPU": gpus}


def check_placement(cfg: RunConfig, engine: EngineSettings, local: bool) -> None:
    """The engines' GPUs and CPUs against what the cluster offers (a local Ray is sized for them)."""
    if local:
        return
    import ray

    demand = engine_demand(engine)
    deadline = time.monotonic() + cfg.placement_wait_s
    said = 0.0
    while True:
        have = ray.cluster_resources()
        missing = {k: v - have.get(k, 0.0) for k, v in demand.items() if v > have.get(k, 0.0) + 1e-9}
        if not missing:
            return
        what = ", ".join(f"{k} {demand[k]:g} (the cluster has {have.get(k, 0.0):g})" for k in missing)
        if time.monotonic() >= deadline:
            raise PlacementError(
                f"the Ray cluster at {cluster_address(cfg)} cannot place the engines: they need {what}; "
                f"waited {cfg.placement_wait_s} s for it to scale up"
            )
        if time.monotonic() - said >= 60:
            log.warning("waiting for the Ray cluster to offer the engines' resources: %s", what)
            said = time.monotonic()
        time.sleep(5)
