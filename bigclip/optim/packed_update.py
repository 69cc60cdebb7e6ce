"""One compiled AdamW update for many tensors at once (--opt adamw8bit, and --opt adamw under --precision
pure_bf16): the update of adamw8bit.py's optimizers, run over windows of up to WINDOW_BLOCKS blocks of 256 values.

Why: torchao's step calls its compiled update once per parameter tensor, and compiles it once per distinct shape.
A giant tower has about a thousand tensors: a thousand calls per step, each with the guard checks and launches
of a compiled graph (ViT-bigG-14's 8-bit step cost ~0.1 s/step more than torch's fused AdamW on an H100), and
dozens of compiles before the first step ends. Here the tensors of one parameter group (same hyperparameters,
same kind of moments, same dtype) are packed into windows: a window is either a run of whole small tensors,
copied into one contiguous buffer per operand (weights, gradients, moments, scales) and copied back after, or a
slice of one large tensor, updated in place. Each window is one call of one compiled function whose only
dynamic size is the window's number of blocks, so a run compiles it once per kind of moments (8-bit or float)
and a step makes tens of calls instead of a thousand.

The arithmetic is torchao's single_param_adam (AdamW with bias-corrected moments, computed in float32) with its
8-bit moments (blockwise absmax scales, dynamic-tree code maps, torchao's own quantize function): the same
codes, scales and weights as torchao's per-tensor step (tested bit for bit). Blocks are 256 consecutive values
of one tensor, as torchao's: windows cut tensors only at block boundaries, and a small tensor whose size is not
a whole number of blocks is padded in the window (its padding is never written back). A block of a parameter
without a gradient this step is left as it was.

Stochastic rounding into bf16 weights draws counter-based bits (bf16_rounding.py): each block carries its
parameter's index and its first element's position, so the bits are those of the tensor-by-tensor rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torchao.optim.quant_utils import quantize_8bit_with_qmap

from bigclip.dist import local_shard
from bigclip.optim import bf16_rounding
from bigclip.optim.packed_window import PACKED_WINDOW_VALUES

BLOCK = 256  # values per quantization block (torchao's default; the only block size supported here)
WINDOW_BLOCKS = PACKED_WINDOW_VALUES // BLOCK  # 4M values per window (the memory model counts its scratch)
GROUPS_PER_BLOCK = BLOCK // bf16_rounding.GROUP
PROFILER_LABEL = "bigclip.packed_adamw_window"  # each window's update, as torch.profiler names it
MIN_BLOCKS = 2  # dynamo specialises sizes 0 and 1: smaller windows are padded so that one graph serves all


@dataclass
class Piece:
    """Values [start, end) of the local tensor of the optimizer's parameter at `position` (start: a block
    boundary)."""

    position: int
    start: int
    end: int

    @property
    def blocks(self) -> int:
        return -(-(self.end - self.start) // BLOCK)


@dataclass
class Member:
    """A parameter as the packed step sees it: the optimizer that owns its state, its group there (read at each
    step: load_state_dict replaces the group dicts), the key of the hyperparameters it shares with others (the
    model's group: windows never mix two), and its index among the model's parameters (its rounding bits)."""

    owner: object
    group: int
    param: torch.Tensor
    group_key: object
    index: int

    @property
    def hyperparameters(self) -> dict:
        return self.owner.param_groups[self.group]


@dataclass
class Window:
    group: int  # the position of a member whose group's hyperparameters apply to every piece
    quantized: bool
    key: int  # the shard key of its tensors' stochastic rounding
    pieces: list[Piece]
    blocks: int = 0  # with padding blocks
    # in place: one piece of whole blocks, at least MIN_BLOCKS of them (nothing is copied)
    in_place: bool = False
    _block_tables: dict = field(default_factory=dict)  # device -> (parameter index, first counter group)

    def block_tables(self, device: torch.device, members: list[Member]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block: the parameter's index (its position in the model, for the rounding's counters) and the
        counter group of the block's first value."""
        if device not in self._block_tables:
            index, first_group = [], []
            for piece in self.pieces:
                first = piece.start // bf16_rounding.GROUP
                index += [members[piece.position].index] * piece.blocks
                first_group += [first + GROUPS_PER_BLOCK * b for b in range(piece.blocks)]
            padding = self.blocks - len(index)
            index, first_group = index + [0] * padding, first_group + [0] * padding
            tables = (torch.tensor(index, dtype=torch.int64), torch.tensor(first_group, dtype=torch.int64))
            self._block_tables[device] = tuple(t.to(device) for t in tables)
        return self._block_tables[device]


def plan_windows(members: list[Member], quantizes, window_blocks: int = WINDOW_BLOCKS) -> list[Window]:
    """Cut the members' tensors into windows, in order. `quantizes(local_tensor)`: whether its moments are 8-bit.
    Tensors of one window share hyperparameters (group key), kind of moments, dtype, device and shard key."""
    windows: list[Window] = []
    open_windows: dict[tuple, Window] = {}  # by (group key, kind, dtype, device, shard key): the one being filled
    for position, member in enumerate(members):
        local = local_shard(member.param)
        if not local.is_contiguous():
            raise RuntimeError(f"packed AdamW update: parameter {member.index} is not contiguous")
        quantized = bool(quantizes(local))
        key = bf16_rounding.shard_key(member.param)
        kind = (member.group_key, quantized, local.dtype, local.device, key)
        n = local.numel()
        blocks = -(-n // BLOCK)
        current = open_windows.get(kind)
        if blocks > window_blocks // 2:  # a large tensor: windows of its own, updated in place
            for start in range(0, n, window_blocks * BLOCK):
                piece = Piece(position, start, min(n, start + window_blocks * BLOCK))
                windows.append(Window(position, quantized, key, [piece]))
        elif n:
            if current is None or sum(pc.blocks for pc in current.pieces) + blocks > window_blocks:
                current = open_windows[kind] = Window(position, quantized, key, [])
                windows.append(current)
            current.pieces.append(Piece(position, 0, n))
    for window in windows:
        used = sum(piece.blocks for piece in window.pieces)
        window.blocks = max(used, MIN_BLOCKS)
        only = window.pieces[0]
        window.in_place = len(window.pieces) == 1 and (only.end - only.start) % BLOCK == 0 and used >= MIN_BLOCKS
    return windows


def _window_update(
    p, g, m, v, m_scale, v_scale, qmap_signed, qmap_unsigned, step, active, bias_correction1, bias_correction2,
    index, first_group, lr, one_minus_beta1, one_minus_beta2, weight_decay, eps, key, stochastic: bool,
):  # fmt: skip
    """AdamW on a window of blocks (all operands [blocks, 256]; per-block vectors [blocks]), in place: torchao's
    single_param_adam, with its 8-bit moments when scales are given (m_scale not None). The bias corrections
    come computed (bias_corrections()): a pow inside the graph could round differently in its vectorised and
    scalar code paths, which a block's position in the window decides."""
    quantized = m_scale is not None
    act = active[:, None]
    p32, g32 = p.float(), g.float()
    p32 = p32 - lr * weight_decay * p32
    bias_correction1, bias_correction2 = bias_correction1[:, None], bias_correction2[:, None]
    if quantized:  # torchao's dequant_with_qmap
        m_old = qmap_signed[m.int()] * m_scale[:, None]
        v_old = qmap_unsigned[v.int()] * v_scale[:, None]
    else:
        m_old, v_old = m.float(), v.float()
    m32 = m_old.lerp(g32, one_minus_beta1)
    v32 = v_old.lerp(g32.square(), one_minus_beta2)
    denom = (v32.sqrt() / bias_correction2.sqrt()) + eps
    p32 = p32 - lr * (m32 / bias_correction1) / denom
    if quantized:  # torchao's scale_tensor + quantize_8bit_with_qmap, block by block
        new_m_scale = m32.abs().amax(-1).clip(1e-12)
        new_v_scale = v32.abs().amax(-1).clip(1e-12)
        new_m = quantize_8bit_with_qmap(m32 / new_m_scale[:, None], qmap_signed)
        new_v = quantize_8bit_with_qmap(v32 / new_v_scale[:, None], qmap_unsigned)
        m_scale.copy_(torch.where(active, new_m_scale, m_scale))
        v_scale.copy_(torch.where(active, new_v_scale, v_scale))
    else:
        new_m, new_v = m32.to(m.dtype), v32.to(v.dtype)
    m.copy_(torch.where(act, new_m, m))
    v.copy_(torch.where(act, new_v, v))
    if stochastic:
        groups = first_group[:, None] + torch.arange(GROUPS_PER_BLOCK, device=p.device, dtype=torch.int64)
        counters_step = (step[:, None] & bf16_rounding.MASK32).expand_as(groups)
        bits = bf16_rounding.random_bits16(groups, index[:, None].expand_as(groups), counters_step, key)
        new_p = bf16_rounding.round_with_bits(p32, bits.reshape(p32.shape))
    else:
        new_p = p32.to(p.dtype)
    p.copy_(torch.where(act, new_p, p))


@functools.cache
def compiled_window_update():
    return torch.compile(_window_update, fullgraph=True)  # the windows' size: marked dynamic by each call


class WindowOperands:
    """The operands of one window for one step: views of the tensors themselves (in place), or buffers packed
    from them and written back by write_back()."""

    def __init__(self, window: Window, params: list[torch.Tensor], states: list[dict], active: list[bool]):
        self.window = window
        names = ["p", "g", "m", "v"] + (["m_scale", "v_scale"] if window.quantized else [])
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        # (operand, the tensor's own view, its offset in the packed operand): what write_back() copies
        self._returns: list[tuple[str, torch.Tensor, int]] = []
        blocks_before = 0
        for piece, is_active in zip(window.pieces, active):
            views = self._views(piece, params[piece.position], states[piece.position])
            padding = piece.blocks * BLOCK - (piece.end - piece.start)
            for name, view in views.items():
                scale = name.endswith("scale")
                if is_active and name != "g":
                    self._returns.append((name, view, blocks_before * (1 if scale else BLOCK)))
                parts[name].append(torch.cat([view, view.new_zeros(padding)]) if padding and not scale else view)
            blocks_before += piece.blocks
        extra = window.blocks - blocks_before
        self.packed: dict[str, torch.Tensor] = {}
        for name, pieces in parts.items():
            if extra:  # padding blocks up to MIN_BLOCKS
                pieces.append(pieces[0].new_zeros(extra * (1 if name.endswith("scale") else BLOCK)))
            flat = pieces[0] if window.in_place else torch.cat(pieces)
            self.packed[name] = flat if name.endswith("scale") else flat.view(window.blocks, BLOCK)

    def _views(self, piece: Piece, p: torch.Tensor, state: dict) -> dict[str, torch.Tensor]:
        s, e = piece.start, piece.end
        local = local_shard(p.detach())  # a view of the parameter that does not require grad (one graph for all)
        views = {"p": local.view(-1)[s:e]}
        grad = p.grad
        views["g"] = local_shard(grad).view(-1)[s:e] if grad is not None else local.new_zeros(e - s)
        for moment, scale in (("exp_avg", "m"), ("exp_avg_sq", "v")):
            value = local_shard(state[moment]) if state else None
            if self.window.quantized:
                if value is None:
                    views[scale] = torch.zeros(e - s, dtype=torch.uint8, device=local.device)
                    views[f"{scale}_scale"] = torch.zeros(-(-(e - s) // BLOCK), device=local.device)
                else:
                    views[scale] = value.codes.view(-1)[s:e]
                    views[f"{scale}_scale"] = value.scale[s // BLOCK : -(-e // BLOCK)]
            else:
                views[scale] = value.view(-1)[s:e] if value is not None else torch.zeros_like(views["p"])
        return views

    def write_back(self) -> None:
        """Copy the packed buffers' updated values into the active tensors (nothing to do in place)."""
        if self.window.in_place or not self._returns:
            return
        sources = [self.packed[name].view(-1)[start : start + view.numel()] for name, view, start in self._returns]
        torch._foreach_copy_([view for _name, view, _start in self._returns], sources)


@functools.lru_cache(maxsize=4096)
def bias_corrections(beta: float, step: float) -> float:
    """torchao's 1 - beta ** step: float32 beta and step, float32 power, computed once per step on the host."""
    return float(1 - torch.tensor(beta, dtype=torch.float32) ** torch.tensor(step, dtype=torch.float32))


def block_vectors(
    window: Window, members: list[Member], states: list[dict], active: list[bool], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Per block of `window` this step: its parameter's optimizer step count (int64), whether it has a gradient
    (padding blocks: no), the two bias corrections (float32), and block_tables()."""
    beta1, beta2 = members[window.group].hyperparameters["betas"]
    steps, flags, corrections1, corrections2 = [], [], [], []
    for piece, is_active in zip(window.pieces, active):
        state = states[piece.position]
        step = float(state["step"]) if state else 0.0
        corrections = (bias_corrections(beta1, step), bias_corrections(beta2, step)) if step else (1.0, 1.0)
        steps += [int(step)] * piece.blocks
        flags += [is_active] * piece.blocks
        corrections1 += [corrections[0]] * piece.blocks
        corrections2 += [corrections[1]] * piece.blocks
    padding = window.blocks - len(steps)
    vectors = (
        torch.tensor(steps + [0] * padding, dtype=torch.int64),
        torch.tensor(flags + [False] * padding),
        torch.tensor(corrections1 + [1.0] * padding, dtype=torch.float32),
        torch.tensor(corrections2 + [1.0] * padding, dtype=torch.float32),
    )
    return (*(v.to(device) for v in vectors), *window.block_tables(device, members))
