"""Building a processor imports no vLLM in the driver, while the engine's own processes still know vLLM's
fatal errors (captionflow/compat/driver_imports.py). In a child process: the guard changes what a process has
imported, and this test process imports vLLM elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
import ray
from captionflow.compat.driver_imports import without_vllm

with without_vllm():
    from ray.llm._internal.batch.stages import vllm_engine_stage  # what build_processor imports
    from ray.llm._internal.common import errors
during = {"vllm_imported": "vllm" in sys.modules, "fatal_here": [c.__name__ for c in errors.VLLM_FATAL_ERRORS]}

ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")

@ray.remote(num_cpus=0)
def in_a_worker():  # the engine stage's module imported afresh, as in an engine actor
    from ray.llm._internal.common import errors
    return [c.__name__ for c in errors.VLLM_FATAL_ERRORS]

out = {**during, "fatal_in_worker": ray.get(in_a_worker.remote())}
import vllm.v1.engine.exceptions  # the guard is gone: this process may import vLLM again
out["vllm_after"] = "vllm" in sys.modules
ray.shutdown()
print("RESULT " + json.dumps(out))
"""


def test_the_driver_builds_without_vllm_and_the_workers_still_know_its_fatal_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["vllm_imported"] is False and out["fatal_here"] == []
    assert out["fatal_in_worker"] == ["EngineDeadError"]
    assert out["vllm_after"] is True


PREWARM = r"""
import importlib.util, json, sys, threading
from captionflow.compat import driver_imports

driver_imports.prewarm(serve=True)
found = []  # meanwhile, this thread asks where vLLM is installed, as a preflight does
while any(t.name == driver_imports.PREWARM_THREAD for t in threading.enumerate()):
    found.append(importlib.util.find_spec("vllm") is not None)
driver_imports.prewarmed()
print("RESULT " + json.dumps({
    "asked": len(found), "found": all(found),
    "imported": [m for m in ("ray.data", "ray.data.llm", "ray.serve", "vllm") if m in sys.modules],
}))
"""


def test_the_prewarm_imports_the_pipelines_modules_in_the_background_without_vllm_and_blocks_no_other_thread(
    tmp_path,
):
    proc = subprocess.run([sys.executable, "-c", PREWARM], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["imported"] == ["ray.data", "ray.data.llm", "ray.serve"]  # not vLLM
    assert out["asked"] > 0 and out["found"] is True
