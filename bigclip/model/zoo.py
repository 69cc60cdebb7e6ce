"""OpenCLIP's model zoo as families, read from an architecture's config alone (nothing is built): which family its
towers belong to (`bigclip models`), and why bigclip refuses to build one that OpenCLIP's main branch has
(configs/openclip_main/: audio, generative and NaFlex models; its "modern" text transformer is built,
model/modern_text.py).

A family names the image tower (OpenCLIP's rule: `timm_model_name` a timm trunk, named here by the timm module that
defines it; a list of stage depths a ResNet; otherwise a ViT), then a text tower other than CLIP's text transformer
(a Hugging Face model, by its name on the hub without the organisation), and CoCa when the config has a caption
decoder (`multimodal_cfg`).
"""

from __future__ import annotations

from functools import cache

import timm

NAFLEX_PREFIX = "naflexvit"  # timm's NaFlex ViTs: variable resolution and aspect ratio, as patch sequences


@cache
def timm_family(model_name: str) -> str:
    """The timm module that defines `model_name` (eva, convnext, fastvit, vitamin, ...): its family in timm's own
    terms; the name itself where this timm does not know it."""
    try:
        return timm.models.model_entrypoint(model_name).__module__.rsplit(".", 1)[-1]
    except RuntimeError:  # timm's "Unknown model"
        return model_name


def image_family(vision_cfg: dict) -> str:
    if "timm_model_name" in vision_cfg:
        return f"timm:{timm_family(vision_cfg['timm_model_name'])}"
    return "ResNet" if isinstance(vision_cfg.get("layers"), (list, tuple)) else "ViT"


def text_family(text_cfg: dict) -> str | None:
    """The text tower's family when it is not CLIP's text transformer (None)."""
    if "hf_model_name" in text_cfg:  # the model's name without its organisation (roberta-base, mt5-xl)
        return f"HF text: {text_cfg['hf_model_name'].rstrip('/').rsplit('/', 1)[-1]}"
    if text_cfg.get("text_arch", "clip") != "clip":
        return f"{text_cfg['text_arch']} text"
    return None


def family(cfg: dict) -> str:
    """The architecture's tower family, e.g. "ViT", "timm:eva", "ResNet", "ViT + HF text: roberta-base",
    "CoCa ViT", "audio: HTSAT", "GenLIP"."""
    if "genlip_cfg" in cfg:
        return "GenLIP (NaFlex)"
    if "genlap_cfg" in cfg:
        return "GenLAP (NaFlex audio)"
    if "audio_cfg" in cfg:
        audio = cfg["audio_cfg"]
        first = f"audio: {'-'.join(str(audio[k]) for k in ('model_type', 'model_name') if k in audio)}"
    else:
        first = image_family(cfg.get("vision_cfg", {}))
    text = text_family(cfg.get("text_cfg", {}))
    out = first if text is None else f"{first} + {text}"
    return f"CoCa {out}" if "multimodal_cfg" in cfg else out


def _missing(cfg: dict) -> list[tuple[str, str]]:
    """What bigclip lacks for this architecture: (what the config asks for, in words; the kind, briefly), none where
    bigclip builds it (the families OpenCLIP main adds that bigclip has no towers for)."""
    if "genlip_cfg" in cfg:
        return [("a generative image–language model (OpenCLIP main's NaFlex GenLIP, genlip_cfg)", "GenLIP models")]
    if "genlap_cfg" in cfg:
        return [("a generative audio–language model (OpenCLIP main's NaFlex GenLAP, genlap_cfg)", "audio models")]
    if "audio_cfg" in cfg:
        tower = cfg["audio_cfg"].get("model_type", "?")
        return [(f"an audio–text model (OpenCLIP main's CLAP; audio tower: {tower})", "audio (CLAP) models")]
    missing = []
    timm_name = cfg.get("vision_cfg", {}).get("timm_model_name", "")
    if timm_name.startswith(NAFLEX_PREFIX):
        what = f"a NaFlex variable-resolution image tower (timm's {timm_name}, fed patch sequences)"
        missing.append((what, "NaFlex image towers"))
    return missing


def not_built(cfg: dict) -> str | None:
    """Briefly, what bigclip lacks to build this architecture ("audio (CLAP) models"); None where it builds it.
    Whatever else a config asks that bigclip's towers cannot build is refused where they are built (create_model)."""
    return " and ".join(kind for _, kind in _missing(cfg)) or None


def refusal(name: str, cfg: dict, flag: str = "--model") -> str | None:
    """The one error line for architecture `name` (given as `flag`) where bigclip has no towers for its family; None
    where it has."""
    missing = _missing(cfg)
    if not missing:
        return None
    what, kinds = " and ".join(w for w, _ in missing), " and ".join(k for _, k in missing)
    return (
        f"{flag} {name}: {what}; {kinds} are not built by bigclip yet: choose another architecture "
        f"(`bigclip models` lists them)"
    )
