"""Benchmark: captionflow's inference stage vs. raw ``vllm.LLM.generate`` on the same images.

Both sides use the same model, the same preprocessed images (JPEG bytes from the preprocess
stage), the same requests (prompt and image array), the same sampling parameters and the same engine settings (the
preset of ``--device``). Run in one invocation so the ratio is measured under the same load:

    python bench/inference_vs_raw.py --n 192 --device cpu

Prints a short table and writes JSON (``--json``, default bench/results/inference_vs_raw-<device>.json).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout


def raw_vllm(cfg, model_path: str, rows: list[dict], preset) -> dict:
    """One vllm.LLM in this process, generating for all rows: the same requests the stage sends."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    from vllm import LLM, SamplingParams

    from captionflow.engines.request_format import image_prompt
    from captionflow.workers.llm_rows import caption_request

    t0 = time.perf_counter()
    engine_kwargs = {
        "max_num_seqs": cfg.max_num_seqs or preset.max_num_seqs,
        "max_model_len": cfg.max_model_len or preset.max_model_len,
        "limit_mm_per_prompt": {"image": 1, "video": 0},
        **preset.engine_kwargs,
    }
    llm = LLM(model=model_path, **engine_kwargs)
    t_engine = time.perf_counter() - t0
    sampling = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed}
    t1 = time.perf_counter()
    prompts = []
    for r in rows:
        req = caption_request(
            dict(r),
            image_prompt=image_prompt(model_path),
            system_prompt=cfg.system_prompt,
            prompt=cfg.prompt,
            sampling=sampling,
            fail_ids=frozenset(),
        )
        prompts.append({"prompt": req["prompt"], "multi_modal_data": req["multimodal_data"]})
    outs = llm.generate(
        prompts,
        SamplingParams(**sampling),
        mm_processor_kwargs={"max_pixels": cfg.max_pixels or preset.max_pixels},
        use_tqdm=False,
    )
    t_gen = time.perf_counter() - t1
    n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    return {
        "engine_start_s": round(t_engine, 2),
        "generate_s": round(t_gen, 2),
        "total_s": round(time.perf_counter() - t0, 2),
        "rows": len(outs),
        "output_tokens": n_tok,
        "rows_per_s_steady": round(len(outs) / t_gen, 3),
        "rows_per_s_total": round(len(outs) / (time.perf_counter() - t0), 3),
    }


def stage(cfg, manifest, model) -> dict:
    """captionflow's inference stage (Ray Data LLM), timed from shard commit times."""
    from captionflow.data.storage import Store
    from captionflow.engines.engine import resolve_engine
    from captionflow.engines.presets import PRESETS
    from captionflow.errors import RowsFailed
    from captionflow.stages.inference import run_inference

    engine = resolve_engine(cfg, model, PRESETS[cfg.device])

    t0 = time.perf_counter()
    wall0 = time.time_ns()
    try:
        res = run_inference(cfg, manifest, model, engine)
    except RowsFailed as e:
        res = e.result
    total = time.perf_counter() - t0
    store = Store(cfg.output)
    shards = store.ls(*res.run_parts, "captions", suffix=".parquet")
    stamps = sorted((int(os.path.basename(p).split("-")[1]), store.read_table(p).num_rows) for p in shards)
    t_first = (stamps[0][0] - wall0) / 1e9
    t_last = (stamps[-1][0] - wall0) / 1e9
    after_first = sum(n for _, n in stamps[1:])
    steady = after_first / (t_last - t_first) if t_last > t_first else float("nan")
    return {
        "ray_init_s": res.timings_s.get("ray_init_s"),
        "first_commit_s": round(t_first, 2),
        "total_s": round(total, 2),
        "rows": res.captioned,
        "failed": res.failed,
        "rows_per_s_steady": round(steady, 3),
        "rows_per_s_total": round(res.captioned / total, 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=192)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--images", help="a folder of images instead of synthetic ones")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", help="where to write the results")
    args = ap.parse_args()

    from captionflow.config import RunConfig
    from captionflow.data.layout import shard_paths
    from captionflow.data.sources import ingest
    from captionflow.data.storage import Store
    from captionflow.engines.presets import PRESETS
    from captionflow.engines.session import ray_session
    from captionflow.model_source import resolve_model
    from captionflow.stages.preprocess import preprocess

    work = Path(tempfile.mkdtemp(prefix="cf-bench-"))
    images = Path(args.images) if args.images else work / "images"
    if not args.images:
        from captionflow.builtin.synthetic import make_images

        make_images(images, args.n)
    cfg = RunConfig(
        dataset=str(images), output=str(work / "out"), device=args.device, max_tokens=args.max_tokens, commit_rows=8
    )
    preset = PRESETS[args.device]
    model = resolve_model(cfg.model)
    t_ray = time.perf_counter()
    ray_session(cfg)
    ray_init_s = round(time.perf_counter() - t_ray, 2)
    manifest = preprocess(ingest(cfg), cfg)
    store = Store(cfg.output)
    table = store.read_tables(shard_paths(store, manifest), columns=["image_id", "image"])
    rows = table.to_pylist()

    results = {
        "device": args.device,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "n": len(rows),
        "max_tokens": args.max_tokens,
        "model": cfg.model,
    }
    results["raw_vllm"] = raw_vllm(cfg, model.path, rows, preset)
    results["stage"] = stage(cfg, manifest, model)
    results["stage"]["ray_init_s"] = ray_init_s  # Ray was started before preprocess, which uses it too
    a, b = results["raw_vllm"], results["stage"]
    results["ratios"] = {
        "stage_vs_raw_steady": round(b["rows_per_s_steady"] / a["rows_per_s_steady"], 3),
        "stage_vs_raw_total": round(b["rows_per_s_total"] / a["rows_per_s_total"], 3),
    }
    print(f"{'':22}{'raw vLLM':>12}{'stage':>12}")
    print(f"{'rows/s steady':22}{a['rows_per_s_steady']:>12}{b['rows_per_s_steady']:>12}")
    print(f"{'rows/s incl. start':22}{a['rows_per_s_total']:>12}{b['rows_per_s_total']:>12}")
    print(f"{'start (engine / ray)':22}{a['engine_start_s']:>12}{b['ray_init_s']!s:>12}")
    print(f"{'first result s':22}{a['engine_start_s']:>12}{b['first_commit_s']:>12}")
    print(f"{'total s':22}{a['total_s']:>12}{b['total_s']:>12}")
    print("ratios:", json.dumps(results["ratios"]))
    out = Path(args.json or Path(__file__).parent / "results" / f"inference_vs_raw-{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
