"""The built-in demo (golden) dataset, assembled at run time from photos that installed packages ship.

Sources: scikit-image's ``skimage/data``, scikit-learn's sample images and matplotlib's
``sample_data``. No photo is committed to the repository. Each image carries reference captions
written for it here; a few deliberately faulty files test the quarantine.

The folder is written once into the cache (atomic rename), so its listing (names, sizes, mtimes)
stays stable across runs and the preprocessed golden set is reused.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
from pathlib import Path

DEMO_NAME = "demo"
DEMO_VERSION = "2"
CAPTIONS_FILE = "captions.jsonl"

# file name in the demo folder -> (package, path inside the package's data folder)
_SOURCES: dict[str, tuple[str, str]] = {
    "astronaut.png": ("skimage", "astronaut.png"),
    "brick.png": ("skimage", "brick.png"),
    "camera.png": ("skimage", "camera.png"),
    "cell.png": ("skimage", "cell.png"),
    "chelsea_cat.png": ("skimage", "chelsea.png"),
    "clock_motion.png": ("skimage", "clock_motion.png"),
    "coffee.png": ("skimage", "coffee.png"),
    "coins.png": ("skimage", "coins.png"),
    "grass.png": ("skimage", "grass.png"),
    "gravel.png": ("skimage", "gravel.png"),
    "horse.png": ("skimage", "horse.png"),
    "hubble_deep_field.jpg": ("skimage", "hubble_deep_field.jpg"),
    "ihc.png": ("skimage", "ihc.png"),
    "microaneurysms.png": ("skimage", "microaneurysms.png"),
    "moon.png": ("skimage", "moon.png"),
    "motorcycle_left.png": ("skimage", "motorcycle_left.png"),
    "motorcycle_right.png": ("skimage", "motorcycle_right.png"),
    "page.png": ("skimage", "page.png"),
    "retina.jpg": ("skimage", "retina.jpg"),
    "rocket.jpg": ("skimage", "rocket.jpg"),
    "text.png": ("skimage", "text.png"),
    "china.jpg": ("sklearn", "datasets/images/china.jpg"),
    "flower.jpg": ("sklearn", "datasets/images/flower.jpg"),
    "grace_hopper.jpg": ("matplotlib", "grace_hopper.jpg"),
    "present.png": ("matplotlib", "Minduka_Present_Blue_Pack.png"),
    "mri_brain.png": ("matplotlib", "s1045.ima.gz"),  # 16-bit MRI slice, converted below
}

DEMO_CAPTIONS: dict[str, list[str]] = {
    "astronaut.png": [
        "A smiling astronaut in an orange flight suit poses in front of an American flag.",
        "Official portrait of a woman astronaut holding a helmet with a space shuttle model behind her.",
    ],
    "brick.png": [
        "A grey brick wall with long rectangular bricks laid in rows.",
        "Close up of a brick pavement in black and white.",
    ],
    "camera.png": [
        "A man in a dark coat looks through a camera mounted on a tripod in a field.",
        "Black and white photo of a photographer with a tripod camera outdoors.",
    ],
    "cell.png": [
        "A single bright round cell on a grey background under a microscope.",
        "Microscope image of one cell in a blurry grey field.",
    ],
    "chelsea_cat.png": [
        "Close up of a tabby cat with green eyes looking to the side.",
        "The face of a brown striped cat.",
    ],
    "clock_motion.png": [
        "A blurred image of a clock moving across a grey background.",
        "Motion blur of a round object against a light grey wall.",
    ],
    "coffee.png": [
        "A cup of coffee on a red saucer with a spoon on a wooden table.",
        "An espresso in a red cup seen from above.",
    ],
    "coins.png": [
        "Rows of old coins on a dark background in black and white.",
        "Many silver coins arranged in a grid.",
    ],
    "grass.png": [
        "A close up of green grass blades in black and white.",
        "Texture of dense grass seen from above.",
    ],
    "gravel.png": [
        "A patch of small grey gravel stones.",
        "Close up texture of pebbles on the ground.",
    ],
    "horse.png": [
        "The black silhouette of a horse standing on a white background.",
        "A horse shown as a black shape in profile.",
    ],
    "hubble_deep_field.jpg": [
        "Many distant galaxies and stars on a black sky.",
        "A deep space telescope image full of small colourful galaxies.",
    ],
    "ihc.png": [
        "Tissue under a microscope stained brown and blue.",
        "A stained tissue sample with brown cell borders.",
    ],
    "microaneurysms.png": [
        "A grey close up of blood vessels in the retina.",
        "Small dark spots and thin vessels on a grey background.",
    ],
    "moon.png": [
        "The grey surface of the moon with craters.",
        "A close up of a lunar landscape in black and white.",
    ],
    "motorcycle_left.png": [
        "A red motorcycle parked in a garage with shelves behind it.",
        "A red and black motorbike standing indoors next to boxes.",
    ],
    "motorcycle_right.png": [
        "A red motorcycle in a workshop seen from the side.",
        "A parked red motorbike in front of storage shelves.",
    ],
    "page.png": [
        "A page of printed text about region based segmentation.",
        "A scanned page of a book with a heading and a paragraph of text.",
    ],
    "retina.jpg": [
        "A photo of the retina of a human eye with red blood vessels.",
        "An orange and red image of the back of an eye.",
    ],
    "rocket.jpg": [
        "A rocket on a launch pad at night between tall towers.",
        "A white rocket standing upright under a dark blue sky.",
    ],
    "text.png": [
        "Handwritten symbols on a sheet of paper in grey tones.",
        "A close up of handwriting on paper.",
    ],
    "china.jpg": [
        "A tall Chinese temple with red pillars on a hill with trees.",
        "A traditional pagoda building beside a lake on a sunny day.",
    ],
    "flower.jpg": [
        "An orange dahlia flower in front of dark green leaves.",
        "A close up of a round orange flower in a garden.",
    ],
    "grace_hopper.jpg": [
        "An older woman in a navy uniform and cap in front of an American flag.",
        "A formal portrait of a naval officer wearing glasses.",
    ],
    "present.png": [
        "A blue gift box tied with a silver ribbon and a bow.",
        "A wrapped blue present on a white background.",
    ],
    "mri_brain.png": [
        "A grey MRI scan of a human head seen from the side.",
        "A black and white medical scan of a brain.",
    ],
}

# name -> why it is faulty (the ingest stage must quarantine each with a reason)
FAULTY_FILES = {
    "empty.jpg": "an empty file",
    "truncated_rocket.jpg": "the first half of a JPEG",
    "random_bytes.png": "random bytes with an image name",
    "error_page.jpg": "an HTML error page saved with an image name",
}

# hidden entries a folder copied from a laptop carries: not inputs, counted in the run summary
HIDDEN_FILES = {".DS_Store": b"\x00\x00\x00\x01Bud1" + bytes(2048)}


def _package_file(package: str, rel: str) -> Path:
    if package == "matplotlib":
        import matplotlib

        return Path(matplotlib.get_data_path()) / "sample_data" / rel
    mod = __import__(package)
    base = Path(mod.__file__).parent
    return base / ("data" if package == "skimage" else "") / rel


def _write_image(name: str, src: Path, out: Path) -> None:
    if src.name == "s1045.ima.gz":
        import numpy as np
        from PIL import Image

        raw = gzip.decompress(src.read_bytes())
        arr = np.frombuffer(raw, dtype="<u2").reshape(256, 256)
        buf = io.BytesIO()
        Image.fromarray(arr.astype(np.uint16)).save(buf, format="PNG")  # 16-bit greyscale PNG
        (out / name).write_bytes(buf.getvalue())
    else:
        shutil.copyfile(src, out / name)


def build_demo_dataset(out_dir: str | os.PathLike) -> Path:
    """Write the demo folder (images, faulty files, ``captions.jsonl``) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True)
    for name, (package, rel) in _SOURCES.items():
        src = _package_file(package, rel)
        if not src.exists():
            raise FileNotFoundError(f"demo image {name}: {src} is missing from the installed {package}")
        _write_image(name, src, out)
    (out / "empty.jpg").write_bytes(b"")
    rocket = (out / "rocket.jpg").read_bytes()
    (out / "truncated_rocket.jpg").write_bytes(rocket[: len(rocket) // 2])
    import random

    rng = random.Random(1234)
    (out / "random_bytes.png").write_bytes(bytes(rng.getrandbits(8) for _ in range(4096)))
    (out / "error_page.jpg").write_bytes(
        b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head>"
        b"<body><h1>502 Bad Gateway</h1></body></html>\n"
    )
    for name, data in HIDDEN_FILES.items():
        (out / name).write_bytes(data)
    with open(out / CAPTIONS_FILE, "w", encoding="utf-8") as fh:
        for name in sorted(DEMO_CAPTIONS):
            fh.write(json.dumps({"file_name": name, "captions": DEMO_CAPTIONS[name]}) + "\n")
    return out


def ensure_demo_dataset(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the demo folder in the cache, assembling it on first use."""
    from captionflow.data.cache import build_once, default_cache_dir

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_once(cache / "datasets" / f"{DEMO_NAME}-v{DEMO_VERSION}", CAPTIONS_FILE, build_demo_dataset)
