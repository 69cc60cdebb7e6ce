"""Caption decoding for CoCa: greedy and beam search over the decoder's next-token logits.

Both start every caption with the start-of-text token and end it with end-of-text (eos); a caption holds at most
`seq_len` tokens, sot and eos included, and eos is not allowed before `min_seq_len` tokens (OpenCLIP's
MinLengthLogitsProcessor). The image tower runs once per image; every step re-runs the text tower and the
decoder over the caption so far (OpenCLIP's generate does the same: no key/value cache).

- greedy: the most likely next token at every step, eos forced at the last position (OpenCLIP's `top_k` decoding
  with top_k=1 and temperature 1, which samples from a distribution with one nonzero entry, is exactly this).
- beam_search: Hugging Face's beam search as OpenCLIP main's generate runs it (transformers' GenerationMixin with
  one beam group, length_penalty 1, early_stopping False): `num_beams` running captions per image scored by the
  sum of their tokens' log-probabilities; a caption ends with eos or at `seq_len` tokens (then without eos), and
  the one returned has the best score divided by its number of tokens after sot. OpenCLIP 3.3's beam search
  differs: it sums raw logits (not log-probabilities) over 3 groups of beams.
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
    """(B, longest caption) token ids of each image's best caption, padded with pad_id after its end.

    Hugging Face's beam search (transformers 5's GenerationMixin._beam_search, which OpenCLIP main's generate runs
    with one beam group) with its defaults: length_penalty 1, early_stopping False, one eos id, the prompt [sot]."""
    _check_lengths(seq_len, min_seq_len)
    if num_beams < 1:
        raise ValueError(f"num_beams must be at least 1, got {num_beams}")
    batch, beams, device = images.shape[0], num_beams, images.device
    image_tokens = model.visual(images)[1].repeat_interleave(beams, dim=0)
    running = torch.full((batch, beams, seq_len), pad_id, dtype=torch.long, device=device)
    running[:, :, 0] = sot_id
    # only the first beam is live at the start (the others would repeat it); -1e9 as Hugging Face marks the dead
    running_scores = torch.full((batch, beams), -1e9, device=device)
    running_scores[:, 0] = 0.0
    done = torch.full_like(running, pad_id)
    done_scores = torch.full((batch, beams), -1e9, device=device)
    done_lengths = torch.ones((batch, beams), dtype=torch.long, device=device)
    is_done = torch.zeros((batch, beams), dtype=torch.bool, device=device)
    may_improve = torch.ones((batch, 1), dtype=torch.bool, device=device)
    in_top_beams = torch.arange(2 * beams, device=device) < beams  # only these candidates may finish

    def pick(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # t[b, index[b, j]] along dim 1
        return t.gather(1, index.view(*index.shape, *([1] * (t.dim() - 2))).expand(*index.shape, *t.shape[2:]))

    length = 1
    while length < seq_len:
        logits = model.decode(image_tokens, running[:, :, :length].reshape(batch * beams, length))[:, -1].float()
        log_probs = logits.log_softmax(dim=-1)
        if length < min_seq_len:
            log_probs[:, eos_id] = -torch.inf
        vocab = log_probs.shape[-1]
        total = (log_probs.view(batch, beams, vocab) + running_scores[:, :, None]).view(batch, beams * vocab)
        top_scores, top_index = total.topk(2 * beams, dim=1)
        candidates = pick(running, top_index // vocab).clone()
        tokens = top_index % vocab
        candidates[:, :, length] = tokens
        ends = (tokens == eos_id) | (length + 1 >= seq_len)  # eos, or the longest caption
        # the beams that go on: the best candidates that did not end
        alive = top_scores + ends.float() * -1e9
        keep = alive.topk(beams, dim=1).indices
        next_running, next_scores = pick(candidates, keep), pick(alive, keep)
        # the finished captions: the best so far and those that just ended among the top `beams` candidates,
        # scored by their mean log-probability over the tokens after sot
        finishing = ends & in_top_beams
        scores = top_scores / length + (~may_improve).float() * -1e9 + (~finishing).float() * -1e9
        merged = torch.cat([done_scores, scores], dim=1).topk(beams, dim=1).indices
        done = pick(torch.cat([done, candidates], dim=1), merged)
        done_scores = pick(torch.cat([done_scores, scores], dim=1), merged)
        lengths = torch.full_like(tokens, length + 1)
        done_lengths = pick(torch.cat([done_lengths, lengths], dim=1), merged)
        is_done = pick(torch.cat([is_done, finishing], dim=1), merged)
        running, running_scores = next_running, next_scores
        length += 1
        # Hugging Face's early_stopping=False heuristic: stop once the best running beam, ended now, would not beat
        # the worst finished caption
        best_running = running_scores[:, :1] / (length - 1)
        worst_done = torch.where(is_done, done_scores.min(dim=1, keepdim=True).values, -1e9)
        may_improve = may_improve & (best_running > worst_done).any(dim=-1, keepdim=True)
        if not may_improve.any() or ends.all():
            break
    return done[:, 0, : int(done_lengths[:, 0].max())]


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
