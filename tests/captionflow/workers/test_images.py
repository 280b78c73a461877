from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from captionflow.workers.images import REASONS, Rejected, normalise_image


def _png(im: Image.Image, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, format="PNG", **kw)
    return b.getvalue()


def _reason(data: bytes, **kw) -> str:
    with pytest.raises(Rejected) as e:
        normalise_image(data, max_side=448, **kw)
    assert e.value.reason in REASONS
    return e.value.reason


def test_rgba_is_composited_on_white():
    im = Image.new("RGBA", (64, 64), (255, 0, 0, 0))  # fully transparent red
    n = normalise_image(_png(im), max_side=448)
    px = Image.open(io.BytesIO(n.data)).getpixel((10, 10))
    assert all(c > 245 for c in px)


def test_16bit_greyscale_and_cmyk_become_rgb():
    im16 = Image.new("I;16", (80, 60))
    im16.putpixel((0, 0), 65535)
    for data in (_png(im16), _jpeg(Image.new("CMYK", (80, 60), (0, 255, 255, 0)))):
        n = normalise_image(data, max_side=448)
        assert Image.open(io.BytesIO(n.data)).mode == "RGB"


def _jpeg(im: Image.Image) -> bytes:
    b = io.BytesIO()
    im.save(b, format="JPEG")
    return b.getvalue()


def test_long_side_is_bounded_and_ids_are_content_hashes():
    data = _jpeg(Image.new("RGB", (1000, 500), "blue"))
    n = normalise_image(data, max_side=448)
    assert (n.width, n.height) == (448, 224)
    assert normalise_image(data, max_side=100).image_id == n.image_id
    assert normalise_image(_jpeg(Image.new("RGB", (1000, 500), "red")), max_side=448).image_id != n.image_id


def test_exif_orientation_is_applied():
    im = Image.new("RGB", (100, 50), "green")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees
    b = io.BytesIO()
    im.save(b, format="JPEG", exif=exif.tobytes())
    n = normalise_image(b.getvalue(), max_side=448)
    assert (n.width, n.height) == (50, 100)


def test_rejections_have_reasons():
    assert _reason(b"") == "empty_file"
    assert _reason(b"<html><body>not found</body></html>") == "not_an_image"
    assert _reason(_jpeg(Image.new("RGB", (300, 300), "red"))[:300]) == "decode_error"
    assert _reason(_png(Image.new("RGB", (4, 4)))) == "too_small"
    assert _reason(_png(Image.new("RGB", (5000, 12)))) == "extreme_aspect_ratio"
    assert _reason(_png(Image.new("L", (3000, 3000))), max_input_pixels=1_000_000) == "too_many_pixels"


def test_a_storage_error_or_a_surprise_costs_its_item_not_its_block():
    """A storage client's own exception (not an OSError: botocore lets some through) quarantines that
    file as unreadable; any other surprise in one item is that item's decode_error; the rest of the
    block is processed (a raised exception would have failed the block: retries, then items alone)."""
    import fsspec.implementations.memory as memory
    import pyarrow as pa

    from captionflow.workers.decode import ItemProcessor

    class FlakyStore(memory.MemoryFileSystem):
        def cat_file(self, path, *args, **kwargs):
            if path.endswith("b.png"):
                raise RuntimeError("the storage client's own error")
            return super().cat_file(path, *args, **kwargs)

    fs = FlakyStore()
    fs.store.clear()
    for name in ("a.png", "b.png", "c.png"):
        fs.pipe_file(f"/cf/{name}", _png(Image.new("RGB", (40, 30), "red")))
    items = [
        {
            "path": f"/cf/{n}".encode(),
            "name": n,
            "size": 1,
            "problem": "",
            "row_group": -1,
            "first_row": 0,
            "rows": 1,
            "item": i,
        }
        for i, n in enumerate(("a.png", "b.png", "c.png"))
    ]
    items.append({**items[0], "name": "malformed", "size": None, "item": 3})  # a bug in the stage, met in the worker
    run_block = ItemProcessor(
        fs=fs,
        kind="images",
        image_column=None,
        caption_column=None,
        references={},
        max_side=448,
        max_pixels=10**8,
        max_bytes=2**30,
    )
    out = run_block(pa.Table.from_pylist(items)).to_pylist()
    assert [(r["source"], r["reason"]) for r in out] == [
        ("a.png", ""),
        ("b.png", "unreadable"),
        ("c.png", ""),
        ("malformed", "decode_error"),
    ]
    assert "RuntimeError: the storage client's own error" in out[1]["detail"]
    assert "unexpected TypeError" in out[3]["detail"] and [r["item"] for r in out] == [0, 1, 2, 3]


