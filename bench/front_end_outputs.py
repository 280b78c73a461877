"""Benchmark: what a vLLM engine's front end spends per request when it sends every intermediate output
(vLLM's default, what Ray Data LLM 2.60 asks for) against the final output only (``vllm.LLM``'s choice, and
captionflow's engine actors and warm replicas since ``compat/vllm_warmup.final_outputs_only``).

One ``AsyncLLM`` in this process (its engine core in another); the same N image requests of T tokens each
(``ignore_eos``) in the two modes, alternating, ``--rounds`` times; the front end's CPU seconds are this
process's (the engine core's are not counted). The tokens must be equal in both modes.

    python bench/front_end_outputs.py --n 512 --tokens 64 --rounds 2

Prints a short table and writes JSON (``--json``, default bench/results/front_end_outputs-<device>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

MODES = ("cumulative", "final_only")


async def one_round(llm, images, prompt, tokens: int, mode: str, tag: str) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.FINAL_ONLY if mode == "final_only" else RequestOutputKind.CUMULATIVE

    async def request(i: int):
        sp = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0, output_kind=kind)
        outputs, last = 0, None
        async for out in llm.generate({"prompt": prompt, "multi_modal_data": {"image": images[i]}}, sp, f"{tag}-{i}"):
            outputs += 1
            last = out
        return outputs, list(last.outputs[0].token_ids)

    c0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(request(i) for i in range(len(images))))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return {
        "front_end_cpu_ms_per_request": round(cpu / len(images) * 1e3, 3),
        "wall_s": round(wall, 3),
        "outputs_per_request": statistics.mean(r[0] for r in results),
        "tokens": [r[1] for r in results],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin", help="a checkpoint folder (default: the built-in tiny model)")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--n", type=int, default=512, help="requests per round")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each mode, alternating")
    ap.add_argument("--side", type=int, default=56, help="image side in pixels")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="the engine's batch (default 256)")
    ap.add_argument("--json", help="results file")
    a = ap.parse_args()

    import numpy as np
    from PIL import Image
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from captionflow.engines.presets import PRESETS
    from captionflow.model_source import resolve_model

    model = resolve_model(a.model).path
    preset = PRESETS[a.device]
    kwargs = {
        **preset.engine_kwargs,
        "max_num_seqs": a.max_num_seqs,
        "max_model_len": preset.max_model_len,
        "limit_mm_per_prompt": {"image": 1, "video": 0},
        "mm_processor_cache_gb": 0,
    }
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **kwargs))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (a.side, a.side, 3), dtype=np.uint8)) for _ in range(a.n)]
    prompt = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n<|im_start|>assistant\n"

    async def run() -> dict:
        await one_round(llm, images[:4], prompt, a.tokens, "cumulative", "warmup")
        rounds: dict = {m: [] for m in MODES}
        for r in range(a.rounds):
            for mode in MODES:
                rounds[mode].append(await one_round(llm, images, prompt, a.tokens, mode, f"{mode}-{r}"))
        return rounds

    rounds = asyncio.run(run())
    llm.shutdown()
    same = all(x["tokens"] == rounds["cumulative"][0]["tokens"] for m in MODES for x in rounds[m])
    summary = {
        m: {
            "front_end_cpu_ms_per_request": statistics.median(x["front_end_cpu_ms_per_request"] for x in rounds[m]),
            "wall_s": statistics.median(x["wall_s"] for x in rounds[m]),
            "outputs_per_request": rounds[m][0]["outputs_per_request"],
        }
        for m in MODES
    }
    ratio = round(
        summary["final_only"]["front_end_cpu_ms_per_request"] / summary["cumulative"]["front_end_cpu_ms_per_request"], 3
    )
    print(f"{'':28}{'cumulative':>12}{'final_only':>12}")
    for key in ("front_end_cpu_ms_per_request", "wall_s", "outputs_per_request"):
        print(f"{key:28}{summary['cumulative'][key]:>12}{summary['final_only'][key]:>12}")
    print(f"front-end CPU final_only / cumulative: {ratio}  same tokens: {same}")
    out = {
        "model": a.model,
        "device": a.device,
        "host": platform.node(),
        "n": a.n,
        "tokens": a.tokens,
        "side": a.side,
        "rounds": {m: [{k: v for k, v in x.items() if k != "tokens"} for x in rounds[m]] for m in MODES},
        "summary": summary,
        "final_only_vs_cumulative_cpu": ratio,
        "same_tokens": same,
    }
    path = Path(a.json or Path(__file__).parent / "results" / f"front_end_outputs-{a.device}.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
