"""Caption decoding for CoCa: greedy and beam search over the decoder's next-token logits.

Both start every caption with the start-of-text token and end it with end-of-text (eos); a caption holds at most
`seq_len` tokens, sot and eos included, and eos is not allowed before `min_seq_len` tokens (OpenCLIP's
MinLengthLogitsProcessor). The image tower runs once per image; every step re-runs the text tower and the
decoder over the caption so far (OpenCLIP's generate does the same: no key/value cache).

- greedy: the most likely next token at every step, eos forced at the last position (OpenCLIP's `top_k` decoding
  with top_k=1 and temperature 1, which samples from a distribution with one nonzero entry, is exactly this).
- beam_search: `num_beams` running captions per image, scored by the sum of their tokens' log-probabilities; at
  every step each keeps its best continuations, a continuation by eos becomes a finished caption, and at the last
  position only eos is allowed. The caption returned has the best score divided by its length (the tokens after
  sot, eos included: Hugging Face's length_penalty 1). OpenCLIP 3.3's beam search differs: it sums raw logits
  (not log-probabilities) over 3 groups of beams (Hugging Face's group beam search, no diversity penalty).
"""

from __future__ import annotations

import torch

GENERATION_TYPES = ("beam_search", "greedy")


def _next_token_log_probs(
    model, image_tokens: torch.Tensor, texts: torch.Tensor, eos_id: int, min_seq_len: int, seq_len: int
) -> torch.Tensor:
    """log p(next token | image, caption so far), with eos ruled out before min_seq_len and the only choice at the
    last position."""
    logits = model.decode(image_tokens, texts)[:, -1].float()
    log_probs = logits.log_softmax(dim=-1)
    length = texts.shape[1]
    if length < min_seq_len:
        log_probs[:, eos_id] = -torch.inf
    if length + 1 == seq_len:
        eos = log_probs[:, eos_id].clone()
        log_probs.fill_(-torch.inf)
        log_probs[:, eos_id] = eos
    return log_probs


@torch.no_grad()
def greedy(
    model, images: torch.Tensor, *, sot_id: int, eos_id: int, pad_id: int = 0, seq_len: int = 30, min_seq_len: int = 5
) -> torch.Tensor:
    """(B, at most seq_len) token ids; a caption that ended early is padded with pad_id after its eos."""
    _check_lengths(seq_len, min_seq_len)
    image_tokens = model.visual(images)[1]
    out = torch.full((images.shape[0], 1), sot_id, dtype=torch.long, device=images.device)
    done = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
    while out.shape[1] < seq_len and not done.all():
        log_probs = _next_token_log_probs(model, image_tokens, out, eos_id, min_seq_len, seq_len)
        token = torch.where(done, pad_id, log_probs.argmax(dim=-1))
        out = torch.cat([out, token[:, None]], dim=1)
        done |= token == eos_id
    return out


@torch.no_grad()
def beam_search(
    model,
    images: torch.Tensor,
    *,
    sot_id: int,
    eos_id: int,
    pad_id: int = 0,
    seq_len: int = 30,
    min_seq_len: int = 5,
    num_beams: int = 6,
) -> torch.Tensor:
    """(B, longest caption) token ids of each image's best caption, padded with pad_id after its eos."""
    _check_lengths(seq_len, min_seq_len)
    if num_beams < 1:
        raise ValueError(f"num_beams must be at least 1, got {num_beams}")
    batch, device = images.shape[0], images.device
    image_tokens = model.visual(images)[1].repeat_interleave(num_beams, dim=0)
    texts = torch.full((batch * num_beams, 1), sot_id, dtype=torch.long, device=device)
    # only the first beam of each image is live at the start: the others would repeat it
    scores = torch.full((batch, num_beams), -torch.inf, device=device)
    scores[:, 0] = 0.0
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    while texts.shape[1] < seq_len:
        length = texts.shape[1]
        log_probs = _next_token_log_probs(model, image_tokens, texts, eos_id, min_seq_len, seq_len)
        vocab = log_probs.shape[1]
        candidates = (scores.reshape(-1, 1) + log_probs).reshape(batch, num_beams * vocab)
        # enough candidates that num_beams of them continue even if every beam's best is eos
        best, index = candidates.topk(min(2 * num_beams, num_beams * vocab), dim=1)
        next_texts, next_scores = [], []
        for b in range(batch):
            kept = []
            for score, flat in zip(best[b].tolist(), index[b].tolist()):
                if score == -torch.inf:
                    break
                beam, token = divmod(flat, vocab)
                row = texts[b * num_beams + beam]
                if token == eos_id:
                    finished[b].append((score / length, [*row.tolist(), eos_id]))
                elif len(kept) < num_beams:
                    kept.append((score, torch.cat([row, row.new_tensor([token])])))
            finished[b] = sorted(finished[b], key=lambda f: -f[0])[:num_beams]
            kept += [(-torch.inf, torch.cat([texts[b * num_beams], texts.new_tensor([pad_id])]))] * (
                num_beams - len(kept)
            )
            next_scores.append([s for s, _ in kept])
            next_texts.extend(t for _, t in kept)
        if all(s == -torch.inf for row in next_scores for s in row):
            break
        texts = torch.stack(next_texts)
        scores = torch.tensor(next_scores, device=device)
    captions = [max(f, key=lambda f: f[0])[1] if f else [sot_id, eos_id] for f in finished]
    out = torch.full((batch, max(len(c) for c in captions)), pad_id, dtype=torch.long, device=device)
    for b, caption in enumerate(captions):
        out[b, : len(caption)] = torch.tensor(caption, device=device)
    return out


def generate(model, images: torch.Tensor, generation_type: str = "beam_search", **options) -> torch.Tensor:
    """Captions (token ids) of `images` by `generation_type` (GENERATION_TYPES); options as the decoders take."""
    if generation_type not in GENERATION_TYPES:
        raise ValueError(f"generation type {generation_type!r}: choose one of {', '.join(GENERATION_TYPES)}")
    if generation_type == "greedy":
        options.pop("num_beams", None)
        return greedy(model, images, **options)
    return beam_search(model, images, **options)


def _check_lengths(seq_len: int, min_seq_len: int) -> None:
    if not 1 <= min_seq_len < seq_len:
        raise ValueError(f"need 1 <= min_seq_len ({min_seq_len}) < seq_len ({seq_len}), as OpenCLIP's generate")
