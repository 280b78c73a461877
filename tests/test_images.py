from __future__ import annotations

import io

import pytest
from PIL import Image

from captionflow.images import REASONS, Rejected, normalise_image


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
