"""Image decoding shared by the sample readers: RGB, with --max-image-pixels checked on the header.

The header gives a file's size before any pixel is decompressed, so an image larger than --max-image-pixels
(OpenCLIP main's flag) is refused before decoding, and counted as skipped (`data/skipped_too_large`) rather than
decoded only to be shrunk to the training size.

A transform that takes images undecoded (`accepts_undecoded`: bigclip's own, which decode themselves, at reduced
scale where the output allows) gets a JPEG as a `Jpeg`: libjpeg-turbo (simplejpeg) read its header and decodes it
straight into an array, PIL's pixels bit for bit (the same libjpeg, the same settings; tests/test_data.py) in about
0.8 ms at 512 px where PIL's decode and its copy into an array take 1.4 (PIL keeps RGB as 4 bytes a pixel and
converts twice). Other formats, CMYK JPEGs, and JPEGs libjpeg-turbo calls damaged (PIL reads some of those,
silently) are opened by PIL, as before; other transforms (OpenCLIP's) get a PIL image in RGB.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import simplejpeg
from PIL import Image

JPEG_START = b"\xff\xd8\xff"  # SOI then a marker: every JPEG begins so
_MODES = {"YCbCr": "RGB", "Gray": "L"}  # JPEG colour spaces simplejpeg decodes to PIL's RGB; CMYK/YCCK stay with PIL


class ImageTooLarge(Exception):
    """The header's width x height exceeds --max-image-pixels."""


class Jpeg:
    """A JPEG whose header libjpeg-turbo has read, not yet decoded: its bytes, and the slice of PIL's Image the
    transforms read before decoding (format, mode, size)."""

    format = "JPEG"

    def __init__(self, data: bytes, width: int, height: int, mode: str):
        self.data, self.width, self.height, self.mode = data, width, height, mode

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    def decode(self, factor: int = 1) -> np.ndarray | None:
        """RGB uint8 [H, W, 3] at 1/`factor` (1, 2, 4, 8: libjpeg's DCT scaling, what PIL's draft decodes, the last
        partial block rounded up), or None where libjpeg-turbo reports the file damaged: `opened()` then reads it as
        PIL would have."""
        height, width = -(-self.height // factor), -(-self.width // factor)
        try:
            pixels = simplejpeg.decode_jpeg(
                self.data, "RGB", min_height=height, min_width=width, min_factor=factor, strict=True
            )
        except ValueError:  # strict: libjpeg's warnings ("Corrupt JPEG data", "Premature end") too
            return None
        return pixels if pixels.shape[:2] == (height, width) else None

    def opened(self) -> Image.Image:
        """The same file opened by PIL (header read, pixels not yet decoded)."""
        return Image.open(io.BytesIO(self.data))


def read_jpeg(data: bytes) -> Jpeg | None:
    """`data` as a Jpeg, or None: not a JPEG, a colour space or size PIL should handle, a header libjpeg-turbo
    cannot read."""
    if not data.startswith(JPEG_START):
        return None
    try:
        height, width, colorspace, _subsampling = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    mode = _MODES.get(colorspace)
    # PIL's decompression-bomb check (a warning, then an error) stays PIL's: such images go to it
    if mode is None or width * height > (Image.MAX_IMAGE_PIXELS or float("inf")):
        return None
    return Jpeg(data, width, height, mode)


def decode_rgb(source, transform, max_pixels: int | None = None):
    """`transform` of the RGB image at `source` (a path or a binary file object). A transform that takes images
    undecoded (`accepts_undecoded`) gets a JPEG as a Jpeg and anything else as PIL opened it (it converts to RGB
    itself); one that decodes on the training device (data/device_decode.py) gets a JPEG's bytes and returns them to
    be decoded there (`ships`, `encode`); any other, a PIL image in RGB."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL's per-file warnings (EXIF, palettes) would flood logs
        undecoded = getattr(transform, "accepts_undecoded", False)
        if undecoded:
            data = _file_bytes(source)
            jpeg = read_jpeg(data)
            if jpeg is not None:
                return _transformed(jpeg, data, transform, max_pixels)
            source = io.BytesIO(data)
        with Image.open(source) as img:
            if not undecoded:
                _check_size(img, max_pixels)
                return transform(img.convert("RGB"))
            return _transformed(img, data, transform, max_pixels)


def _transformed(image, data: bytes, transform, max_pixels: int | None):
    _check_size(image, max_pixels)
    if hasattr(transform, "ships") and transform.ships(image):
        return transform.encode(image, data)
    return transform(image)


def _check_size(image, max_pixels: int | None) -> None:
    width, height = image.size
    if max_pixels and width * height > max_pixels:
        raise ImageTooLarge(f"{width}x{height} exceeds --max-image-pixels {max_pixels}")


def _file_bytes(source) -> bytes:
    if hasattr(source, "getvalue"):  # BytesIO: the shard reader's sample
        return source.getvalue()
    if hasattr(source, "read"):
        source.seek(0)
        return source.read()
    with open(source, "rb") as f:
        return f.read()
