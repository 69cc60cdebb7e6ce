"""Float64 references of the contrastive losses at any batch size: loss and feature gradients, computed in row
chunks from the formulas (no autograd, never an N x N matrix), for the kit's error columns.

CLIP: L = (sum_i lse_row_i + sum_j lse_col_j - 2 scale sum_i x_ii) / (2N) with x = I T^T;
dL/dS = (softmax_row + softmax_col - 2 Id) / (2N), dI = scale dL/dS T, dT = scale dL/dS^T I.
SigLIP (OpenCLIP's): L = -sum log sigmoid(y z) / N with z = scale x + bias; dL/dz = (sigmoid(z) - [y = 1]) / N.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _chunks(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


@torch.no_grad()
def clip_reference(image: torch.Tensor, text: torch.Tensor, scale: float, chunk: int = 2048):
    """(loss, d_image, d_text) in float64."""
    i64, t64 = image.double(), text.double()
    n = i64.shape[0]
    row_lse = torch.empty(n, dtype=torch.float64, device=i64.device)
    col_lse = torch.full((n,), float("-inf"), dtype=torch.float64, device=i64.device)
    for r0, r1 in _chunks(n, chunk):
        s = scale * (i64[r0:r1] @ t64.T)
        row_lse[r0:r1] = torch.logsumexp(s, 1)
        col_lse = torch.logaddexp(col_lse, torch.logsumexp(s, 0))
    positives = (i64 * t64).sum(1)
    loss = (row_lse.sum() + col_lse.sum() - 2 * scale * positives.sum()) / (2 * n)
    d_image = torch.empty_like(i64)
    d_text = torch.zeros_like(t64)
    for r0, r1 in _chunks(n, chunk):
        s = scale * (i64[r0:r1] @ t64.T)
        g = torch.exp(s - row_lse[r0:r1, None]) + torch.exp(s - col_lse[None, :])
        g.diagonal(r0).sub_(2.0)
        g *= scale / (2 * n)
        d_image[r0:r1] = g @ t64
        d_text += g.T @ i64[r0:r1]
    return loss, d_image, d_text


@torch.no_grad()
def siglip_reference(image: torch.Tensor, text: torch.Tensor, scale: float, bias: float, chunk: int = 2048):
    """(loss, d_image, d_text) in float64."""
    i64, t64 = image.double(), text.double()
    n = i64.shape[0]
    loss = torch.zeros((), dtype=torch.float64, device=i64.device)
    d_image = torch.empty_like(i64)
    d_text = torch.zeros_like(t64)
    for r0, r1 in _chunks(n, chunk):
        z = scale * (i64[r0:r1] @ t64.T) + bias
        y = -torch.ones_like(z)
        y.diagonal(r0).fill_(1.0)
        loss -= F.logsigmoid(y * z).sum()
        g = torch.sigmoid(z)
        g.diagonal(r0).sub_(1.0)
        g *= scale / n
        d_image[r0:r1] = g @ t64
        d_text += g.T @ i64[r0:r1]
    return loss / n, d_image, d_text


def max_rel_err(got, ref) -> float:
    """The largest of the loss's relative error and each feature gradient's relative error (norm-wise)."""
    errors = []
    for a, b in zip(got, ref):
        a, b = a.double(), b.double().to(a.device)
        errors.append(float((a - b).norm() / b.norm().clamp_min(1e-300)))
    return max(errors)
