"""CLIP models: architectures, towers, tokenizer and OpenCLIP weight conversion."""

from bigclip.model.clip import CLIP
from bigclip.model.convert import bigclip_to_openclip, openclip_to_bigclip
from bigclip.model.factory import (
    create_model,
    get_model_config,
    get_tokenizer,
    list_models,
    load_pretrained,
    preprocess_cfg,
)
from bigclip.model.tokenizer import ByteTokenizer

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
