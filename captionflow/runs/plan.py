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


# ---------------------------------------------------------------- another model, other settings: by FLOPs per image
BASIS_ARCH = "qwen2.5-vl-3b"  # what bench/gpu_scaling.py measures (its JSON's max_pixels and max_tokens)
PROMPT_TEXT_TOKENS = 55  # the chat template, system prompt and instruction around the image (119 - 64 at 224 px)
PATCH = 14  # the vision tower's patch side, in pixels; 2 x 2 patches merge into one image token


def flops_per_image(config: dict, max_pixels: int, output_tokens: int) -> float:
    """Forward FLOPs to caption one image (about 2 per weight per token): the vision tower over its patches, the
    merger, and the language model over the prompt, the image tokens and the caption, with the LM head for each
    token it generates. Attention's own FLOPs (a few percent at these lengths) are left out."""
    v, t = config["vision_config"], config.get("text_config") or config
    patches = max_pixels / PATCH**2
    image_tokens = patches / 4
    h, i, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    vision = depth * (4 * h * h + 3 * h * i) * patches + (16 * h * h + 4 * h * v["out_hidden_size"]) * image_tokens
    d, inter, layers = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    kv = t["num_key_value_heads"] * (d // t["num_attention_heads"])
    per_token = layers * (2 * d * d + 2 * d * kv + 3 * d * inter)
    text = per_token * (PROMPT_TEXT_TOKENS + image_tokens + output_tokens) + d * t["vocab_size"] * output_tokens
    return 2.0 * (vision + text)


def model_config(model: Optional[str] = None, arch: Optional[str] = None) -> tuple[dict, str]:
    """(config.json, its name) of a checkpoint folder ``model`` or a known architecture ``arch``; ValueError in
    one line for neither."""
    if arch:
        from captionflow.builtin.standin import ARCHES, arch_config

        if arch not in ARCHES:
            raise ValueError(f"plan: unknown architecture {arch!r}; known: {', '.join(sorted(ARCHES))}")
        return arch_config(arch), arch
    if model:
        path = Path(model) / "config.json"
        try:
            return json.loads(path.read_text()), str(model)
        except (OSError, ValueError) as e:
            raise ValueError(f"plan: {model!r} is not a checkpoint folder with a config.json ({e})") from None
    raise ValueError("plan: give --model PATH or --arch NAME")


def for_model(
    scaling: Scaling, config: dict, name: str, max_pixels: int, max_tokens: int, basis: dict
) -> tuple[Scaling, str]:
    """``scaling`` (measured for ``basis``: its arch, max_pixels and max_tokens) scaled to another model or other
    settings by FLOPs per image, at the same share of the GPU's peak; and the one line that says so."""
    from captionflow.builtin.standin import arch_config

    measured = flops_per_image(arch_config(basis["arch"]), basis["max_pixels"], basis["max_tokens"])
    wanted = flops_per_image(config, max_pixels, max_tokens)
    scaled = Scaling(
        device=scaling.device,
        source=scaling.source,
        rate_1=scaling.rate_1 * measured / wanted,
        efficiency=scaling.efficiency,
        start_s=scaling.start_s,
    )
    side = round(max_pixels**0.5)
    if name == basis["arch"] and (max_pixels, max_tokens) == (basis["max_pixels"], basis["max_tokens"]):
        return scaled, f"measured: {name} at {side} px, {max_tokens} tokens on {scaling.device} ({scaling.source})"
    line = (
        f"{name} at {side} px, {max_tokens} tokens: {wanted / 1e12:.2f} TFLOP an image, the measured "
        f"{basis['arch']} at {round(basis['max_pixels'] ** 0.5)} px, {basis['max_tokens']} tokens "
        f"({scaling.rate_1:.0f} images/s on one {scaling.device}: {measured / 1e12:.2f} TFLOP) scaled by FLOPs, "
        "at the same share of the GPU's peak; not measured for this model"
    )
    return scaled, line


def basis(results: Path, device: str) -> dict:
    """What the scaling measurement of ``device`` captioned: its architecture, pixels and tokens."""
    data = json.loads((results / f"gpu_scaling-{device}.json").read_text())
    return {
        "arch": data.get("arch") or BASIS_ARCH,
        "max_pixels": int(data.get("max_pixels") or 224 * 224),
        "max_tokens": int(data.get("max_tokens") or 64),
    }
