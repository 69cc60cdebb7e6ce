"""Reading DCP checkpoints without running code from them.

A checkpoint may come from a bucket other people can write. DCP's own reader unpickles `.metadata` with
pickle.load and non-tensor values with torch.load(weights_only=False): either would call whatever a crafted
file names. Here `.metadata` is unpickled with only the classes DCP metadata is made of, and non-tensor values
with torch.load(weights_only=True). A file that needs anything else is refused with one line.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper, as its DefaultLoadPlanner
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from bigclip.errors import UserError


def _allowed(module: str, name: str) -> bool:
    if module == dcp_metadata.__name__:
        return isinstance(getattr(dcp_metadata, name, None), type)  # its dataclasses and enums
    if module == dcp_filesystem.__name__:
        return name == "_StorageInfo"
    if module == "torch":
        return name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
    if module == "torch.serialization":
        return name == "_get_layout"  # a layout from its name
    if module == "pathlib":
        return name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
    return module == "collections" and name == "OrderedDict"


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise pickle.UnpicklingError(f"names {module}.{name}, which DCP metadata never holds")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose .metadata is unpickled with the allowlist above (local directories only: remote
    checkpoints are downloaded and verified first)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        path = os.path.join(str(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError) as e:
                problem = f".metadata is not plain DCP metadata ({e}); not loaded"
                raise UserError(f"checkpoint {self.path}: {problem}") from None
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise UserError(f"checkpoint {self.path}: .metadata holds a {type(metadata).__name__}; not loaded")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def first_failure(err: BaseException) -> BaseException:
    """The error under DCP's CheckpointException (which wraps each rank's failure with its traceback)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        return wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return err


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(
                f"{read_item.dest_index.fqn} holds objects other than tensors and plain values; not loaded"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
