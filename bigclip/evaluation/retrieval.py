"""OpenCLIP's retrieval metrics (mean/median rank, R@1/5/10, image->text and text->image), exact and computed a
block of scores at a time."""

from __future__ import annotations

import numpy as np
import torch


def retrieval_ranks(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: float, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's rank (0: first) among all texts for its image, and among all images for its text, exactly,
    without the N x N score matrix: scores are computed `chunk` x `chunk` at a time (memory O(chunk^2) for the
    scores, O(N) for the ranks; chunk 0: one block). A candidate ranks above the true partner when its score is
    higher, or equal with a smaller index (OpenCLIP main's --val-retrieval-chunk-size rule; argsort's order of
    ties in 3.3 is unspecified). The true pair's score is taken from the same block product the candidates'
    scores come from, so it is compared with itself bit for bit."""
    n = image_features.shape[0]
    chunk = n if chunk <= 0 else min(chunk, n)
    starts = range(0, n, chunk)

    def block(i: int, j: int) -> torch.Tensor:
        return logit_scale * image_features[i : i + chunk] @ text_features[j : j + chunk].t()

    targets = torch.cat([block(i, i).diagonal() for i in starts])
    image_ranks = torch.zeros(n, dtype=torch.long)
    text_ranks = torch.zeros(n, dtype=torch.long)
    for i in starts:
        rows = torch.arange(i, min(i + chunk, n))[:, None]
        for j in starts:
            scores = block(i, j)
            cols = torch.arange(j, min(j + chunk, n))[None, :]
            row_target, col_target = targets[rows], targets[cols]
            image_ranks[rows[:, 0]] += ((scores > row_target) | ((scores == row_target) & (cols < rows))).sum(1)
            text_ranks[cols[0]] += ((scores > col_target) | ((scores == col_target) & (rows < cols))).sum(0)
    return image_ranks, text_ranks


def retrieval_metrics(
    image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: float, chunk: int = 0
) -> dict[str, float]:
    """OpenCLIP's retrieval metrics: mean/median rank and R@1/5/10, both directions. Pair i is (i, i)."""
    metrics = {}
    image_ranks, text_ranks = retrieval_ranks(image_features, text_features, logit_scale, chunk)
    for name, ranks in (("image_to_text", image_ranks), ("text_to_image", text_ranks)):
        ranks = ranks.numpy()
        metrics[f"{name}_mean_rank"] = float(ranks.mean()) + 1
        metrics[f"{name}_median_rank"] = float(np.floor(np.median(ranks))) + 1  # numpy's median, as OpenCLIP's
        for k in (1, 5, 10):
            metrics[f"{name}_R@{k}"] = float((ranks < k).mean())
    return metrics
