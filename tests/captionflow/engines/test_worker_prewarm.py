"""Idle workers of a run's Ray job import what its first tasks need, and the job's next task runs in one of them; an
actor does not (Ray starts a process for it: why a warm run has no actor of its own, ``service/feed.py``)."""

from __future__ import annotations

import textwrap

from tests.support.fresh_python import run_script

# A fresh process with a Ray of its own (a job's workers are its own): the prewarm's workers, then a plain task.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import ray
    from captionflow.engines import worker_prewarm

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    pids = set(ray.get(worker_prewarm.start(2), timeout=240))

    @ray.remote(num_cpus=0.5)
    def task():
        return os.getpid(), [m in sys.modules for m in worker_prewarm.MODULES]

    @ray.remote(num_cpus=0.5)
    class Actor:
        def pid(self):
            return os.getpid()

    time.sleep(0.5)
    actor_pid = ray.get(Actor.remote().pid.remote(), timeout=120)
    pid, imported = ray.get(task.remote(), timeout=120)
    result = {"prewarmed": len(pids), "reused": pid in pids, "imported": imported, "actor_reused": actor_pid in pids}
    print("RESULT " + json.dumps(result))
    ray.shutdown()
    """
)


def test_the_jobs_next_task_runs_in_a_worker_that_imported_the_pipelines_modules(tmp_path):
    _, r = run_script(SCRIPT, tmp_path)
    assert r["prewarmed"] >= 1 and r["reused"]
    assert all(r["imported"])  # Ray Data, captionflow's row code: before the task ran
    assert not r["actor_reused"]  # if Ray ever gives actors idle workers, an actor could be prewarmed
