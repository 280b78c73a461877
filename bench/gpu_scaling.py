"""Scaling on one multi-GPU host: one checkpoint over G GPUs, and G checkpoints at once.

  python bench/gpu_scaling.py --n 8000 [--gpus 1,2,4,8] [--json FILE] [-- gpu_throughput.py options]

``scaling``: for each G in ``--gpus`` (at most the host's), the inference stage of one checkpoint on the first G
GPUs (``CUDA_VISIBLE_DEVICES``; ``bench/gpu_throughput.py --phases stage``, the GPU preset's layout), its steady
images/s and the efficiency ``rate(G) / (G x rate(1))`` (goal >= 0.9).

``parallel_checkpoints``: on all G GPUs, G checkpoints of the stand-in's architecture (random weights) evaluated at
once by ``captionflow compare --parallel G`` (prefect-ray's RayTaskRunner, the GPUs split between them), wall
seconds, against one checkpoint's ``captionflow run`` on one GPU; ``ratio`` = the first over the second (goal
<= 1.2). Both on the same images, the dataset preprocessed beforehand (a golden set).

Writes JSON after each G (default bench/results/gpu_scaling-<gpu>.json: per G the steady rate, rows per engine and
their balance, busy % and memory per GPU) and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.throughput.verdict import random_checkpoint  # noqa: E402 - after the checkout is on the path


def _stage_rate(a: argparse.Namespace, gpus: int, work: Path, extra: list[str]) -> dict:
    out = work / f"scaling-{gpus}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_throughput.py"), "--n", str(a.n), "--phases", "stage"]
    cmd += ["--work", str(work / "throughput"), "--json", str(out), "--phase-timeout", str(a.timeout), *extra]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=a.timeout + 300)
    except subprocess.TimeoutExpired:
        return {"gpus": gpus, "error": f"timed out after {a.timeout + 300} s"}
    if proc.returncode != 0 or not out.exists():
        return {"gpus": gpus, "error": f"exit {proc.returncode}"}
    stage = json.loads(out.read_text())["stage"]
    if "error" in stage:
        return {"gpus": gpus, "error": stage["error"], "log_tail": stage.get("log_tail", "")[-2000:]}
    rows = stage.get("rows_per_engine") or []
    return {
        "gpus": gpus,
        "images_per_s": stage.get("images_per_s"),
        "images_per_s_10_90": stage.get("images_per_s_10_90"),
        "steady_window_s": stage.get("steady_window_s"),
        "start_to_first_result_s": stage.get("start_to_first_result_s"),
        "engines": stage.get("engines"),
        "rows_per_engine": rows,
        "balance": round(max(rows) / max(min(rows), 1), 3) if rows else None,  # most / fewest rows per engine
        "per_gpu": (stage.get("gpu_steady") or {}).get("per_gpu"),
        "host_cpu_busy_pct": (stage.get("gpu_steady") or {}).get("host_cpu_busy_pct"),
        "engines_accepting_after_s": stage.get("engines_accepting_after_s"),
        # between 10% and 90% of the results: per GPU, the host's CPU and which processes used it
        "window_10_90": stage.get("gpu_10_90"),
        "trace": stage.get("gpu_trace"),
        "wall_s": stage.get("wall_s"),
    }


def _timed(cmd: list[str], env: dict, log: Path, timeout: float) -> dict:
    t0 = time.time()
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s", "log_tail": log.read_text(errors="replace")[-3000:]}
    wall = round(time.time() - t0, 2)
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "log_tail": log.read_text(errors="replace")[-3000:]}
    return {"wall_s": wall}


def _parallel(a: argparse.Namespace, gpus: int, work: Path) -> dict:
    """A golden set preprocessed by a first run (checkpoint ``gpus + 1``), then checkpoint 0 alone on one GPU, then
    checkpoints 1..gpus at once on every GPU: every measured run evaluates a checkpoint the set has not seen."""
    images, model = work / "throughput" / "images", a.model or _standin(work)
    if not (images.is_dir() and len(list(images.iterdir())) == a.n):  # no scaling run made them (--skip-scaling)
        from captionflow.builtin.synthetic import make_images

        shutil.rmtree(images, ignore_errors=True)
        make_images(images, a.n)
    ckpts = [random_checkpoint(model, work / f"checkpoint-{seed}", seed, "cuda") for seed in range(gpus + 2)]
    root = work / "out-parallel"
    shutil.rmtree(root, ignore_errors=True)
    common = ["--dataset", str(images), "--output", str(root), "--device", "gpu", "--ignore-eos"]
    common += ["--max-tokens", str(a.max_tokens), "--max-pixels", str(a.max_pixels)]
    run = [sys.executable, "-m", "flows.cli", "run", *common]
    one_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    every_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}
    first = _timed([*run, "--model", ckpts[gpus + 1]], one_gpu, work / "parallel-prepare.log", a.timeout)
    one = _timed([*run, "--model", ckpts[0]], one_gpu, work / "parallel-one.log", a.timeout)
    compare = [sys.executable, "-m", "flows.cli", "compare", *ckpts[1 : gpus + 1], *common, "--parallel", str(gpus)]
    many = _timed(compare, every_gpu, work / "parallel-many.log", a.timeout)
    res = {"checkpoints": gpus, "preparing_run": first, "one_checkpoint_one_gpu": one, "all_at_once": many}
    if "wall_s" in one and "wall_s" in many:
        res["ratio"] = round(many["wall_s"] / one["wall_s"], 3)
    return res


def _standin(work: Path) -> str:
    """The stand-in the throughput runs built (gpu_throughput.py's work folder), else a new one."""
    made = work / "throughput" / "standin-qwen2.5-vl-3b"
    if (made / "config.json").exists():
        return str(made)
    from captionflow.builtin.standin import build_standin

    return str(build_standin("qwen2.5-vl-3b", work / "standin"))


def _device_name() -> str:
    from captionflow.engines.device import local_gpu_name

    name = (local_gpu_name() or "gpu").replace("NVIDIA ", "").split()[0].lower()
    return name


def _save(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")


def main() -> int:
    from captionflow.engines.device import local_gpu_name, local_gpus

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8000)
    ap.add_argument("--gpus", default="1,2,4,8", help="GPU counts to measure (at most the host's)")
    ap.add_argument("--model", help="a checkpoint folder (default: the Qwen2.5-VL-3B stand-in, random weights)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-pixels", type=int, default=224 * 224)
    ap.add_argument(
        "--timeout", type=float, default=900, help="seconds each G's stage (and each parallel run) may take"
    )
    ap.add_argument("--work", help="working folder (default: a new temporary one)")
    ap.add_argument("--json", help="results file (default bench/results/gpu_scaling-<gpu>.json)")
    ap.add_argument("--skip-parallel", action="store_true")
    ap.add_argument("--skip-scaling", action="store_true", help="only the parallel checkpoints, on the largest G")
    a, extra = ap.parse_known_args()
    host_gpus = local_gpus()
    if not host_gpus:
        print("gpu_scaling: this machine has no GPU", file=sys.stderr)
        return 2
    work = Path(a.work or f"/tmp/cf-scaling-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    counts = [g for g in (int(x) for x in a.gpus.split(",")) if g <= host_gpus]
    extra += ["--max-tokens", str(a.max_tokens), "--max-pixels", str(a.max_pixels)]
    if a.model:
        extra += ["--model", a.model]
    out = Path(a.json) if a.json else ROOT / "bench" / "results" / f"gpu_scaling-{_device_name()}.json"
    res = {
        "device": local_gpu_name(),
        "host_gpus": host_gpus,
        "n": a.n,
        "max_tokens": a.max_tokens,
        "max_pixels": a.max_pixels,
        "scaling": [],
    }
    for g in [] if a.skip_scaling else counts:  # written after each G: a G that fails or hangs keeps the others
        res["scaling"].append(_stage_rate(a, g, work, extra))
        base = next((s.get("images_per_s") for s in res["scaling"] if s["gpus"] == 1), None)
        for s in res["scaling"]:
            if base and s.get("images_per_s"):
                s["efficiency"] = round(s["images_per_s"] / (s["gpus"] * base), 3)
        _save(res, out)
    if not a.skip_parallel and host_gpus > 1:
        res["parallel_checkpoints"] = _parallel(a, max(counts), work)
        _save(res, out)
    scaling = res["scaling"]
    print(f"{'GPUs':>5} {'img/s':>10} {'efficiency':>11} {'balance':>8}")
    for s in scaling:
        print(
            f"{s['gpus']:>5} {s.get('images_per_s') or 0:>10.1f} {s.get('efficiency') or 0:>11.3f}"
            f" {s.get('balance') or 0:>8.2f} {s.get('error', '')}"
        )
    if "parallel_checkpoints" in res:
        p = res["parallel_checkpoints"]
        print(f"{p['checkpoints']} checkpoints at once vs one on one GPU: ratio {p.get('ratio')}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
