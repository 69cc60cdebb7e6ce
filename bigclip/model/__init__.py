"""CLIP models: architectures, towers, tokenizer and OpenCLIP weight conversion."""

from .clip import CLIP
from .convert import bigclip_to_openclip, openclip_to_bigclip
from .factory import (
    create_model,
    get_model_config,
    get_tokenizer,
    list_models,
    load_pretrained,
    preprocess_cfg,
)
from .tokenizer import ByteTokenizer

__all__ = [
    "CLIP",
    "ByteTokenizer",
    "bigclip_to_openclip",
    "create_model",
    "get_model_config",
    "get_tokenizer",
    "list_models",
    "load_pretrained",
    "openclip_to_bigclip",
    "preprocess_cfg",
]
