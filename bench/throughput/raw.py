"""Phase A of the GPU benchmark: raw single-process vLLM (one ``vllm.LLM``, PIL in the same process, one
``LLM.generate``), and the single-engine ceiling (a queue filled beforehand, drained, timed by the engine's clock)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.throughput.measure import PROMPT, SYSTEM_PROMPT, rate_10_90, rates


# ---------------------------------------------------------------- phase A: raw vLLM (child process)
def phase_raw(a: argparse.Namespace) -> dict:
    from captionflow.engines.presets import PRESETS

    preset = PRESETS[a.device]

    t_start = time.time()
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    t_import = time.time()
    kwargs = {
        "max_num_seqs": preset.max_num_seqs,
        "max_model_len": preset.max_model_len,
        "limit_mm_per_prompt": {"image": 1, "video": 0},
        "mm_processor_kwargs": {"max_pixels": a.max_pixels},
        **preset.engine_kwargs,
        **json.loads(a.engine_kwargs),
        "disable_log_stats": False,  # each output then carries the engine core's timestamps (``engine_rates``)
    }
    llm = LLM(model=a.model, **kwargs)
    t_engine = time.time()
    tok = AutoTokenizer.from_pretrained(a.model)
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
    ]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    files = sorted(Path(a.images).iterdir())
    inputs = []
    for f in files:  # decode in this process, as a plain script does
        with Image.open(f) as im:
            inputs.append({"prompt": prompt, "multi_modal_data": {"image": im.convert("RGB")}})
    finished: list[float] = []

    class Recorder:  # vLLM's progress-bar hook (a tqdm stand-in): update() once per finished request
        def __init__(self, iterable=None, *args, total=None, desc="", **kw):
            self.n, self.total, self.desc, self.postfix, self._t0 = 0, total, desc, "", time.time()
            self._iterable = iterable

        def __iter__(self):
            return iter(self._iterable if self._iterable is not None else ())

        def __len__(self):
            return len(self._iterable)

        @property
        def format_dict(self):
            return {"elapsed": max(time.time() - self._t0, 1e-9)}

        def update(self, n=1):
            self.n += n
            if "rocess" in str(self.desc):
                finished.extend([time.time()] * n)

        def refresh(self, *a, **k):
            pass

        def close(self):
            pass

        def set_description(self, *a, **k):
            pass

    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(inputs, sp, use_tqdm=Recorder)  # max_pixels: set for the engine above, as in B and C
    t_end = time.time()
    out_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tok = sum(len(o.prompt_token_ids) for o in outs) / len(outs)
    # vLLM's offline generate() processes every input (in this process) before it collects the first
    # output, so "first result to last" is not observable here: A's steady window is its whole
    # working time once the engine is up (decode, image processing and generation).
    t_first = min(finished) if finished else t_end
    r = rates(len(outs), t_start, t_first, t_end, t_engine, len(outs), out_tok, [(t, 1) for t in sorted(finished)])
    r.update(
        {
            "import_s": round(t_import - t_start, 2),
            "engine_start_s": round(t_engine - t_import, 2),
            "mean_input_tokens": round(in_tok, 1),
            "output_tokens": out_tok,
            "engine_kwargs": kwargs,
            # the same outputs timed when the engine core finished them: generate() collects outputs only after it
            # added every input, so the times above bunch up what the core had finished while inputs were added
            "engine_finished": engine_rates(outs),
        }
    )
    if a.ceiling:
        from PIL import ImageOps

        mirrored = [
            {**x, "multi_modal_data": {"image": ImageOps.mirror(x["multi_modal_data"]["image"])}} for x in inputs
        ]
        r["ceiling"] = drain_full_queue(llm, mirrored, sp)
    return r


def _core_clock_offset() -> float:
    """Unix time minus the engine core's clock (``time.monotonic``, one clock for every process of a Linux host)."""
    return time.time() - time.monotonic()


def engine_rates(outs: list) -> dict | None:
    """Rates from when the engine core produced each request's last token (``RequestOutput.metrics``, the core's
    own timestamp; vLLM keeps it when its statistics are on): 10-90% of the results and first to last."""
    ends = sorted(o.metrics.last_token_ts for o in outs if getattr(o, "metrics", None) and o.metrics.last_token_ts)
    if len(ends) < max(10, len(outs) // 2):
        return None
    offset = _core_clock_offset()
    return {
        **rate_10_90([(t + offset, 1) for t in ends], len(ends)),
        "images_per_s_first_to_last": round(len(ends) / (ends[-1] - ends[0]), 2) if ends[-1] > ends[0] else None,
        "t_first": ends[0] + offset,
        "t_last": ends[-1] + offset,
    }


def drain_full_queue(llm, inputs: list, params) -> dict:
    """One engine draining a full queue, the single-engine ceiling: every request rendered first (vLLM's own
    renderer, in this process), then all added to an engine that is already up, then drained; rates from the
    engine core's own finish times (``engine_rates``). ``inputs``' images must be new to the engine (its prefix
    and encoder caches would otherwise skip their work)."""
    from vllm import RequestOutput

    t0 = time.time()
    rendered = llm._preprocess_cmpl(inputs)  # what generate() renders one by one
    t_rendered = time.time()
    llm._render_and_add_requests(prompts=rendered, params=[params] * len(rendered))
    t_added = time.time()
    outs = llm._run_engine(output_type=RequestOutput, use_tqdm=False)
    t_end = time.time()
    r = engine_rates(outs) or {}
    r.update(
        {
            "images": len(outs),
            "render_s": round(t_rendered - t0, 2),
            "add_s": round(t_added - t_rendered, 2),
            "added_to_last_s": round(t_end - t_rendered, 2),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        }
    )
    return r
