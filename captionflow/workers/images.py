"""Decode, check and normalise one image. Pure functions: the ingest/preprocess stages map them.

An input either normalises to RGB JPEG bytes or is rejected with a reason from REASONS.
"""

from __future__ import annotations

import functools
import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import Optional

from PIL import Image, ImageOps, UnidentifiedImageError

# The quarantine vocabulary: every rejected input carries exactly one of these.
REASONS = {
    "empty_file": "zero bytes, or (Parquet) a null image / a struct with neither bytes nor path",
    "unreadable": "storage refused the read; or not a regular file, never opened: a FIFO, socket or device, a broken "
    "symbolic link, a link to a folder (not followed), a folder that cannot be listed; or (Parquet) a "
    "path-only row whose path cannot be read, or every row of a row group whose pages cannot be read",
    "too_large": "over max_input_mb, known from the listing's size: never read (a video or an archive among the images "
    "cannot fill a worker's memory)",
    "not_an_image": "no image format recognised from the content (HTML, PDF, text, gzip, random bytes), never judged "
    "by the file name",
    "unsupported_format": "an image container this installation cannot decode (HEIC/HEIF, AVIF without a plugin, "
    "JPEG XL) or will not (EPS: a PostScript program that Pillow would run in Ghostscript)",
    "decode_error": "the header parsed but the pixels did not decode (truncated, corrupt); or decoding it killed the "
    "worker process or ran past decode_timeout_s, again when it ran alone",
    "too_many_pixels": "width x height over max_input_pixels, checked on the header before decoding (decompression "
    "bombs)",
    "too_many_scans": "a JPEG with more than MAX_JPEG_SCANS (100) scans, counted before decoding (decoding-time bombs: "
    "encoders write 1-20)",
    "too_small": "the shorter side under MIN_SIDE (8) px, as given or once the longest side is bounded to "
    "max_image_side (2000x10 becomes 448x2)",
    "extreme_aspect_ratio": "long side / short side over 200 (Qwen2-VL's processor refuses these), as given or once "
    "bounded",
    "duplicate": "same content hash as an input already accepted (kept once; detail names it)",
    "refused_path": "a Parquet row's image path names a file outside the dataset's folder, a symbolic link out of "
    "it, or a URL: never read (allow_external_paths reads it)",
}

MAX_INPUT_PIXELS = 64_000_000  # checked on the header, before any pixel is decoded
# Encoders write 1 (baseline) to ~10-20 (progressive) scans; a crafted file repeats tiny scans, each of
# which re-walks every block: 1,000 extra scans over 8000x7900 in 465 KB took 80 s to decode.
MAX_JPEG_SCANS = 100
MIN_SIDE = 8
MAX_ASPECT_RATIO = 200.0
JPEG_QUALITY = 95

# PIL's own bomb check raises/warns at its own limit; ours is explicit and applied first.
Image.MAX_IMAGE_PIXELS = None


@dataclass
class Normalised:
    image_id: str
    data: bytes  # RGB JPEG
    width: int
    height: int
    orig_format: str
    orig_width: int
    orig_height: int


class Rejected(Exception):
    def __init__(self, reason: str, detail: str):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


_MAGIC = [
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"BM", "BMP"),
    (b"8BPS", "PSD"),
]


# ISO base media file brands (bytes 8-12, after "ftyp") of still-image formats
_ISOBMFF_IMAGE_BRANDS = {
    b"heic": "HEIC",
    b"heix": "HEIC",
    b"heim": "HEIC",
    b"heis": "HEIC",
    b"hevc": "HEIC",
    b"hevx": "HEIC",
    b"mif1": "HEIF",
    b"msf1": "HEIF",
    b"avif": "AVIF",
    b"avis": "AVIF",
}


