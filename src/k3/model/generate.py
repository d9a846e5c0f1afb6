"""Incremental generation over the explicit cache: prefill once, then one token per step."""
from __future__ import annotations

from typing import Iterator

import torch


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token from logits [B, V]: greedy when temperature == 0, else temperature/top-k/top-p."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def stream_generate(model, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                    eos_token_id: int | None = None, prefill=None) -> Iterator[torch.Tensor]:
    """Yields the next token [B] for each step; stops after max_new_tokens or when every row emitted EOS.

    prefill(input_ids, cache) -> logits [B, T, V] replaces the prompt's forward (e.g. to splice in images)."""
    if isinstance(input_ids, list):
        input_ids = torch.tensor([input_ids] if input_ids and isinstance(input_ids[0], int) else input_ids)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    was_training = model.training
    model.eval()
    try:
        cache = model.new_cache()
        logits = (prefill(input_ids, cache) if prefill else model(input_ids, cache=cache).logits)[:, -1]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            tok = sample_next(logits, temperature, top_k, top_p, gen)
            if eos_token_id is not None:
                tok = torch.where(done, torch.full_like(tok, eos_token_id), tok)
                done |= tok == eos_token_id
            yield tok
            if eos_token_id is not None and bool(done.all()):
                break
            logits = model(tok[:, None], cache=cache).logits[:, -1]
    finally:
        model.train(was_training)


def generate(model, input_ids, max_new_tokens: int = 64, **kwargs) -> torch.Tensor:
    """Returns [B, T + n]: the prompt followed by the generated tokens."""
    if isinstance(input_ids, list):
        input_ids = torch.tensor([input_ids] if input_ids and isinstance(input_ids[0], int) else input_ids)
    toks = list(stream_generate(model, input_ids, max_new_tokens, **kwargs))
    out = torch.stack(toks, dim=1) if toks else input_ids.new_zeros(input_ids.shape[0], 0)
    return torch.cat([input_ids, out.to(input_ids.device)], dim=1)
