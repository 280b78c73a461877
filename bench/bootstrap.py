"""Paired bootstrap cost (issue goal: 1,000 resamples over 5,000 images, every metric, <= 30 s on 2 cores).

python bench/bootstrap.py [--n 5000] [--resamples 1000] [--json bench/results/bootstrap-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from captionflow.evaluation.significance import PER_IMAGE, paired_bootstrap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[5000, 50000])
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "bootstrap-cpu.json"))
    a = ap.parse_args()
    rows = []
    for n in a.n:
        rng = np.random.default_rng(0)
        base = {f"i{i}": {m: float(rng.random()) for m in PER_IMAGE} for i in range(n)}
        other = {k: {m: v + float(rng.normal(0.01, 0.1)) for m, v in d.items()} for k, d in base.items()}
        t0 = time.perf_counter()
        res = paired_bootstrap(other, base, n_resamples=a.resamples)
        rows.append(
            {
                "images": n,
                "resamples": a.resamples,
                "metrics": len(res),
                "seconds": round(time.perf_counter() - t0, 3),
                "verdicts": {m: v["verdict"] for m, v in res.items()},
            }
        )
    print(f"{'images':>8} {'resamples':>9} {'metrics':>7} {'seconds':>8}")
    for r in rows:
        print(f"{r['images']:>8} {r['resamples']:>9} {r['metrics']:>7} {r['seconds']:>8}")
    Path(a.json).write_text(json.dumps({"cpus": os.cpu_count(), "runs": rows}, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
