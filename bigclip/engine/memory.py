"""Bytes of training state a rank actually holds: parameters, gradients, optimizer state.

Counted by walking the tensors reachable from the model and the optimizer object and adding up each
distinct storage once. Sharded engines hold their state in places of their own (DTensor local shards,
DeepSpeed's flat fp32 partitions and gradient buffers), so walking the real objects measures what the
engine keeps rather than what a formula says it should. Attribution: model parameters (and ZeRO-3
partitions, `ds_tensor`) are "params"; `.grad` and any optimizer attribute whose name mentions "grad"
are "grads"; everything else reachable from the optimizer (moments, fp32 master copies) is "optimizer".
"""

from __future__ import annotations

import resource

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

MAX_DEPTH = 6


def _storage(t: torch.Tensor) -> tuple[int, int] | None:
    if isinstance(t, DTensor):
        t = t.to_local()
    if t.is_meta:
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if s.nbytes() == 0:
        return None
    return s.data_ptr(), s.nbytes()


class _Counter:
    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = {"params": 0, "grads": 0, "optimizer": 0}

    def add(self, t, kind: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if isinstance(t, DTensor):
            t = t.to_local()
        if is_traceable_wrapper_subclass(t):  # 8-bit optimizer state: its codes and scales hold the bytes
            for name in t.__tensor_flatten__()[0]:
                self.add(getattr(t, name), kind)
            return
        key = _storage(t)
        if key is None or key[0] in self.seen:
            return
        self.seen.add(key[0])
        self.bytes[kind] += key[1]

    def walk(self, obj, kind: str, depth: int, visited: set[int]) -> None:
        if depth > MAX_DEPTH or id(obj) in visited:
            return
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.add(obj, kind)
            return
        if isinstance(obj, (nn.Module, str, bytes, int, float, bool, type)) or obj is None:
            return
        if isinstance(obj, dict):
            items = obj.items()
        elif isinstance(obj, (list, tuple, set)):
            items = ((None, v) for v in obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("torch", "deepspeed"):
            items = vars(obj).items()
        else:
            return
        for name, value in items:
            is_grad = kind == "optimizer" and isinstance(name, str) and "grad" in name.lower()
            sub = "grads" if is_grad else kind
            self.walk(value, sub, depth + 1, visited)


def tensor_bytes(model: nn.Module, optimizer) -> dict[str, int]:
    c = _Counter()
    for p in model.parameters():
        c.add(p, "params")
        c.add(getattr(p, "ds_tensor", None), "params")
    for p in model.parameters():
        c.add(p.grad, "grads")
    if optimizer is not None:
        visited: set[int] = set()
        # Optimizer state first (moments), then the wrapper's own attributes (DeepSpeed's buffers).
        inner = getattr(optimizer, "optimizer", None)
        for opt in (inner, optimizer):
            if opt is None:
                continue
            c.walk(getattr(opt, "state", {}), "optimizer", 0, visited)
            c.walk(getattr(opt, "param_groups", []), "optimizer", 0, visited)
            c.walk(opt, "optimizer", 0, visited)
    c.bytes["total"] = c.bytes["params"] + c.bytes["grads"] + c.bytes["optimizer"]
    return c.bytes


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory (Linux VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
