"""Diagnostic: when does vLLM build the HF processor (processor-cache misses), and with which key?

py-spy on the GPU host showed vLLM 0.26's front end in ``ProcessorMixin.from_pretrained`` inside
``cached_get_processor_without_dynamic_kwargs`` (an lru_cache miss) while serving requests; counted
with this script, it is one build at the first request (the renderer's tokenizer copy is part of the
key), which captionflow/vllm_warmup.py now moves into start-up. This script sends N image requests the way Ray Data LLM's engine stage does (messages parsed by
``parse_chat_messages_async`` with data: URLs, the chat template applied, ``AsyncLLM.generate``
with ``TextPrompt``, N requests in flight at once) and, with ``--sync``, through ``LLM.generate``
as a plain script does. It wraps ``vllm.transformers_utils.processor.cached_get_processor`` to record
every cache miss: the thread, each argument's type, id and hash, and which ones differ from the
first miss.

    python bench/diag_processor_cache.py --model DIR --n 64 [--sync] [--engine-kwargs JSON] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEM_PROMPT = "You are a helpful assistant that writes short, factual image captions."
PROMPT = "Describe this image in one sentence."


def _describe(v) -> dict:
    try:
        h = hash(v)
    except TypeError as e:
        h = f"unhashable: {e}"
    return {"type": type(v).__name__, "id": id(v), "hash": h, "repr": repr(v)[:120]}


def instrument() -> dict:
    """Wrap vLLM's processor lru_cache; return the live record."""
    import transformers.processing_utils as pu
    import vllm.transformers_utils.processor as P

    rec: dict = {"misses": [], "calls": 0, "from_pretrained": 0}
    cached = P.cached_get_processor

    def wrapped(*args, **kwargs):
        before, t0 = cached.cache_info().misses, time.time()
        out = cached(*args, **kwargs)
        rec["calls"] += 1
        if cached.cache_info().misses > before and len(rec["misses"]) < 50:
            rec["misses"].append({"t": time.time(), "duration_s": round(time.time() - t0, 3), "thread": threading.current_thread().name,
                                  "args": [_describe(a) for a in args],
                                  "kwargs": {k: _describe(v) for k, v in kwargs.items()}})
        return out

    wrapped.cache_info = cached.cache_info  # type: ignore[attr-defined]
    wrapped.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    P.cached_get_processor = wrapped
    orig = pu.ProcessorMixin.from_pretrained.__func__

    def counted(cls, *a, **k):
        rec["from_pretrained"] += 1
        return orig(cls, *a, **k)

    pu.ProcessorMixin.from_pretrained = classmethod(counted)
    return rec


def summarise(rec: dict) -> dict:
    misses = rec["misses"]
    diff = set()
    if misses:
        first = misses[0]
        for m in misses[1:]:
            for k, d in m["kwargs"].items():
                f = first["kwargs"].get(k)
                if f is None or f["hash"] != d["hash"] or f["id"] != d["id"]:
                    diff.add(k)
            if set(m["kwargs"]) != set(first["kwargs"]):
                diff.add("<kwarg names>")
    return {"calls": rec["calls"], "misses_recorded": len(misses), "from_pretrained": rec["from_pretrained"],
            "kwargs_that_differ_between_misses": sorted(diff), "misses": misses[:6]}


def images(n: int) -> list[bytes]:
    """The GPU benchmark's synthetic 640x480 JPEGs (bench/synthetic.py), as bytes."""
    import tempfile

    from bench.synthetic import make_images

    with tempfile.TemporaryDirectory() as d:
        return [f.read_bytes() for f in sorted(make_images(Path(d), n).iterdir())]


def engine_kwargs(a) -> dict:
    return {"model": a.model, "max_model_len": 4096, "max_num_seqs": 64, "limit_mm_per_prompt": {"image": 1, "video": 0},
            "mm_processor_kwargs": {"max_pixels": a.max_pixels}, "enforce_eager": True, **json.loads(a.engine_kwargs)}


async def run_async(a, rec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.chat_utils import parse_chat_messages_async
    from vllm.v1.engine.async_llm import AsyncLLM

    try:
        from vllm.inputs.llm import TextPrompt
    except ImportError:
        from vllm.inputs import TextPrompt
    t0 = time.time()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(a)))
    t_engine = time.time()
    misses_at_start = len(rec["misses"])
    tok = engine.tokenizer if hasattr(engine, "tokenizer") else await engine.get_tokenizer()
    model_config = engine.model_config
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, img: bytes):
        url = "data:image/jpeg;base64," + base64.b64encode(img).decode()
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": PROMPT}]}]
        conv, mm_data, mm_uuids = await parse_chat_messages_async(msgs, model_config, content_format="openai")
        conv = [{"role": "system", "content": SYSTEM_PROMPT}] + conv
        prompt = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        p = TextPrompt(prompt=prompt, multi_modal_data=mm_data, mm_processor_kwargs=None, multi_modal_uuids=mm_uuids)
        async for out in engine.generate(request_id=str(i), prompt=p, sampling_params=sp):
            if out.finished:
                return out

    imgs = images(a.n)
    t1 = time.time()
    outs = await asyncio.gather(*(one(i, im) for i, im in enumerate(imgs)))
    t2 = time.time()
    engine.shutdown()
    return {"path": "AsyncLLM", "engine_start_s": round(t_engine - t0, 1), "requests": len(outs),
            "requests_s": round(t2 - t1, 2), "misses_during_requests": len(rec["misses"]) - misses_at_start}


def run_sync(a, rec: dict) -> dict:
    from PIL import Image
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**engine_kwargs(a))
    t_engine = time.time()
    misses_at_start = len(rec["misses"])
    tok = llm.get_tokenizer()
    msgs = [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    inputs = [{"prompt": prompt, "multi_modal_data": {"image": Image.open(io.BytesIO(b)).convert("RGB")}}
              for b in images(a.n)]
    t1 = time.time()
    outs = llm.generate(inputs, SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    t2 = time.time()
    return {"path": "LLM", "engine_start_s": round(t_engine - t0, 1), "requests": len(outs),
            "requests_s": round(t2 - t1, 2), "misses_during_requests": len(rec["misses"]) - misses_at_start}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-pixels", type=int, default=448 * 448)
    p.add_argument("--sync", action="store_true", help="LLM.generate (a plain script) instead of AsyncLLM")
    p.add_argument("--engine-kwargs", default="{}", help="JSON, e.g. '{\"load_format\": \"dummy\"}'")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import transformers
    import vllm

    rec = instrument()
    res = run_sync(a, rec) if a.sync else asyncio.run(run_async(a, rec))
    res.update({"vllm": vllm.__version__, "transformers": transformers.__version__, **summarise(rec)})
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if a.json:
        a.json.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
