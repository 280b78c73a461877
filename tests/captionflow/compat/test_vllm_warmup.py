"""The engine-process hook (captionflow/compat/vllm_warmup.py) with real vLLM (CPU build) and the built-in model.

In a fresh interpreter: the hook is installed before vLLM is imported (as Ray's worker setup hook
is), vLLM's InputProcessor is built for the built-in model, and the HF processor the first request
asks for must then already be in vLLM's processor cache - filled by the hook's thread alone, since
the cache is emptied just before.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent("""
    import json, threading
    from captionflow.compat import vllm_warmup
    vllm_warmup.install()                       # before any vLLM import, as in a Ray worker
    from captionflow.builtin.model import ensure_builtin_model
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers import renderer_from_config
    import vllm.transformers_utils.processor as P
    import vllm.v1.engine.async_llm as async_llm
    import vllm.v1.engine.input_processor as input_processor

    cfg = EngineArgs(model=str(ensure_builtin_model()), max_model_len=2048,
                     limit_mm_per_prompt={"image": 1, "video": 0},
                     mm_processor_kwargs={"max_pixels": 448 * 448}).create_engine_config()
    renderer = renderer_from_config(cfg)
    P.cached_get_processor.cache_clear()        # only the hook's thread may fill it from here on
    input_processor.InputProcessor(cfg, renderer)
    threads = [t for t in threading.enumerate() if t.name == vllm_warmup.THREAD_NAME]
    for t in threads:
        t.join(120)
    after_warmup = P.cached_get_processor.cache_info()
    renderer.get_mm_processor().info.get_hf_processor()   # what a request without kwargs asks for
    after_request = P.cached_get_processor.cache_info()
    print("RESULT " + json.dumps({
        "threads": len(threads),
        "async_llm_patched": bool(getattr(async_llm.AsyncLLM, "_captionflow_patched", False)),
        "input_processor_patched": bool(getattr(input_processor.InputProcessor, "_captionflow_patched", False)),
        "warmup_misses": after_warmup.misses,
        "request_misses": after_request.misses - after_warmup.misses,
        "request_hits": after_request.hits - after_warmup.hits,
    }))
""")


@pytest.mark.slow
def test_hook_prebuilds_the_processor_the_first_request_uses(tmp_path):
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["input_processor_patched"] and r["async_llm_patched"]
    assert r["threads"] == 1
    assert r["warmup_misses"] >= 1  # the thread built it ...
    assert r["request_misses"] == 0  # ... so the request path finds it
    assert r["request_hits"] >= 1
    assert "HF processor pre-built" in proc.stderr
