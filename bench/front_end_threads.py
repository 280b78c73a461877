"""Benchmark: what one vLLM front end spends per request turning a ready request (rendered prompt, image array)
into what it sends to its engine core, with W threads doing it at once - vLLM's ``renderer_num_workers``, which
the GPU preset sets per engine (docs/sizing.md) - and T torch threads in the process (Ray gives an engine actor
``OMP_NUM_THREADS`` = its CPUs).

No engine runs: each request goes through vLLM's ``InputProcessor.process_inputs`` (tokenizing, the model's HF
image processor, vLLM's multimodal bookkeeping) and ``MsgpackEncoder`` (what the front end sends), on a thread
pool of W threads; this process's CPU seconds and wall time over N requests, ``--rounds`` times per setting.
The model: ``--model DIR``, or a full-size architecture stand-in (``--arch``, no weights needed).

    python bench/front_end_threads.py --side 224 --n 400 --workers 1,2,4,8 --torch-threads 1,2

Prints a short table and writes JSON (``--json``, default bench/results/front_end_threads-<device>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from bench.throughput.measure import PROMPT, SYSTEM_PROMPT  # the GPU bench's requests


def front_end(model: str, side: int):
    """A request -> the bytes the front end sends, for ``model`` at ``side`` x ``side`` pixels."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.serial_utils import MsgpackEncoder

    from captionflow.engines.request_format import image_prompt

    prompt = image_prompt(model).render(SYSTEM_PROMPT, PROMPT)
    args = EngineArgs(
        model=model,
        load_format="dummy",
        max_model_len=4096,
        limit_mm_per_prompt={"image": 1, "video": 0},
        mm_processor_kwargs={"max_pixels": side * side},
        mm_processor_cache_gb=0,
        enable_prefix_caching=True,
    )
    processor = InputProcessor(args.create_engine_config())
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0)
    local = threading.local()  # an encoder per thread: vLLM's is not shared between threads

    def send(i: int, image) -> int:
        request = processor.process_inputs(
            f"r{i}", {"prompt": prompt, "multi_modal_data": {"image": image}}, params, ("generate",)
        )
        if not hasattr(local, "encoder"):
            local.encoder = MsgpackEncoder()
        return len(local.encoder.encode(request))

    return send


def measure(send, images: list, n: int, workers: int) -> dict:
    with ThreadPoolExecutor(workers) as pool:
        t0, c0 = time.perf_counter(), time.process_time()
        list(pool.map(lambda i: send(i, images[i % len(images)]), range(n)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"requests_per_s": n / wall, "cpu_ms_per_request": cpu / n * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a checkpoint folder (default: a stand-in of --arch)")
    ap.add_argument("--arch", default="qwen2.5-vl-3b", help="stand-in architecture (without --model)")
    ap.add_argument("--side", type=int, default=224, help="image side in pixels (fitted to the patch grid)")
    ap.add_argument("--n", type=int, default=400, help="requests per measurement")
    ap.add_argument("--workers", default="1,2,4,8", help="thread counts (renderer_num_workers)")
    ap.add_argument("--torch-threads", default="1,2", help="torch intra-op thread counts")
    ap.add_argument("--rounds", type=int, default=2, help="measurements per setting (the median is reported)")
    ap.add_argument("--json", help="results file")
    a = ap.parse_args()

    import numpy as np
    import torch

    model = a.model
    if not model:
        from captionflow.builtin.standin import build_standin

        model = str(Path(tempfile.mkdtemp(prefix="cf-standin-")) / a.arch)
        build_standin(a.arch, Path(model))
    send = front_end(model, a.side)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (a.side, a.side, 3), dtype=np.uint8) for _ in range(16)]
    for i in range(32):  # warm-up: the processor's first calls
        send(i, images[i % 16])

    rows = []
    for t in (int(x) for x in a.torch_threads.split(",")):
        torch.set_num_threads(t)
        for w in (int(x) for x in a.workers.split(",")):
            runs = [measure(send, images, a.n, w) for _ in range(a.rounds)]
            rows.append(
                {
                    "torch_threads": t,
                    "workers": w,
                    "requests_per_s": round(statistics.median(r["requests_per_s"] for r in runs), 1),
                    "cpu_ms_per_request": round(statistics.median(r["cpu_ms_per_request"] for r in runs), 2),
                    "runs": runs,
                }
            )
            print(
                f"torch threads {t:>2}  workers {w:>2}: {rows[-1]['requests_per_s']:>7} requests/s, "
                f"{rows[-1]['cpu_ms_per_request']:>6} ms CPU per request",
                flush=True,
            )
    import vllm

    results = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "vllm": vllm.__version__,
        "model": a.model or f"stand-in {a.arch}",
        "side": a.side,
        "n": a.n,
        "rows": rows,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    from captionflow.engines.device import local_gpu_name

    device = (local_gpu_name() or "cpu").replace("NVIDIA ", "").split()[0].lower()
    out = Path(a.json or Path(__file__).parent / "results" / f"front_end_threads-{device}.json")
    out.write_text(json.dumps(results, indent=2))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
