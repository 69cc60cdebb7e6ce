"""The run's configuration: the flat flags users type (flags.py: TrainConfig; bigclip/flag_fields.py: how a
flag is declared), their resolution and checks (resolve.py), the typed slices components take (sections.py) and the
redacted record (record.py)."""

from bigclip.config.flags import DEMO_PRESET, TrainConfig, config_fields, refused_family
from bigclip.config.record import scrub_argv, to_dict
from bigclip.config.resolve import load_yaml, resolve
from bigclip.config.sections import Sections, build_sections, slice_of
from bigclip.flag_fields import flag_name

__all__ = [
    "DEMO_PRESET",
    "Sections",
    "TrainConfig",
    "build_sections",
    "config_fields",
    "flag_name",
    "load_yaml",
    "refused_family",
    "resolve",
    "scrub_argv",
    "slice_of",
    "to_dict",
]
