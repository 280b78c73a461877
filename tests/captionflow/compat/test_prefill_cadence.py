"""New prefills on a cadence (captionflow/compat/prefill_cadence.py), with real vLLM (CPU build) and the built-in
model: the engine runs in-process so that its scheduler's steps can be recorded."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from captionflow.compat import prefill_cadence

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, to record its steps
    from PIL import Image
    from captionflow.builtin.model import ensure_builtin_model
    from captionflow.compat import prefill_cadence
    from vllm import LLM, SamplingParams

    k = int(sys.argv[1])
    extra = prefill_cadence.engine_kwargs({"prefill_schedule_interval": k}) if k > 1 else {}
    llm = LLM(model=str(ensure_builtin_model()), max_model_len=1024, enforce_eager=True, dtype="float32",
              kv_cache_memory_bytes=256 * 2**20, limit_mm_per_prompt={"image": 1, "video": 0},
              mm_processor_kwargs={"max_pixels": 224 * 224}, max_num_seqs=4, **extra)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps = []
    plain = scheduler.schedule

    def schedule(*a, **kw):
        decoding = sum(1 for r in scheduler.running if not r.is_prefill_chunk)
        out = plain(*a, **kw)
        steps.append({"step": scheduler.current_step, "decoding": decoding,
                      "new": len(out.scheduled_new_reqs)})
        return out

    scheduler.schedule = schedule
    prompt = ("<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\\n"
              "<|im_start|>assistant\\n")
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]
    requests = [{"prompt": prompt, "multi_modal_data": {"image": Image.new("RGB", (320, 240), c)}}
                for c in colours * 2]
    # lengths that differ, so that requests finish at different steps and slots free up between cadence steps
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(requests))]
    outs = llm.generate(requests, params, use_tqdm=False)
    print("RESULT " + json.dumps({"cls": type(scheduler).__name__, "steps": steps,
                                   "tokens": [list(o.outputs[0].token_ids) for o in outs]}))
""")


def _run(k: int, cwd) -> dict:
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(k)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(cwd),
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))[7:])


def test_new_requests_join_only_on_cadence_steps_and_the_answers_stay_the_same(builtin_model_dir, tmp_path):
    plain, cadenced = _run(1, tmp_path), _run(4, tmp_path)
    assert cadenced["cls"].startswith("Cadenced") and not plain["cls"].startswith("Cadenced")
    assert cadenced["tokens"] == plain["tokens"]  # greedy: only the order of work changed
    joined = [s for s in cadenced["steps"] if s["new"] and s["decoding"]]
    assert joined and all(s["step"] % 4 == 0 for s in joined)  # beside running decodes: only every 4th step
    # vLLM's own scheduler admits whenever a slot frees, beside running decodes, off the cadence too
    assert any(s["new"] and s["decoding"] and s["step"] % 4 for s in plain["steps"])


def test_engine_kwargs_name_the_scheduler_only_where_a_cadence_is_asked_for():
    assert prefill_cadence.engine_kwargs({"prefill_schedule_interval": 8})["scheduler_cls"] == prefill_cadence.SCHEDULER
    assert "scheduler_cls" not in prefill_cadence.engine_kwargs({"prefill_schedule_interval": 1})
    assert "scheduler_cls" not in prefill_cadence.engine_kwargs({})
    own = {"prefill_schedule_interval": 8, "scheduler_cls": "my.Scheduler"}
    assert prefill_cadence.engine_kwargs(own) == own
