"""Deterministic synthetic photos for the benchmarks: distinct 640x480 JPEGs, fast to make."""

from __future__ import annotations

import os
import random
from pathlib import Path

PARALLEL_FROM = 4000  # images: from this many on, the JPEGs are encoded by a pool of processes (the same files)


def make_images(folder: Path, n: int, size=(640, 480), seed: int = 0, quality: int = 90) -> Path:
    """n distinct JPEGs: random crops of one large textured canvas, each stamped with its index. Each image's
    crop and stamp colour are drawn in order from one seeded generator, so the files are the same however many
    processes encode them (a GPU host's 64,000 images: seconds on its cores instead of minutes on one)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    w, h = size
    cw, ch = w * 4, h * 4
    yy, xx = np.mgrid[0:ch, 0:cw]
    canvas = np.stack([(xx * 0.37 + yy * 0.11) % 256, (xx * 0.05 + yy * 0.29) % 256, (xx * yy * 0.0007) % 256], -1)
    canvas = (canvas + np.random.default_rng(seed).integers(0, 48, size=canvas.shape)).clip(0, 255).astype("uint8")
    jobs = []
    for i in range(n):
        x, y = rng.randrange(cw - w), rng.randrange(ch - h)
        jobs.append((i, x, y, (rng.randrange(256), rng.randrange(256), rng.randrange(256))))
    workers = min(os.cpu_count() or 1, 64) if n >= PARALLEL_FROM else 1
    if workers > 1:
        import multiprocessing

        chunks = [jobs[k::workers] for k in range(workers)]
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            pool.starmap(_encode, [(canvas, folder, size, quality, c) for c in chunks])
    else:
        _encode(canvas, folder, size, quality, jobs)
    return folder


def _encode(canvas, folder: Path, size, quality: int, jobs: list) -> None:
    from PIL import Image, ImageDraw

    base = Image.fromarray(canvas)
    w, h = size
    for i, x, y, color in jobs:
        im = base.crop((x, y, x + w, y + h))
        d = ImageDraw.Draw(im)
        d.rectangle([10, 10, 150, 40], fill=color)
        d.text((16, 18), f"#{i:06d}", fill=(0, 0, 0))
        im.save(folder / f"img_{i:06d}.jpg", quality=quality)
