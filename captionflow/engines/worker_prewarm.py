"""A run on a Ray cluster starts its first tasks in worker processes that have imported what those tasks need.

Every run is a new Ray job, and a job's tasks and actors run in worker processes of its own. On a warm engine
service's cluster the first block of a warm run went through new processes one after another (reading the shards,
building the requests), each importing pyarrow, Ray Data and captionflow's row code before doing any work: 4.7 s
from the dataset's start to its first request on the H100 host, where the 5,000 captions then took ~20 s.
``start`` has idle workers of the run's job import them while its first stages (ingest, the cached preprocess) go
on; Ray hands the job's next tasks to idle workers first. Not its actors: Ray 2.60 starts a process of its own for
each actor, however idle the job's workers (so a warm run has none: ``service/feed.py``). Nothing waits for them: a task
that comes first starts a worker of its own, as without this.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# what the inference pipeline's read and request-building tasks import
MODULES = (
    "numpy",
    "pyarrow.parquet",
    "PIL.Image",
    "ray.data",
    "captionflow.workers.llm_rows",
    "captionflow.workers.images",
)


def import_modules(names: tuple[str, ...]) -> int:
    """Import ``names`` in this worker (a module that fails is left to the task that needs it); its pid."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            pass
    return os.getpid()


def start(workers: int) -> list[Any]:
    """Have ``workers`` worker processes of the connected job import ``MODULES``; their object refs (each a worker's
    pid), not waited for. The tasks declare no CPU: they take nothing the pipeline's own tasks declare."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(import_modules)
    return [task.remote(MODULES) for _ in range(max(0, workers))]
