"""CUDA MPS for several vLLM engines on one GPU (``cuda_mps`` parameter; docs/sizing.md).

Works around: processes sharing a GPU are time-sliced. Can go when the GPU preset runs one engine per
GPU (then nothing shares a GPU).

Without MPS, processes on one GPU are time-sliced: one engine's kernels run while the others
wait. Under the MPS server their kernels run side by side, which is what several engines per GPU
need. captionflow starts the MPS control daemon itself when it starts Ray locally on a GPU machine
and several engines share a GPU (``cuda_mps: auto``), gives the engine actors its pipe directory,
and stops it when the process exits. A daemon already answering at that pipe directory (or at
``CUDA_MPS_PIPE_DIRECTORY`` when it is set) is reused and left running. On a remote Ray cluster
MPS is the cluster's business: start it on the GPU nodes and set the variables in their environment.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
SEARCH_DIRS = ("/usr/local/nvidia/bin", "/usr/local/cuda/bin", "/usr/bin")
_state: dict[str, dict[str, str] | None] = {}


class MpsError(RuntimeError):
    pass


def control_binary() -> str | None:
    found = shutil.which(CONTROL)
    if found:
        return found
    for d in SEARCH_DIRS:
        p = Path(d, CONTROL)
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def _answers(binary: str, env: dict[str, str]) -> bool:
    """True when an MPS control daemon answers at env's pipe directory."""
    try:
        r = subprocess.run([binary], input="get_server_list\n", env=env, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def ensure_mps(mode: str) -> dict[str, str]:
    """Environment for the engine workers to use an MPS daemon (started here if needed); {} for none.

    ``mode``: "on" (fail with a clear error if MPS cannot be started), "auto" (warn and go on without),
    "off" (nothing). The result is cached for the process.
    """
    if mode == "off":
        return {}
    if "env" in _state:
        return dict(_state["env"] or {})
    binary = control_binary()
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or f"/tmp/captionflow-mps-{os.getuid()}/pipe"
    logs = os.environ.get("CUDA_MPS_LOG_DIRECTORY") or str(Path(pipe).parent / "log")
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": logs}
    try:
        if binary is None:
            raise MpsError(f"{CONTROL} not found on PATH or in {', '.join(SEARCH_DIRS)}")
        full_env = {**os.environ, **env}
        if not _answers(binary, full_env):
            Path(pipe).mkdir(parents=True, exist_ok=True)
            Path(logs).mkdir(parents=True, exist_ok=True)
            r = subprocess.run([binary, "-d"], env=full_env, capture_output=True, text=True, timeout=30)
            if r.returncode != 0 or not _answers(binary, full_env):
                raise MpsError(
                    f"{CONTROL} -d failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[:500]}; "
                    f"see {logs}/control.log"
                )
            atexit.register(_stop, binary, full_env)
            log.info("started the CUDA MPS control daemon (pipe directory %s)", pipe)
        else:
            log.info("using the CUDA MPS control daemon already running at %s", pipe)
    except MpsError as e:
        if mode == "on":
            raise MpsError(f"cuda_mps=on: {e}") from None
        log.warning("cuda_mps=auto: going on without CUDA MPS (engines on one GPU are time-sliced): %s", e)
        _state["env"] = None
        return {}
    _state["env"] = env
    return dict(env)


def _stop(binary: str, env: dict[str, str]) -> None:
    try:
        subprocess.run([binary], input="quit\n", env=env, capture_output=True, text=True, timeout=30)
    except Exception:
        pass
