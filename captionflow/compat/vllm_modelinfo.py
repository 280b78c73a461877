"""vLLM's inspection of a model class, cached before the engines ask for it.

When an engine builds its configuration, vLLM (0.26-0.32) inspects the architecture's model class (is it
multimodal, does it take pooling...) in a new interpreter that imports vLLM (``registry._run_in_subprocess``),
unless ``<VLLM_CACHE_ROOT>/modelinfos`` holds the answer. On the H100 host that interpreter took ~22 s of a cold
run's critical path: the front end waits for it before it starts its engine core. ``prefetch`` starts the same
inspection when preflight has found the model, in a background process that computes it in-process and lets vLLM
write its own cache file; by the time the engines ask (after the run's preprocessing and the engine actors' own
imports) the answer is cached. Nothing waits for it: if it has not finished, or fails, vLLM inspects the class
itself as before. Nothing happens when the cache already holds that architecture (every later run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path


def cache_root(env: Mapping[str, str]) -> Path:
    """vLLM's cache root under ``env`` (its own default: ``$XDG_CACHE_HOME/vllm``, else ``~/.cache/vllm``)."""
    if env.get("VLLM_CACHE_ROOT"):
        return Path(env["VLLM_CACHE_ROOT"]).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "vllm"


def cached(architecture: str, env: Mapping[str, str]) -> bool:
    """Whether vLLM's model-info cache under ``env`` has a file for ``architecture``'s class (any version of it:
    a stale one, vLLM finds so and inspects again)."""
    folder = cache_root(env) / "modelinfos"
    return folder.is_dir() and any(folder.glob(f"*-{architecture}.json"))


def prefetch(architecture: str, engine_env: Mapping[str, str]) -> subprocess.Popen | None:
    """Inspect ``architecture`` into vLLM's cache in a background process, with the engines' environment (their
    ``VLLM_CACHE_ROOT``); None when cached already or vLLM is not installed."""
    env = {**os.environ, **engine_env}
    if cached(architecture, env) or _vllm_missing():
        return None
    proc = subprocess.Popen(
        [sys.executable, "-m", "captionflow.compat.vllm_modelinfo", architecture],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    threading.Thread(target=proc.wait, name="captionflow-modelinfo-reaper", daemon=True).start()  # no zombie
    return proc


def _vllm_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is None


def inspect_into_cache(architecture: str) -> bool:
    """In this process: vLLM's own inspection of ``architecture`` (its cache read and written as vLLM does),
    run here instead of in another new interpreter. False: vLLM does not know the architecture."""
    from vllm.model_executor.models import registry

    model = registry.ModelRegistry.models.get(architecture)
    if model is None:
        return False
    registry._run_in_subprocess = lambda fn: fn()  # this process is the throwaway one vLLM would start
    model.inspect_model_cls()
    return True


if __name__ == "__main__":
    sys.exit(0 if inspect_into_cache(sys.argv[1]) else 1)