WATCHDOG_PROBE = r"""
import sys, time
from captionflow.workers import decode as p
for s in sys.argv[1:]:  # one process serving several stages in turn (a pooled Ray worker)
    p.start_watchdog(float(s) or None)
p._DECODING[0] = (time.monotonic(), "stuck.jpg")
time.sleep(3)
print("still alive")
"""


def test_the_decode_watchdog_applies_the_latest_stages_limit():
    import subprocess
    import sys

    def run(*limits):
        return subprocess.run(
            [sys.executable, "-c", WATCHDOG_PROBE, *map(str, limits)], capture_output=True, text=True, timeout=60
        )

    ended = run(100, 1)  # the first stage's 100 s would not have fired within 3 s
    assert ended.returncode == 75 and "'stuck.jpg' still decoding after 1 s" in ended.stderr, ended
    kept = run(1, 0)  # the latest stage has no limit
    assert kept.returncode == 0 and "still alive" in kept.stdout, kept


KEEP_FREED_PROBE = r"""
import json, resource, sys, threading
from pathlib import Path
import fsspec
import pyarrow as pa
from captionflow.workers.decode import ItemProcessor, keep_freed_memory
files = sorted(Path(sys.argv[1]).iterdir())
items = pa.Table.from_pylist([{"path": str(f).encode(), "name": f.name, "size": f.stat().st_size, "problem": "",
                               "row_group": -1, "first_row": 0, "rows": 1, "item": i} for i, f in enumerate(files)])
params = dict(fs=fsspec.filesystem("file"), kind="images", image_column=None, caption_column=None,
              references={}, max_side=448, max_pixels=10**8, max_bytes=2**30)
run_block = ItemProcessor.__call__.__get__(type("Bare", (), {"params": params})())  # the actor's call, no __init__
if sys.argv[2] == "kept":
    assert keep_freed_memory()
def blocks(out):  # as in the actor: blocks on a thread of its own, the last outputs still referenced
    held = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        held = [*held[-1:], run_block(items)]
        out.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / len(files))
out = []
t = threading.Thread(target=blocks, args=(out,))
t.start(); t.join()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_preprocess_workers_keep_freed_memory_between_images(tmp_path):
    """The preprocess actors run their blocks on a thread of their own (a glibc thread arena); with
    malloc's default, dynamic thresholds that arena gave the pixel buffers back to the OS between
    images and the next image faulted them in again. ``keep_freed_memory`` (run by each actor) must
    stop that: counted with the kernel's minor-fault counter of the working thread, in fresh processes
    running the actor's own block function over 640x480 photos, without and with it."""
    import platform
    import subprocess
    import sys

    from captionflow.builtin.synthetic import make_images

    if not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"):
        pytest.skip("mallopt thresholds are glibc's")
    make_images(tmp_path / "img", 128)

    def faults(mode: str) -> float:
        p = subprocess.run(
            [sys.executable, "-c", KEEP_FREED_PROBE, str(tmp_path / "img"), mode],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 0, p.stderr[-2000:]
        per_block = json.loads(p.stdout.strip().splitlines()[-1])
        return sum(per_block[1:]) / len(per_block[1:])  # after the first block (the heap grows to size)

    default, kept = faults("default"), faults("kept")
    print(f"minor page faults per image: default {default:.1f}, kept {kept:.1f}")
    # a 640x480 decode needs ~1.2 MB of pixel buffers: ~300 pages when faulted in again
    assert kept < 20, (default, kept)
    assert default > 2 * kept, (default, kept)  # the effect this guards against is real here


@pytest.mark.parametrize("size", [(640, 480), (480, 640), (224, 224), (1000, 37), (29, 29), (3000, 2000), (57, 800)])
def test_images_are_fitted_to_the_grid_the_engines_processor_uses(size):
    """engine_image resizes to exactly the size transformers' Qwen2-VL processor would, so the engine's processor
    leaves it as it is and makes the same number of image tokens as from the original."""
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    from captionflow.workers.images import engine_image, grid_size

    grid = (28, 3136, 224 * 224)
    w, h = size
    assert grid_size(h, w, grid) == smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=224 * 224)
    buf = io.BytesIO()
    Image.new("RGB", size, (120, 30, 200)).save(buf, format="JPEG")
    fitted = engine_image(buf.getvalue(), grid)
    assert fitted.shape == (*grid_size(h, w, grid), 3) and fitted.dtype == np.uint8
    proc = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=224 * 224, patch_size=14, merge_size=2)
    original = proc(images=[Image.open(buf)], return_tensors="np")["image_grid_thw"].tolist()
    assert proc(images=[fitted], return_tensors="np")["image_grid_thw"].tolist() == original
    as_is = engine_image(buf.getvalue(), None)  # other processors: the image at its size, the engine resizes
    assert as_is.shape == (h, w, 3) and np.array_equal(as_is, np.asarray(Image.open(buf).convert("RGB")))
