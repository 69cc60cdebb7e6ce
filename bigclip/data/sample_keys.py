"""Which members of a WebDataset sample hold its image and its caption (OpenCLIP main's --image-key, --text-key,
--json-text-key, --json-text-key-probs).

A key is a tar member's suffix ("jpg" for 0001.jpg); ';' separates alternatives, the first one present wins.
With --json-text-key the caption is a field of the sample's .json member instead: the first non-empty one of
the ';'-separated fields, or, with --json-text-key-probs, of the fields in an order drawn per sample with those
weights (fields without a weight, or weight 0, are fallbacks in their given order), as OpenCLIP main draws it.
bigclip draws that order from a generator seeded by the run's seed, the epoch and the sample's key, so a resumed
run picks the same captions as the run it continues.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from bigclip.errors import UserError

DEFAULT_IMAGE_KEY = "jpg;png;jpeg;webp"
DEFAULT_TEXT_KEY = "txt"


def split_keys(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(";") if part.strip())


@dataclass(frozen=True)
class SampleKeys:
    image: tuple[str, ...] = split_keys(DEFAULT_IMAGE_KEY)
    text: tuple[str, ...] = (DEFAULT_TEXT_KEY,)
    json_fields: tuple[str, ...] | None = None
    json_weights: tuple[float, ...] | None = None
    seed: int = 0

    @classmethod
    def from_flags(
        cls, image_key: str, text_key: str, json_text_key: str | None, probs: list[float] | None, seed: int
    ) -> SampleKeys:
        image, text = split_keys(image_key), split_keys(text_key)
        if not image:
            raise UserError(f"--image-key {image_key!r}: name at least one member suffix, e.g. jpg;png")
        if not text:
            raise UserError(f"--text-key {text_key!r}: name at least one member suffix, e.g. txt")
        fields = split_keys(json_text_key) if json_text_key is not None else None
        if fields is not None and not fields:
            raise UserError(f"--json-text-key {json_text_key!r}: name at least one field of the .json member")
        weights = None
        if probs is not None and fields is not None:  # (without --json-text-key: idle, said where flags are checked)
            if len(probs) > len(fields) or any(not p >= 0 for p in probs):
                raise UserError(
                    f"--json-text-key-probs {' '.join(map(str, probs))}: give at most one non-negative weight per "
                    f"--json-text-key field ({len(fields)})"
                )
            weights = tuple(float(p) for p in probs) + (0.0,) * (len(fields) - len(probs))
        return cls(image, text, fields, weights, seed)

    def image_bytes(self, sample: dict) -> bytes | None:
        return next((sample[k] for k in self.image if k in sample), None)

    def caption(self, sample: dict, epoch: int) -> str:
        """The sample's caption ("" when it has none)."""
        if self.json_fields is None:
            raw = next((sample[k] for k in self.text if k in sample), None)
            return raw.decode("utf-8", errors="replace") if raw is not None else ""
        try:
            meta = json.loads(sample.get("json") or b"")
        except (ValueError, TypeError):
            return ""
        if not isinstance(meta, dict):
            return ""
        for field in self._field_order(sample, epoch):
            value = meta.get(field)
            if isinstance(value, str) and value.strip():
                return value
        return ""

    def _field_order(self, sample: dict, epoch: int) -> list[str]:
        """OpenCLIP main's order: weighted fields drawn without replacement, then the zero-weight ones."""
        if self.json_weights is None:
            return list(self.json_fields)
        rng = random.Random(f"{self.seed}:{epoch}:{sample.get('__url__')}:{sample.get('__key__')}")
        drawn = [[f, w] for f, w in zip(self.json_fields, self.json_weights) if w > 0]
        order = []
        while drawn:
            i = rng.choices(range(len(drawn)), weights=[w for _, w in drawn], k=1)[0]
            order.append(drawn.pop(i)[0])
        return order + [f for f, w in zip(self.json_fields, self.json_weights) if w <= 0]

    def describe(self) -> str:
        """What a usable sample holds, for the no-usable-sample message."""
        image = "/".join(f".{k}" for k in self.image)
        text = (
            f".json with a field {'/'.join(self.json_fields)}"
            if self.json_fields is not None
            else "/".join(f".{k}" for k in self.text)
        )
        return f"{image} images with {text} captions"
