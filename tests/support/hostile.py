"""A hostile image corpus: every file with the place it must end in (accepted, or a quarantine reason)."""

from __future__ import annotations

import io
import os
import random
import struct
import zlib
from pathlib import Path

from PIL import Image

ACCEPTED = "accepted"


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    b = io.BytesIO()
    im.save(b, format=fmt, **kw)
    return b.getvalue()


def _png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height, with a tiny compressed body."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    body = zlib.compress(b"\0" * 1024, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def _scan_bomb(photo: Image.Image, extra_scans: int = 400) -> bytes:
    """A progressive JPEG whose last scan is repeated: a valid file that a decoder walks again and again
    (1,000 repeats over 8000x7900 took 80 s to decode in 465 KB). Kept small here: it must be
    refused from its scan count, before decoding."""
    data = _save(photo, "JPEG", progressive=True)
    last, eoi = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    return data[:eoi] + data[last:eoi] * extra_scans + data[eoi:]


def build_corpus(root: Path) -> dict[str, str]:
    """Write the corpus under ``root``; return {relative name: expected outcome}."""
    rng = random.Random(7)
    photo = Image.effect_mandelbrot((320, 240), (-2, -1.2, 1, 1.2), 64).convert("RGB")
    files: dict[str, tuple[bytes, str]] = {}
    jpg = _save(photo, "JPEG", quality=90)
    files["photo.jpg"] = (jpg, ACCEPTED)
    files["empty.jpg"] = (b"", "empty_file")
    files["random.bin"] = (bytes(rng.getrandbits(8) for _ in range(2048)), "not_an_image")
    files["truncated.jpg"] = (jpg[: len(jpg) // 3], "decode_error")
    png = _save(photo, "PNG")
    files["header_only.png"] = (png[:33], "decode_error")  # signature + IHDR, no pixel data
    files["not_really.png"] = (b"<html><body><h1>404 Not Found</h1></body></html>", "not_an_image")
    files["drawing.svg"] = (
        b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>',
        "not_an_image",
    )
    files["bomb.png"] = (_png_bomb(100_000, 100_000), "too_many_pixels")
    huge = _save(photo.resize((8000, 6000)), "JPEG", quality=60)
    files["huge_8000x6000.jpg"] = (huge, ACCEPTED)
    files["huge_truncated.jpg"] = (huge[: len(huge) * 2 // 3], "decode_error")  # decoded at 1/8 scale: still in full
    files["one_pixel.png"] = (_save(Image.new("RGB", (1, 1), "red"), "PNG"), "too_small")
    files["sliver_5000x4.png"] = (_save(Image.new("RGB", (5000, 4), "blue"), "PNG"), "too_small")
    files["banner_9000x40.png"] = (_save(Image.new("RGB", (9000, 40), "green"), "PNG"), "extreme_aspect_ratio")
    files["cmyk.jpg"] = (_save(photo.convert("CMYK"), "JPEG"), ACCEPTED)
    im16 = Image.new("I;16", (64, 48))
    im16.putpixel((3, 3), 40000)
    files["grey16.png"] = (_save(im16, "PNG"), ACCEPTED)
    files["rgba.png"] = (_save(photo.convert("RGBA"), "PNG"), ACCEPTED)
    pal = photo.convert("P", palette=Image.Palette.ADAPTIVE)
    files["palette_transparent.png"] = (_save(pal, "PNG", transparency=0), ACCEPTED)
    frames = [photo.rotate(a) for a in (0, 30, 60)]
    b = io.BytesIO()
    frames[0].save(b, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    files["animated.gif"] = (b.getvalue(), ACCEPTED)
    b = io.BytesIO()
    photo.save(b, format="TIFF", save_all=True, append_images=[photo.rotate(90)])
    files["multipage.tif"] = (b.getvalue(), ACCEPTED)
    exif = Image.Exif()
    exif[0x0112] = 8
    files["exif_rotated.jpg"] = (_save(photo.crop((0, 0, 300, 100)), "JPEG", exif=exif.tobytes()), ACCEPTED)
    files["ünïcödé näme with spaces.jpg"] = (_save(photo.rotate(180), "JPEG"), ACCEPTED)
    files["no_extension"] = (_save(photo.rotate(45), "PNG"), ACCEPTED)  # format from content, not the name
    files["sub dir/nested/deep.webp"] = (_save(photo.rotate(10), "WEBP"), ACCEPTED)
    files["banner_2000x10.png"] = (
        _save(Image.new("RGB", (2000, 10), "green"), "PNG"),
        "too_small",
    )  # 448x2 once bounded
    files["bilevel.png"] = (_save(photo.convert("1"), "PNG"), ACCEPTED)
    files["float32.tif"] = (_save(photo.convert("F"), "TIFF"), ACCEPTED)
    files["int32.tif"] = (_save(photo.convert("I"), "TIFF"), ACCEPTED)
    files["lab.tif"] = (_save(photo.convert("LAB"), "TIFF"), ACCEPTED)
    files["photo.jp2"] = (_save(photo.rotate(15), "JPEG2000"), ACCEPTED)
    files["photo.bmp"] = (_save(photo.rotate(16), "BMP"), ACCEPTED)
    files["iphone.heic"] = (b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + bytes(200), "unsupported_format")
    files["photo.jxl"] = (b"\xff\x0a" + bytes(rng.getrandbits(8) for _ in range(200)), "unsupported_format")
    files["figure.eps"] = (
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n{} loop\nshowpage\n",  # loops forever
        "unsupported_format",
    )
    files["broken.psd"] = (b"8BPS\0\1" + bytes(20), "decode_error")
    files["report.pdf"] = (b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF", "not_an_image")
    files["gzipped.jpg"] = (zlib.compress(jpg), "not_an_image")
    files["scan_bomb.jpg"] = (_scan_bomb(photo), "too_many_scans")
    files["progressive_photo.jpg"] = (_save(photo.resize((2000, 1500)), "JPEG", progressive=True), ACCEPTED)
    files["sub dir/copy of photo.jpg"] = (jpg, "duplicate")
    files["sub dir/second copy.jpg"] = (jpg, "duplicate")
    for rel, (data, _) in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # hidden: not an input
    os.makedirs(root / ".cache", exist_ok=True)
    (root / ".cache" / "x.jpg").write_bytes(jpg)
    return {rel: expected for rel, (_, expected) in files.items()}


def add_local_specials(root: Path, outside: Path) -> dict[str, str]:
    """Entries only a local disk has, added to a corpus under ``root``: a file name that is not UTF-8,
    a FIFO (opening it would block forever), links (to a file outside the corpus, broken, to a
    folder) and a sparse 600 MB file (over the default 512 MB budget: quarantined unread).
    Returns {source as listed: expected outcome}."""
    outside.mkdir(parents=True, exist_ok=True)
    photo = Image.effect_mandelbrot((200, 150), (-2, -1.2, 1, 1.2), 48).convert("RGB")
    with open(os.path.join(os.fsencode(root), b"caf\xe9 latin-1.jpg"), "wb") as fh:
        fh.write(_save(photo.rotate(3), "JPEG"))
    os.mkfifo(root / "pipe.jpg")
    (outside / "linked.png").write_bytes(_save(photo.rotate(5), "PNG"))
    os.symlink(outside / "linked.png", root / "link_to_outside.png")
    os.symlink(outside / "missing.jpg", root / "broken_link.jpg")
    os.symlink(outside, root / "linked_folder")
    with open(root / "sparse_600mb.jpg", "wb") as fh:
        fh.truncate(600 * 2**20)
    return {
        "caf\\xe9 latin-1.jpg": ACCEPTED,
        "pipe.jpg": "unreadable",
        "link_to_outside.png": ACCEPTED,
        "broken_link.jpg": "unreadable",
        "linked_folder": "unreadable",
        "sparse_600mb.jpg": "too_large",
    }
