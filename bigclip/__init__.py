"""bigclip: a CLIP training engine."""

__version__ = "0.1.0"
