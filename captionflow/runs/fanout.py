"""Several checkpoints evaluated at once on one Ray cluster: how many at a time, and each one's share.

Each evaluation is a whole run (its own Ray Data LLM pipeline and engines) inside one Ray task of prefect-ray's
``RayTaskRunner``. Their engines must not compete for the same GPUs - K pipelines that each asked for every
GPU would each hold some and wait for the rest - so the cluster is split: ``slots`` evaluations at a time
(at most one per GPU, or per tensor-parallel group), each given ``concurrency`` engine replicas (its share of
the GPUs at the layout one run would use); more checkpoints than slots wait for a slot. On CPU every
evaluation runs its one engine, ``parallel`` at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from captionflow.config import RunConfig

EVALUATION_TASK_CPUS = 0.01  # the Ray task an evaluation runs in: it waits on its pipeline, the stages work


@dataclass(frozen=True)
class FanOut:
    slots: int  # evaluations at a time
    concurrency: Optional[int]  # engine replicas of each evaluation (None: the run's own default)
    gpus: int  # of the cluster

    def describe(self) -> str:
        share = f"{self.gpus // self.slots} GPU(s) each" if self.gpus else "CPU engines"
        return f"{self.slots} checkpoint(s) at a time, {share}"


def fan_out(cfg: RunConfig, checkpoints: int, parallel: int, gpus: int, engines_per_gpu: int) -> FanOut:
    """``gpus`` of the cluster, ``engines_per_gpu`` of the layout a run on it uses (engine replicas per GPU,
    or front ends per engine core)."""
    slots = max(1, min(parallel, checkpoints))
    if not gpus or cfg.device == "cpu":
        return FanOut(slots, cfg.concurrency, 0)
    groups = max(1, gpus // cfg.tensor_parallel_size)
    slots = min(slots, groups)
    concurrency = cfg.concurrency or (groups // slots) * engines_per_gpu
    return FanOut(slots, concurrency, gpus)


def worker_env() -> dict[str, str]:
    """What an evaluation's Ray worker needs to reach the Prefect API (prefect-ray's open issue: remote Ray
    workers do not inherit ``PREFECT_API_URL``). An API key is not passed: it would show in Ray's dashboard;
    a cluster that needs one has it set on its nodes."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value() or os.environ.get("PREFECT_API_URL")
    return {"PREFECT_API_URL": url} if url else {}
