"""GPU benchmark: raw single-process vLLM vs. captionflow's inference stage vs. the whole flow.

One invocation on one GPU host, the same N images and the same work per image for all three:

  A. raw vLLM offline: one ``vllm.LLM`` in one process; every image decoded with PIL in that
     process, then one ``LLM.generate`` over all of them (what a plain script does);
  B. captionflow's inference stage (Ray Data LLM, GPU preset) over the preprocessed dataset;
  C. the whole flow, ``captionflow run`` (ingest, preprocess, inference, evaluate), in a new process.

Model: a full-size architecture stand-in (``captionflow build-model --arch``, default
Qwen2.5-VL-3B) with vLLM's random weights (``load_format="dummy"``), or ``--model DIR`` with real
weights. Every request: the same chat messages, greedy, ``ignore_eos`` and ``--max-tokens`` (64),
so every image costs the same; the same ``max_pixels`` (default 224x224, the goals' basis);
preprocessing keeps 640x480 images at their size (``max_image_side`` 640), so all three send the
same pixels to the image processor.

Each phase runs in its own process (the GPU is free between them) while this process samples GPU
utilisation and memory through NVML. Throughput is reported two ways:
  - steady (``images_per_s``): all images / (engine ready -> last result), so start-up is left
    out and the pipeline's fill is kept. A: from ``LLM()`` returning (then every image is decoded
    in-process and ``generate()`` runs). B, C: from the moment the first engine front end can take
    requests (the "vLLM engine accepting requests at" line captionflow's worker hook writes, Unix
    time); also ``images_per_s_from_engine_log``, from the engine core's earlier "init engine ...
    took" line (the basis before 2026-11-23; 5-8 s earlier, against B and C);
  - wall (``images_per_s_wall``): images / (phase start -> last result; C: -> process exit),
    start-up included (vLLM import, engine load and compile, Ray, Prefect), which N=2,000 does
    not amortise.
  - between 10% and 90% of the results (``images_per_s_10_90``, GPU figures in ``gpu_10_90``): the
    pipeline's steady state proper, without its fill (the first decode wave) and its drain (the
    last engine finishing its queue). For A this window is not the engine's: ``generate`` adds every
    input (rendering each, which paces the engine) before it collects any output, so its results
    arrive in a burst of what the core had finished meanwhile. ``engine_finished`` times A's outputs
    by the engine core's own clock instead.
  - the single-engine ceiling (A's ``ceiling``, ``ceiling_images_per_s``): after A, the same engine
    gets every request rendered first (mirrored images, new to its caches), all added at once, and
    drains them; its 10-90% rate by the engine core's clock, with the GPU figures of that window.
    ``steady_vs_ceiling`` is B's steady rate over it. ``--no-ceiling`` skips it.
``ratios`` (the headline) are steady ratios; ``ratios_wall`` include start-up; ``per_gpu_vs_seed``
is each phase's steady images/s per GPU over the seeds' 6.3. ``gpu_trace`` keeps each phase's GPU
busy %, GPU memory and host CPU busy % second by second. Each verdict run keeps ``timeline_s`` (when its log
first says each step: flow begins, checkpoint in the warm engines, dataset starts, a warm run's first request
block built and its gate open, first block back, first row in the driver, ...) and ``ray_data_progress`` (Ray
Data's reports every 10 s of the captioning dataset: per operator rows done, tasks running and why more are held
back, rows queued).

    python bench/gpu_throughput.py                 # N=2000, 224x224, all three phases
    python bench/gpu_throughput.py --n 500 --phases raw,stage
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from bench.throughput.flow import phase_flow  # noqa: E402
from bench.throughput.measure import ROOT, SEED_IMAGES_PER_S_PER_GPU, GpuSampler, run_phase  # noqa: E402
from bench.throughput.raw import phase_raw  # noqa: E402
from bench.throughput.stage import phase_stage  # noqa: E402
from bench.throughput.verdict import verdict  # noqa: E402

PHASES = {"raw": phase_raw, "stage": phase_stage, "flow": phase_flow}


# ---------------------------------------------------------------- orchestration
def prepare(a: argparse.Namespace) -> None:
    work = Path(a.work)
    if a.engine_stats:  # the phases' processes (and a local Ray's workers) inherit the interval
        a.engine_kwargs = json.dumps({**json.loads(a.engine_kwargs), "disable_log_stats": False})
        os.environ.setdefault("VLLM_LOG_STATS_INTERVAL", "1")
    if not a.images:
        from captionflow.builtin.synthetic import make_images

        folder = work / "images"
        if not (folder.is_dir() and len(list(folder.iterdir())) == a.n):
            make_images(folder, a.n)
        a.images = str(folder)
    if a.model == "builtin":
        from captionflow.builtin.model import ensure_builtin_model

        a.model = str(ensure_builtin_model())
    elif not a.model:
        from captionflow.builtin.standin import build_standin

        model_dir = work / (f"standin-{a.arch}" + (f"-{a.standin_quantization}" if a.standin_quantization else ""))
        if not model_dir.exists():
            build_standin(a.arch, model_dir, a.standin_quantization)
        a.model = str(model_dir)
        a.engine_kwargs = json.dumps({"load_format": "dummy", **json.loads(a.engine_kwargs)})
    if a.lora_rank:  # the checkpoint: a LoRA adapter of that rank over it (every module of its language model)
        from captionflow.builtin.adapter import build_adapter

        adapters = []
        for seed in range(1, a.adapters + 1):  # several: --model lists them, the stage captions them in one pass
            adapter = work / f"adapter-r{a.lora_rank}-s{seed}-{Path(a.model).name}"
            if not adapter.exists():
                build_adapter(adapter, seed=seed, base=a.model, rank=a.lora_rank, scale=0.01)
            adapters.append(str(adapter))
        a.model = ",".join(adapters)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="synthetic 640x480 JPEGs (ignored with --images)")
    ap.add_argument("--images", help="a folder of images instead of synthetic ones")
    ap.add_argument("--arch", default="qwen2.5-vl-3b", help="stand-in architecture (without --model)")
    ap.add_argument("--standin-quantization", choices=["fp8"], help="a stand-in stored in FP8 (build_standin)")
    ap.add_argument("--lora-rank", type=int, help="caption with a LoRA adapter of this rank over the model")
    ap.add_argument(
        "--adapters",
        type=int,
        default=1,
        help="with --lora-rank: this many adapters (seeds 1..K), captioned in one shared pass (stage phase only)",
    )
    ap.add_argument(
        "--model",
        help="a checkpoint folder with real weights instead of the stand-in "
        "('builtin': the tiny built-in model, for a quick check on CPU)",
    )
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu", help="the preset (cpu: a smoke test)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--max-pixels",
        type=int,
        default=224 * 224,
        help="image processor budget, all phases (default 224x224, the basis of issue #7's goals and "
        "of the host's raw baseline; 200704 = 448x448, the GPU preset's own budget)",
    )
    ap.add_argument("--max-image-side", type=int, default=640, help="preprocess bound (B, C); 640 keeps 640x480")
    ap.add_argument("--engines-per-gpu", type=int, help="whole engines per GPU (default: one)")
    ap.add_argument("--engine-kwargs", default="{}", help="extra vLLM kwargs (JSON), all phases")
    ap.add_argument(
        "--engine-stats",
        action="store_true",
        help="vLLM's statistics on, logged every second (stage, flow: engine_load_10_90 says whether the engines "
        "were starved or full; costs their front ends a little CPU)",
    )
    ap.add_argument(
        "--pipeline-config",
        default="{}",
        help="more run parameters for B and C (JSON of RunConfig fields, e.g. "
        '\'{"max_concurrent_batches": 24, "batch_size": 32}\')',
    )
    ap.add_argument(
        "--cuda-mps",
        choices=["auto", "on", "off"],
        default="auto",
        help="the pipeline's cuda_mps parameter (stage, flow); raw vLLM runs without MPS",
    )
    ap.add_argument(
        "--phases",
        default="raw,stage,flow",
        help="raw, stage, flow (throughput, N images) and verdict (run start to leaderboard row, --verdict-n images)",
    )
    ap.add_argument("--verdict-n", type=int, default=5000, help="images of the verdict phase (the first of the set)")
    ap.add_argument(
        "--verdict-phases",
        default="cold,warm_cache,warm_engines,raw",
        help="which of the verdict's runs (a lease too short for all of them: the ones that changed)",
    )
    ap.add_argument(
        "--model-b",
        help="the verdict's second checkpoint (with --model); default: random-weight checkpoints of the stand-in",
    )
    ap.add_argument("--model-c", help="the verdict's third checkpoint (warm engines; default: --model-b)")
    ap.add_argument(
        "--warm-layouts",
        help="the warm-engine verdict for each of these engine layouts in turn (a JSON list of objects with "
        "name and any of engines_per_gpu, pipeline_config, engine_kwargs, over the options above), e.g. "
        '\'[{"name":"4x512"},{"name":"2x1024","engines_per_gpu":2,"pipeline_config":{"max_num_seqs":1024}}]\'',
    )
    ap.add_argument(
        "--warm-repeats",
        type=int,
        default=0,
        help="after each layout's warm-engine run of C, this many more on the same service, swapping B and C in turn "
        "(warm_engines_repeats): several verdicts for one service start",
    )
    ap.add_argument(
        "--prefect",
        choices=["server", "ephemeral"],
        default="server",
        help="the verdict's runs report to a Prefect server started once (as deployments' runs do), or each "
        "starts Prefect's temporary server",
    )
    ap.add_argument(
        "--no-ceiling",
        dest="ceiling",
        action="store_false",
        help="raw phase: skip the single-engine ceiling (every request rendered first, then drained)",
    )
    ap.add_argument("--phase-timeout", type=float, default=900)
    ap.add_argument("--work", help="working folder (default: a new temporary one)")
    ap.add_argument("--json", help="results file (default bench/results/gpu_throughput-<gpu>.json, its kind's key)")
    ap.add_argument("--merge", action="store_true", help="keep the other phases already in --json")
    ap.add_argument("--child", choices=sorted(PHASES), help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:
        r = PHASES[a.child](a)
        Path(a.work, f"phase-{a.child}.json").write_text(json.dumps(r, indent=2))
        return 0

    a.work = a.work or tempfile.mkdtemp(prefix="cf-gpu-bench-")
    prepare(a)
    n_images = len(list(Path(a.images).iterdir()))
    results: dict = {
        "n": n_images,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "model": a.model,
        "arch": None if "--model" in sys.argv else a.arch,
        "max_tokens": a.max_tokens,
        "max_pixels": a.max_pixels,
        "max_image_side": a.max_image_side,
        "options": {
            "engine_kwargs": json.loads(a.engine_kwargs),
            "pipeline_config": json.loads(a.pipeline_config),
            "engines_per_gpu": a.engines_per_gpu,
            "cuda_mps": a.cuda_mps,
        },
        # vLLM environment variables of the run (e.g. VLLM_USE_V2_MODEL_RUNNER=0): the engines inherit them
        "vllm_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(a.json) if a.json else None
    if a.merge and out and out.exists():  # phases run by an earlier invocation on the same work folder
        earlier = json.loads(out.read_text())
        results = {**{k: v for k, v in earlier.items() if k in PHASES}, **results}
    with GpuSampler() as sampler:
        results["device"] = ", ".join(sampler.names)
        for name in a.phases.split(","):
            print(f"--- phase {name}", flush=True)
            results[name] = verdict(a, sampler) if name == "verdict" else run_phase(name, a, sampler)
            print(json.dumps({k: v for k, v in results[name].items() if k != "log_tail"}), flush=True)
            if "error" in results[name]:
                print(results[name]["log_tail"], flush=True)
            _finish(results)
            out = _write(results, out)
    _table(results)
    print("wrote", out)
    return 0


def _finish(results: dict) -> None:
    raw = results.get("raw") or {}
    ratios, wall, log_basis = {}, {}, {}
    for key, name in (("stage_vs_raw", "stage"), ("flow_vs_raw", "flow")):
        other = results.get(name) or {}
        if raw.get("images_per_s") and other.get("images_per_s"):
            ratios[key] = round(other["images_per_s"] / raw["images_per_s"], 3)
            wall[key] = round(other["images_per_s_wall"] / raw["images_per_s_wall"], 3)
            if other.get("images_per_s_from_engine_log"):
                log_basis[key] = round(other["images_per_s_from_engine_log"] / raw["images_per_s"], 3)
    results["ratios"], results["ratios_wall"] = ratios, wall
    # the pipeline against one engine draining a full queue, in this invocation: raw's ceiling pass, timed by the
    # engine core (the plain pass's 10-90% window, timed as generate() collects, bunches up outputs the core had
    # finished while inputs were still being added)
    ceiling = (raw.get("ceiling") or {}).get("images_per_s_10_90")
    stage = results.get("stage") or {}
    if ceiling and stage.get("images_per_s"):
        results["ceiling_images_per_s"] = ceiling
        # which ceiling the ratios below use: never the raw pass's 10-90% window (outputs collected in bursts)
        results["ceiling_clock"] = "engine core: one engine draining a queue filled beforehand (raw.ceiling)"
        results["steady_vs_ceiling"] = round(stage["images_per_s"] / ceiling, 3)
        if stage.get("images_per_s_10_90"):
            results["steady_10_90_vs_ceiling"] = round(stage["images_per_s_10_90"] / ceiling, 3)
    gpus = max(1, len(results.get("device", "").split(", ")))
    results["per_gpu_vs_seed"] = {
        name: round(results[name]["images_per_s"] / gpus / SEED_IMAGES_PER_S_PER_GPU, 2)
        for name in ("raw", "stage", "flow")
        if (results.get(name) or {}).get("images_per_s")
    }
    results["ratios_from_engine_log"] = log_basis
    results["ratio_basis"] = "steady-state images/s (first to last result); ratios_wall include start-up"


def _write(results: dict, out: Path | None) -> Path:
    if out is None:
        # one file per benchmark and device, gpu_throughput-<device>.json: the latest run of each kind (stage,
        # verdict) under its kind, the others' kept
        gpu = results.get("device", "gpu").split(",")[0].replace("NVIDIA ", "").replace(" ", "-").lower()
        gpu = "h100" if gpu.startswith("h100") else "h200" if gpu.startswith("h200") else gpu or "gpu"
        kind = "verdict" if "verdict" in results else "stage"
        out = ROOT / "bench" / "results" / f"gpu_throughput-{gpu}.json"
        kept = json.loads(out.read_text()) if out.exists() else {}
        results = {**kept, kind: results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    return out


def _table(results: dict) -> None:
    if "verdict" in results:
        v = results["verdict"]
        print(f"verdict (run start -> leaderboard row, {v.get('n')} images), s: {json.dumps(v.get('summary'))}")
        for lay in v.get("warm_layouts", []):
            w, tl = lay.get("warm_engines") or {}, (lay.get("warm_engines") or {}).get("timeline_s") or {}
            print(
                f"  warm layout {lay['layout'].get('name')!s:>16}: service start {lay.get('service_start_s')} s,"
                f" gate {tl.get('warm_gate_open')}, first caption {w.get('first_caption_after_s')},"
                f" last {w.get('last_caption_after_s')}, row {w.get('leaderboard_row_after_s')} ({w.get('engines')})"
                + (f" error: {w['error']}" if "error" in w else "")
            )
    cols = [n for n in ("raw", "stage", "flow") if n in results and "error" not in results[n]]
    rows = [
        ("images/s (steady)", "images_per_s"),
        ("images/s (10-90% of results)", "images_per_s_10_90"),
        ("images/s (incl. start-up)", "images_per_s_wall"),
        ("output tokens/s", "output_tokens_per_s"),
        ("first result after s", "start_to_first_result_s"),
        ("wall s", "wall_s"),
        ("mean input tokens", "mean_input_tokens"),
    ]
    print(f"{'':28}" + "".join(f"{c:>12}" for c in cols))
    for label, key in rows:
        print(f"{label:28}" + "".join(f"{results[c].get(key)!s:>12}" for c in cols))
    print(f"{'GPU busy % (steady)':28}" + "".join(f"{results[c]['gpu_steady']['gpu_busy_pct']!s:>12}" for c in cols))
    print(
        f"{'GPU busy % (10-90%)':28}"
        + "".join(f"{(results[c].get('gpu_10_90') or {}).get('gpu_busy_pct')!s:>12}" for c in cols)
    )
    finished = (results.get("raw") or {}).get("engine_finished") or {}
    if finished.get("images_per_s_10_90"):  # raw's 10-90% row above is as generate() collected
        print(f"{'raw by the engine clock 10-90%':28}{finished['images_per_s_10_90']!s:>12}")
    ceiling = (results.get("raw") or {}).get("ceiling") or {}
    if ceiling.get("images_per_s_10_90"):
        print(
            f"{'ceiling images/s (10-90%)':28}{ceiling['images_per_s_10_90']!s:>12}"
            f"  (GPU busy {(ceiling.get('gpu_10_90') or {}).get('gpu_busy_pct')}%,"
            f" rendered in {ceiling.get('render_s')} s,"
            f" added in {ceiling.get('add_s')} s)"
        )
    print(
        f"{'host CPU busy % (steady)':28}"
        + "".join(f"{results[c]['gpu_steady'].get('host_cpu_busy_pct')!s:>12}" for c in cols)
    )
    print(
        f"{'GPU memory peak GiB':28}"
        + "".join(f"{results[c]['gpu_whole_phase']['gpu_mem_peak_gib']!s:>12}" for c in cols)
    )
    print(
        f"device: {results.get('device')}  n={results['n']}  ratios: {json.dumps(results.get('ratios'))}"
        f"  steady_vs_ceiling: {results.get('steady_vs_ceiling')} (10-90%: {results.get('steady_10_90_vs_ceiling')})"
        f"  incl. start-up: {json.dumps(results.get('ratios_wall'))}"
        f"  per GPU vs the seed's {SEED_IMAGES_PER_S_PER_GPU} img/s: {json.dumps(results.get('per_gpu_vs_seed'))}"
    )


if __name__ == "__main__":
    sys.exit(main())
