"""Deterministic synthetic photos for the benchmarks: distinct 640x480 JPEGs, fast to make."""

from __future__ import annotations

import random
from pathlib import Path


def make_images(folder: Path, n: int, size=(640, 480), seed: int = 0, quality: int = 90) -> Path:
    """n distinct JPEGs: random crops of one large textured canvas, each stamped with its index."""
    import numpy as np
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    w, h = size
    cw, ch = w * 4, h * 4
    yy, xx = np.mgrid[0:ch, 0:cw]
    canvas = np.stack([(xx * 0.37 + yy * 0.11) % 256, (xx * 0.05 + yy * 0.29) % 256, (xx * yy * 0.0007) % 256], -1)
    canvas = (canvas + np.random.default_rng(seed).integers(0, 48, size=canvas.shape)).clip(0, 255).astype("uint8")
    base = Image.fromarray(canvas)
    for i in range(n):
        x, y = rng.randrange(cw - w), rng.randrange(ch - h)
        im = base.crop((x, y, x + w, y + h))
        d = ImageDraw.Draw(im)
        d.rectangle([10, 10, 150, 40], fill=(rng.randrange(256), rng.randrange(256), rng.randrange(256)))
        d.text((16, 18), f"#{i:06d}", fill=(0, 0, 0))
        im.save(folder / f"img_{i:06d}.jpg", quality=quality)
    return folder
