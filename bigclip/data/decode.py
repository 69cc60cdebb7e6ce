"""Image decoding shared by the sample readers: RGB through PIL, with --max-image-pixels checked on the header.

PIL reads a file's size from its header when it opens it and decodes the pixels only when asked, so an image
larger than --max-image-pixels (OpenCLIP main's flag) is refused before any pixel is decompressed, and counted
as skipped (`data/skipped_too_large`) rather than decoded only to be shrunk to the training size.
"""

from __future__ import annotations

import warnings

from PIL import Image


class ImageTooLarge(Exception):
    """The header's width x height exceeds --max-image-pixels."""


def decode_rgb(source, transform, max_pixels: int | None = None):
    """`transform` of the RGB image at `source` (a path or a binary file object). A transform that says it takes
    images undecoded (`accepts_undecoded`: bigclip's, which convert to RGB themselves, after choosing a JPEG's DCT
    scale when decoding reduced) gets the image as PIL opened it; one that decodes on the training device
    (data/device_decode.py) gets a JPEG's bytes and returns them to be decoded there."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL's per-file warnings (EXIF, palettes) would flood logs
        with Image.open(source) as img:
            if max_pixels and img.width * img.height > max_pixels:
                raise ImageTooLarge(f"{img.width}x{img.height} exceeds --max-image-pixels {max_pixels}")
            if hasattr(transform, "ships") and transform.ships(img):
                return transform.encode(img, _file_bytes(source))
            return transform(img if getattr(transform, "accepts_undecoded", False) else img.convert("RGB"))


def _file_bytes(source) -> bytes:
    if hasattr(source, "getvalue"):  # BytesIO: the shard reader's sample
        return source.getvalue()
    if hasattr(source, "read"):
        source.seek(0)
        return source.read()
    with open(source, "rb") as f:
        return f.read()
