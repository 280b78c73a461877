"""The evaluate stage on a large set (issue goal: 5,000 images, no judge, no CLIP, <= 60 s on 2 cores).

Two checkpoints' captions over one synthetic preprocessed set (real Parquet shards of JPEG images with five
references each): the first evaluation has nothing to compare with; the second runs everything a comparison
adds - the paired bootstrap, the side-by-side view, thumbnails, the chart, report.html.

python bench/evaluate_stage.py [--n 5000] [--resamples 1000] [--json bench/results/evaluate_stage-cpu.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from captionflow.data.layout import CAPTIONS, SHARDS, dataset_parts, run_parts
from captionflow.data.storage import Store
from captionflow.evaluation.evaluate import evaluate
from captionflow.results import Counts, InferenceResult, Manifest
from captionflow.workers.llm_rows import CAPTION_SCHEMA

WORDS = [
    "a",
    "the",
    "dog",
    "cat",
    "man",
    "woman",
    "red",
    "blue",
    "green",
    "car",
    "street",
    "tree",
    "sits",
    "runs",
    "on",
    "in",
    "with",
    "near",
    "large",
    "small",
    "two",
]


def _sentence(rng: np.random.Generator, n: int = 9) -> str:
    return " ".join(rng.choice(WORDS, size=n))


def build(root: str, n: int, shard_rows: int = 1000) -> tuple[Manifest, list[str], dict[str, list[str]]]:
    rng = np.random.default_rng(0)
    store = Store(root)
    ids, refs, shards = [], {}, []
    for start in range(0, n, shard_rows):
        rows = []
        for i in range(start, min(n, start + shard_rows)):
            buf = io.BytesIO()
            Image.new("RGB", (224, 168), tuple(int(x) for x in rng.integers(0, 255, 3))).save(buf, format="JPEG")
            image_id = f"{i:08x}"
            refs[image_id] = [_sentence(rng) for _ in range(5)]
            ids.append(image_id)
            rows.append({"image_id": image_id, "source": f"s{i % 4}/{i}.jpg", "image": buf.getvalue(),
                         "references": refs[image_id]})  # fmt: skip
        name = f"part-{len(shards):05d}.parquet"
        store.write_table(pa.Table.from_pylist(rows), *dataset_parts("bench-ds"), SHARDS, name)
        shards.append(name)
    manifest = Manifest("bench-ds", 1, "synthetic", "images", Counts(n, n, 0, 0), {}, shards, {}, 0.0)
    return manifest, ids, refs


def captions(store: Store, model: str, ids: list[str], refs: dict[str, list[str]], closeness: float) -> InferenceResult:
    """A checkpoint's captions: each is a reference with probability ``closeness``, else a random sentence."""
    rng = np.random.default_rng(hash(model) % 2**32)
    run = run_parts("bench-ds", model, "gen")
    rows = [
        {"image_id": i, "caption": refs[i][0] if rng.random() < closeness else _sentence(rng), "finish_reason": "stop",
         "num_input_tokens": 100, "num_output_tokens": 9, "model_fingerprint": model, "error": "", "attempt": 0}
        for i in ids
    ]  # fmt: skip
    store.write_table(pa.Table.from_pylist(rows, schema=CAPTION_SCHEMA), *run, CAPTIONS, "part-0.parquet")
    return InferenceResult(store.url(*run), run, len(ids), len(ids), 0, 0, [], {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "evaluate_stage-cpu.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        t0 = time.perf_counter()
        manifest, ids, refs = build(root, a.n)
        build_s = time.perf_counter() - t0
        store = Store(root)
        rows = []
        for model, closeness in (("ckpt-1", 0.2), ("ckpt-2", 0.4)):
            inference = captions(store, model, ids, refs, closeness)
            t0 = time.perf_counter()
            res = evaluate(root, manifest, inference, model, bootstrap_resamples=a.resamples)
            seconds = time.perf_counter() - t0
            sig = (res.metrics["comparison"].get("previous") or {}).get("significance") or {}
            html = Path(root, *inference.run_parts, "report.html").stat().st_size
            rows.append(
                {
                    "checkpoint": model,
                    "images": a.n,
                    "compared": bool(sig),
                    "seconds": round(seconds, 2),
                    "cider": round(res.metrics["reference"]["cider"], 4),
                    "verdict_cider": sig.get("cider", {}).get("verdict"),
                    "report_html_kb": html // 1024,
                }
            )
    print(f"synthetic set of {a.n} images built in {build_s:.1f} s")
    print(
        f"{'checkpoint':>10} {'images':>7} {'compared':>8} {'seconds':>8} {'cider':>7} {'verdict':>10} {'html KB':>8}"
    )
    for r in rows:
        print(
            f"{r['checkpoint']:>10} {r['images']:>7} {r['compared']!s:>8} {r['seconds']:>8} {r['cider']:>7} "
            f"{r['verdict_cider'] or '-':>10} {r['report_html_kb']:>8}"
        )
    Path(a.json).write_text(json.dumps({"cpus": os.cpu_count(), "runs": rows}, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
