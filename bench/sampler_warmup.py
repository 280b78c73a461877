"""What vLLM's sampler warm-up costs an engine's start on a fresh node: the sampler run on dummy logits as
``GPUModelRunner._dummy_sampler_run`` does it (top-k, top-p and temperature on every row, then again with a
per-request generator), with empty Triton and Inductor caches, then again warm; and a greedy batch (what a caption
run with temperature 0 asks for), for comparison. Runs where vLLM's CUDA build runs (the GPU host):

    python bench/sampler_warmup.py [--rows 512] [--vocab 151936] [--prebuilt] [--json out.json]

Prints a short table and writes JSON (seconds per call).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=512, help="rows of the dummy batch (vLLM: max_num_seqs)")
    ap.add_argument("--vocab", type=int, default=151936, help="the model's vocabulary (Qwen2.5-VL: 151,936)")
    ap.add_argument(
        "--prebuilt",
        action="store_true",
        help="first let captionflow's background prebuild (compat/sampler_kernels.py) fill the empty caches, in a "
        "process of its own, as preflight does: the warm-up should then find its kernels compiled",
    )
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    cache = tempfile.mkdtemp(prefix="sampler-warmup-")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")  # empty: a fresh node
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    prebuild_s = None
    if a.prebuilt:
        t = time.perf_counter()
        marker = os.path.join(cache, "marker")
        module = "captionflow.compat.sampler_kernels"
        subprocess.run([sys.executable, "-m", module, str(a.vocab), str(a.rows), marker], check=True)
        prebuild_s = round(time.perf_counter() - t, 2)
    t0 = time.perf_counter()
    import torch
    from vllm.v1.sample.sampler import Sampler

    from captionflow.compat.sampler_kernels import dummy_metadata

    res: dict = {"rows": a.rows, "vocab": a.vocab, "prebuild_s": prebuild_s}
    res["import_s"] = round(time.perf_counter() - t0, 2)
    res["device"] = torch.cuda.get_device_name(0)
    res["env"] = {k: os.environ.get(k) for k in ("VLLM_USE_FLASHINFER_SAMPLER",)}
    sampler = Sampler()
    logits = torch.rand(a.rows, a.vocab, device="cuda", dtype=torch.float32)

    def metadata(greedy: bool, generators: dict):
        return dummy_metadata(a.rows, a.vocab, "cuda", generators, greedy)

    def timed(name: str, greedy: bool, generators: dict) -> None:
        torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            sampler(logits=logits.clone(), sampling_metadata=metadata(greedy, generators))
            torch.cuda.synchronize()
            res[name] = round(time.perf_counter() - t, 3)
        except Exception as e:  # the layout of SamplingMetadata changed, or a kernel failed: say which
            res[name] = f"{type(e).__name__}: {str(e)[:300]}"

    def generator() -> dict:
        return {0: torch.Generator(device="cuda").manual_seed(0)}

    timed("greedy_first_s", True, {})
    timed("warmup_first_s", False, {})  # _dummy_sampler_run's first call: empty caches
    timed("warmup_generators_first_s", False, generator())  # and its second
    timed("warmup_again_s", False, {})
    timed("warmup_generators_again_s", False, generator())
    timed("greedy_again_s", True, {})
    for k, v in res.items():
        print(f"{k:28} {v}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
