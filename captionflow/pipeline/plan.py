"""How many GPUs a batch needs to be captioned by a deadline, from the rates measured on the host's kind of GPU.

The measurements are ``bench/gpu_scaling.py``'s (``bench/results/gpu_scaling-<gpu>.json``: the inference stage's
steady images/s on 1, 2, 4 GPUs of one host, and when its engines first accepted requests). A run on G GPUs takes
about ``start + images / (G x rate(1) x efficiency(G))``: ``start`` the slowest measured engine start, the
efficiency the one measured at G (beyond the largest G measured: the lowest measured at 2 or more, so the answer
errs long). Preprocessing is not in it (a golden set skips it). docs/sizing.md says how to measure a host.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@dataclass(frozen=True)
class Scaling:
    device: str  # the GPU, as the file names it (h200, h100)
    source: str  # the file
    rate_1: float  # images/s on one GPU
    efficiency: dict[int, float]  # G -> rate(G) / (G x rate(1)), measured
    start_s: float  # engines loading, before the first request is accepted (the slowest measured)

    def seconds(self, images: int, gpus: int) -> float:
        return self.start_s + images / (gpus * self.rate_1 * self.efficiency_at(gpus))

    def efficiency_at(self, gpus: int) -> float:
        if gpus in self.efficiency:
            return self.efficiency[gpus]
        below = [g for g in self.efficiency if g < gpus]
        if gpus > max(self.efficiency):
            return min((e for g, e in self.efficiency.items() if g >= 2), default=1.0)
        return self.efficiency[max(below)] if below else 1.0


def load_scaling(device: Optional[str] = None, results: Path = RESULTS) -> Scaling:
    """The measured scaling of ``device`` (a GPU's short name, e.g. h200; default: the only one measured)."""
    files = sorted(results.glob("gpu_scaling-*.json")) if results.is_dir() else []
    found = {f.stem.removeprefix("gpu_scaling-"): f for f in files}
    if not found:
        raise ValueError(f"no measured GPU rates in {results}: run bench/gpu_scaling.py on a GPU host first")
    if device is None and len(found) > 1:
        raise ValueError(f"measured GPUs: {', '.join(sorted(found))}; choose one with --gpu")
    name = device.lower() if device else next(iter(found))
    if name not in found:
        raise ValueError(f"no measured rates for {device!r} in {results} (measured: {', '.join(sorted(found))})")
    data = json.loads(found[name].read_text())
    rows = [s for s in data["scaling"] if s.get("images_per_s")]
    one = next((s for s in rows if s["gpus"] == 1), None)
    if one is None:
        raise ValueError(f"{found[name]}: no measurement on one GPU")
    starts = [min(s["engines_accepting_after_s"]) for s in rows if s.get("engines_accepting_after_s")]
    return Scaling(
        device=name,
        source=str(found[name]),
        rate_1=float(one["images_per_s"]),
        efficiency={int(s["gpus"]): float(s["images_per_s"]) / (s["gpus"] * one["images_per_s"]) for s in rows},
        start_s=max(starts) if starts else 60.0,
    )


def plan(images: int, deadline_s: float, scaling: Scaling, max_gpus: int = 1024) -> dict:
    """The fewest GPUs that caption ``images`` within ``deadline_s``, the time they are projected to take and the
    margin; ``gpus`` None when not even ``max_gpus`` would (or the engines' start alone is too long)."""
    if images < 1 or deadline_s <= 0:
        raise ValueError("plan: images and the deadline must be more than 0")
    need = None
    for g in range(1, max_gpus + 1):
        if scaling.seconds(images, g) <= deadline_s:
            need = g
            break
    g = need or max_gpus
    projected = scaling.seconds(images, g)
    return {
        "images": images,
        "deadline_s": deadline_s,
        "gpus": need,
        "engines_per_gpu": 4,  # the GPU preset's layout on an 80-141 GB GPU (pipeline/presets.py)
        "projected_s": round(projected, 1),
        "spare_s": round(deadline_s - projected, 1),
        "images_per_s": round(images / max(projected - scaling.start_s, 1e-9), 1),
        "device": scaling.device,
        "rate_per_gpu": scaling.rate_1,
        "efficiency": round(scaling.efficiency_at(g), 3),
        "start_s": scaling.start_s,
        "source": scaling.source,
        "note": "" if math.isfinite(projected) else "no finite projection",
    }