def sniff_format(data: bytes) -> str | None:
    """The image format a file's first bytes announce, if any."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp" and data[8:12] in _ISOBMFF_IMAGE_BRANDS:
        return _ISOBMFF_IMAGE_BRANDS[data[8:12]]
    if data.startswith((b"\xff\x0a", b"\x00\x00\x00\x0cJXL \r\n\x87\n")):
        return "JPEG XL"
    if data.startswith((b"%!PS", b"\xc5\xd0\xd3\xc6")):
        return "EPS"
    return next((name for magic, name in _MAGIC if data.startswith(magic)), None)


_UNDECODABLE_HERE = {"HEIC", "HEIF", "AVIF", "JPEG XL", "EPS"}  # PIL without a plugin does not identify these
_NOT_DECODED = {  # formats Pillow could open but that are refused on purpose
    "EPS": "not decoded on purpose: the file is a PostScript program, which Pillow would run in Ghostscript "
    "(it can loop forever)",
}


@functools.lru_cache(maxsize=1)
def _open_formats() -> tuple[str, ...]:
    """Every format this Pillow can open, less those in _NOT_DECODED."""
    Image.init()
    return tuple(f for f in Image.OPEN if f not in _NOT_DECODED)


def describe_content(data: bytes) -> str:
    """What a rejected file is, without copying any of its bytes into an output: its size, a coarse kind
    and a hash (the file may be anything: a secret, another user's data)."""
    head = data[:512]
    kinds = [
        (b"%PDF", "a PDF"),
        (b"PK\x03\x04", "a zip archive"),
        (b"\x1f\x8b", "gzip data"),
        (b"\x7fELF", "a program"),
    ]
    kind = next((k for magic, k in kinds if head.startswith(magic)), None)
    if kind is None:
        text = head.lstrip()
        printable = sum(32 <= b < 127 or b in (9, 10, 13) for b in head) >= 0.95 * max(len(head), 1)
        if text[:1] == b"<":
            kind = "markup (HTML, XML or SVG)"
        elif text[:1] in (b"{", b"["):
            kind = "JSON-like text"
        else:
            kind = "text" if printable else "binary data"
    return f"{kind}, {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:16]}"


def content_id(data: bytes) -> str:
    """Stable image id: the content hash of the original bytes."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _to_rgb(im: Image.Image) -> Image.Image:
    if im.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        # 16/32-bit grey and float: stretch the value range to 8 bits (float32: a 64 MP input needs
        # 256 MB for it, not the 512 MB of float64)
        import numpy as np

        arr = np.asarray(im).astype(np.float32)
        lo, hi = float(arr.min()), float(arr.max())
        arr -= lo
        arr *= 255.0 / (hi - lo) if hi > lo else 0.0
        im = Image.fromarray(arr.clip(0, 255, out=arr).astype(np.uint8), mode="L")
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im if im.mode == "RGBA" else im.convert("RGBA")  # convert() to the same mode copies: 256 MB at 64 MP
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return im.convert("RGB")


def _check_shape(w: int, h: int, when: str) -> None:
    if min(w, h) < MIN_SIDE:
        raise Rejected("too_small", f"{w}x{h}{when}: shorter side < {MIN_SIDE} px")
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        raise Rejected("extreme_aspect_ratio", f"{w}x{h}{when}: ratio > {MAX_ASPECT_RATIO:g}")


def normalise_image(data: bytes, max_side: int, max_input_pixels: int = MAX_INPUT_PIXELS) -> Normalised:
    """Check and normalise one encoded image. Raises Rejected with a reason from REASONS."""
    if not data:
        raise Rejected("empty_file", "0 bytes")
    try:
        im = Image.open(io.BytesIO(data), formats=_open_formats())
    except UnidentifiedImageError:
        fmt = sniff_format(data)
        if fmt in _UNDECODABLE_HERE:
            why = _NOT_DECODED.get(fmt, "no decoder for it in this installation")
            raise Rejected("unsupported_format", f"{fmt} content: {why}") from None
        if fmt:  # an image signature whose header does not parse: a broken image, not a non-image
            raise Rejected(
                "decode_error", f"{fmt} signature but the header does not parse ({len(data)} bytes)"
            ) from None
        raise Rejected("not_an_image", f"no image format recognised: {describe_content(data)}") from None
    except Exception as e:  # PIL raises various errors on a broken header
        raise Rejected("decode_error", f"{type(e).__name__}: {e}"[:300]) from None
    fmt = im.format or "unknown"
    w, h = im.size
    if w * h > max_input_pixels:
        raise Rejected("too_many_pixels", f"{w}x{h} = {w * h} pixels > budget {max_input_pixels}")
    if fmt in ("JPEG", "MPO") and (scans := data.count(b"\xff\xda")) > MAX_JPEG_SCANS:  # SOS markers
        raise Rejected("too_many_scans", f"{w}x{h} JPEG with {scans} scans > {MAX_JPEG_SCANS}")
    _check_shape(w, h, "")  # a 90-degree EXIF rotation changes neither the short side nor the ratio
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im.seek(0)  # first frame of animated / multi-page files
            if fmt in ("JPEG", "MPO") and max(w, h) > max_side:
                # every scan is still decoded in full; the inverse DCT outputs 1/2, 1/4 or 1/8 of the size,
                # kept at least twice the bounded size (as Image.thumbnail's reducing_gap does for the final
                # LANCZOS): a 12 MP photo decodes ~4x faster and in 1/16 of the memory
                scale = max_side / max(w, h)
                im.draft(None, (round(w * scale) * 2, round(h * scale) * 2))
            im.load()
            im = ImageOps.exif_transpose(im) or im
            rgb = _to_rgb(im)
    except Rejected:
        raise
    except Exception as e:
        raise Rejected("decode_error", f"{fmt}: {type(e).__name__}: {e}"[:300]) from None
    if max(rgb.size) > max_side:
        was = (w, h) if (rgb.width >= rgb.height) == (w >= h) else (h, w)  # as displayed (EXIF rotation)
        rgb.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
        # what the model gets must pass too: 2000x10 (ratio 200) bounded to 448 px is 448x2
        _check_shape(*rgb.size, f" once the long side is bounded to {max_side} px (was {was[0]}x{was[1]})")
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=JPEG_QUALITY)
    return Normalised(
        image_id=content_id(data),
        data=out.getvalue(),
        width=rgb.size[0],
        height=rgb.size[1],
        orig_format=fmt,
        orig_width=w,
        orig_height=h,
    )


def grid_size(height: int, width: int, grid: tuple[int, int, int]) -> tuple[int, int]:
    """(height, width) a Qwen2-VL-style image processor resizes an image to: multiples of ``factor`` (patch x
    merge size) nearest the image's, scaled into [min_pixels, max_pixels] (``grid``: factor, min, max) - the
    processor's own ``smart_resize`` rule."""
    import math

    factor, min_pixels, max_pixels = grid
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def engine_image(jpeg: bytes, grid: Optional[tuple[int, int, int]]):
    """The image as the engine's image processor takes it: an RGB array (height x width x 3, uint8), resized
    here, on a CPU worker, to the patch grid within the pixel budget (``grid_size``), so the engine's front end -
    one process per engine - decodes nothing and only normalises and cuts patches. JPEGs decode at a reduced
    scale where the target is at most half their size. Without ``grid`` (other processors) the image at its
    size (the engine resizes it)."""
    import numpy as np

    with Image.open(io.BytesIO(jpeg)) as im:
        if grid:
            w0, h0 = im.size
            h, w = grid_size(h0, w0, grid)
            if im.format == "JPEG":
                im.draft("RGB", (w, h))
            rgb = im.convert("RGB")
            if rgb.size != (w, h):
                rgb = rgb.resize((w, h), Image.Resampling.BICUBIC)
        else:
            rgb = im.convert("RGB")
        return np.array(rgb)


def check_image(data: bytes, max_side: int) -> tuple[Optional[Normalised], Optional[Rejected]]:
    try:
        return normalise_image(data, max_side), None
    except Rejected as r:
        return None, r
