"""The engine-process hook (captionflow/compat/vllm_warmup.py) with real vLLM (CPU build) and the built-in model.

In a fresh interpreter: the hook is installed before vLLM is imported (as Ray's worker setup hook
is), vLLM's InputProcessor is built for the built-in model, and the HF processor the first request
asks for must then already be in vLLM's processor cache - filled by the hook's thread alone, since
the cache is emptied just before.
"""

import textwrap

import pytest

from tests.support.fresh_python import run_script

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
    proc, r = run_script(SCRIPT, tmp_path)
    assert r["input_processor_patched"] and r["async_llm_patched"]
    assert r["threads"] == 1
    assert r["warmup_misses"] >= 1  # the thread built it ...
    assert r["request_misses"] == 0  # ... so the request path finds it
    assert r["request_hits"] >= 1
    assert "HF processor pre-built" in proc.stderr


RENDER_SCRIPT = textwrap.dedent("""
    import asyncio, inspect, io, json, threading
    from captionflow.compat import vllm_warmup
    vllm_warmup.install()                       # before any vLLM import, as in a Ray worker
    from PIL import Image
    from captionflow.builtin.model import ensure_builtin_model
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(ensure_builtin_model()), max_model_len=1024, enforce_eager=True,
                           dtype="float32", kv_cache_memory_bytes=256 * 2**20, renderer_num_workers=2,
                           limit_mm_per_prompt={"image": 1, "video": 0}, mm_processor_cache_gb=0,
                           mm_processor_kwargs={"max_pixels": 224 * 224})
    images = [Image.new("RGB", (320, 240), c) for c in ((200, 30, 30), (20, 160, 90), (40, 40, 220))]
    prompt = ("<|im_start|>user\\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\\n"
              "<|im_start|>assistant\\n")
    sp = SamplingParams(max_tokens=12, temperature=0.0)

    import vllm
    from vllm.renderers import renderer_from_config
    seen = []
    cls = type(renderer_from_config(args.create_engine_config()))
    process = cls._process_multimodal            # patched on the class: the renderer binds it at construction
    def recording(self, *a, **k):
        seen.append([TAG[0], threading.current_thread() is threading.main_thread()])
        return process(self, *a, **k)
    cls._process_multimodal = recording
    TAG = [""]
    YIELDS = {}

    async def caption(llm, i, add_request, tag):
        llm.add_request = add_request.__get__(llm)      # this request through the given path
        TAG[0] = tag
        outs = []
        request = {"prompt": prompt, "multi_modal_data": {"image": images[i]}}
        async for out in llm.generate(request, sp.clone(), f"r{i}-{tag}"):
            outs.append(out)
        YIELDS.setdefault(tag, []).append(len(outs))
        return list(outs[-1].outputs[0].token_ids)

    async def main():
        llm = AsyncLLM.from_engine_args(args)
        patched = type(llm).add_request
        original = inspect.unwrap(patched)              # vLLM's own, under every captionflow wrapper
        out = {"patched": [], "original": []}
        for i in range(len(images)):
            out["original"].append(await caption(llm, i, original, "original"))
            out["patched"].append(await caption(llm, i, patched, "patched"))
        llm.shutdown()
        return out, seen

    out, seen = asyncio.run(main())
    print("RESULT " + json.dumps({"out": out, "on_loop_thread": seen, "yields": YIELDS, "vllm": vllm.__version__}))
""")


@pytest.mark.slow
def test_requests_are_rendered_off_the_event_loop_with_the_same_outputs(tmp_path):
    """With the patch, the engine front end's image processing runs on the renderer's threads, not on the
    event loop's thread, only each request's final output comes back (Ray Data LLM reads no other), and greedy
    outputs equal those of vLLM's own (deprecated) raw-prompt path, which returns an output per token."""
    _, r = run_script(RENDER_SCRIPT, tmp_path)
    assert r["out"]["patched"] == r["out"]["original"]
    assert all(len(t) == 12 for t in r["out"]["patched"])
    assert len({tuple(t) for t in r["out"]["patched"]}) > 1  # the images make a difference
    # the final output only / an output per token, some merged when the loop is slow to read them (vLLM's
    # output collector merges what waits), so between 2 and 12
    assert r["yields"]["patched"] == [1] * 3
    assert len(r["yields"]["original"]) == 3 and all(2 <= n <= 12 for n in r["yields"]["original"]), r["yields"]
    # the patched path processes images on the renderer's threads; vLLM's own raw-prompt path did it on the
    # event loop's (main) thread up to 0.26 (the GPU host's) and moved it off the loop later (0.29 and later)
    on_loop = {}
    for tag, main in r["on_loop_thread"]:
        on_loop.setdefault(tag, []).append(main)
    assert on_loop["patched"] == [False] * 3
    old_vllm = tuple(int(x) for x in r["vllm"].split(".")[:2]) < (0, 27)
    assert on_loop["original"] == [old_vllm] * 3
