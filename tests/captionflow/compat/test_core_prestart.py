"""The engine core's process prestarted while the front end starts (captionflow/compat/core_prestart.py), with real
vLLM (CPU build) and the built-in model, in a fresh interpreter set up as an engine actor is (the job's hook installed
before vLLM is imported; vLLM's spawn start method, as inside a Ray actor)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import asyncio, json, os, sys, threading
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    from captionflow.compat import core_prestart, vllm_warmup
    vllm_warmup.install()
    prestarted = sys.argv[1] == "1"
    if prestarted:
        core_prestart.prestart()
        waiting = core_prestart._waiting[0][0].pid
    # background start-up work of the front end (tokenizer copies, the processor's pre-build) waits here
    gate = threading.Thread(target=core_prestart.after_handoff, daemon=True)
    gate.start()
    gate.join(2)
    gate_waited = gate.is_alive()
    import psutil
    from PIL import Image
    from captionflow.builtin.model import ensure_builtin_model
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(ensure_builtin_model()), max_model_len=1024, enforce_eager=True,
                           dtype="float32", kv_cache_memory_bytes=256 * 2**20,
                           limit_mm_per_prompt={"image": 1, "video": 0},
                           mm_processor_kwargs={"max_pixels": 224 * 224})
    prompt = ("<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\\n"
              "<|im_start|>assistant\\n")

    async def main():
        llm = AsyncLLM.from_engine_args(args)
        gate.join(60)
        # this process's children but multiprocessing's resource tracker: the engine core
        children = [p.pid for p in psutil.Process().children() if "resource_tracker" not in " ".join(p.cmdline())]
        request = {"prompt": prompt, "multi_modal_data": {"image": Image.new("RGB", (320, 240), (200, 30, 30))}}
        async for out in llm.generate(request, SamplingParams(max_tokens=12, temperature=0.0), "r0"):
            pass
        llm.shutdown()
        return children, list(out.outputs[0].token_ids)

    children, tokens = asyncio.run(main())
    print("RESULT " + json.dumps({"children": children, "tokens": tokens, "gate_waited": gate_waited,
                                   "gate_open": not gate.is_alive(),
                                   "prestarted": waiting if prestarted else None}))
""")


def _run(prestarted: bool, cwd, env: dict[str, str] | None = None) -> dict:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, "1" if prestarted else "0"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(cwd),
        env={**os.environ, "PYTHONPATH": str(root), **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return {**json.loads(line[7:]), "log": done.stdout + done.stderr}


def test_the_engine_core_runs_in_the_process_prestarted_for_it_and_answers_as_vllms_own(builtin_model_dir, tmp_path):
    from captionflow.compat import sampler_warmup

    # the front end's environment asks for a warm-up with its requests' sampling settings (compat/sampler_warmup):
    # the prestarted core sets that up before it starts
    warmup = sampler_warmup.environment({"temperature": 0.0, "top_p": 1.0, "seed": None})
    # the two engines in two interpreters at once (each asserts on its own process tree; the suite's wall time)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        own_f = pool.submit(_run, prestarted=False, cwd=tmp_path)
        ours_f = pool.submit(_run, prestarted=True, cwd=tmp_path, env=warmup)
        own, ours = own_f.result(), ours_f.result()
    assert ours["children"] == [ours["prestarted"]]  # the one core process is the prestarted one
    assert "the warm-up samples with the run's sampling settings" in ours["log"]
    # the model's HF processor is loaded into vLLM's caches alongside the model, before the scheduler asks for it
    assert "the multimodal processor was built ahead in" in ours["log"]
    assert len(own["children"]) == 1  # vLLM's own: one core, spawned when the front end asked for it
    assert "runs in the process prestarted for it" in ours["log"]
    assert ours["tokens"] == own["tokens"] and len(ours["tokens"]) == 12  # greedy: the same answer
    assert "runs in the process prestarted for it" not in own["log"]
    # the front end's background start-up work waited for the hand-off where a core was prestarted, else not at all
    assert ours["gate_waited"] and ours["gate_open"]
    assert not own["gate_waited"] and own["gate_open"]


ACTOR_SCRIPT = textwrap.dedent("""
    import json
    import ray
    from captionflow.compat import core_prestart

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    driver = core_prestart.prestart_in_engine_actor()

    class vLLMEngineStageUDF:  # named as Ray Data LLM's own engine stage
        def __init__(self):
            from captionflow.compat import core_prestart

            calls = []
            core_prestart.prestart = lambda: calls.append(1)  # what it would spawn: not this test's concern
            self.result = [core_prestart.prestart_in_engine_actor(), len(calls)]

        def __call__(self, batch):
            batch["result"] = [json.dumps(self.result)] * len(batch["id"])
            return batch

    class OtherStageUDF(vLLMEngineStageUDF):  # another stage's actor (the same code, another name)
        pass

    got = {}
    for udf in (vLLMEngineStageUDF, OtherStageUDF):
        rows = ray.data.range(2).map_batches(udf, concurrency=1, batch_size=2).take_all()
        got[udf.__name__] = json.loads(rows[0]["result"])
    print("RESULT " + json.dumps({"driver": driver, **got}))
""")


def test_only_ray_data_llms_own_engine_stage_actor_prestarts_its_core_as_it_imports_the_stage(tmp_path):
    """Real Ray Data: an actor knows it is Ray Data LLM's engine stage by its creation task's name, before the
    stage's module (and vLLM) is imported; the driver and other stages' actors prestart nothing."""
    from tests.support.fresh_python import run_script

    _, r = run_script(ACTOR_SCRIPT, tmp_path)
    assert r["driver"] is False
    assert r["vLLMEngineStageUDF"] == [True, 1]
    assert r["OtherStageUDF"] == [False, 0]
