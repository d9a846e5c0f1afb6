"""Incremental generation over the explicit cache: prefill once, then one token per step."""
from __future__ import annotations

from typing import Iterator

import torch

from k3.model.cuda_graph import GraphedDecodeStep, wants_graphs


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token from logits [B, V]: greedy when temperature == 0, else temperature/top-k/top-p."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temperature}, {top_p}, {top_k}")
    if temperature == 0:
        return logits.argmax(-1)
    B = logits.shape[0]
    u = torch.rand(B, generator=generator, device=generator.device if generator is not None else logits.device)
    return sample_rows(logits, [temperature] * B, [top_k] * B, [top_p] * B, u)


def sample_rows(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                u: torch.Tensor) -> torch.Tensor:
    """Sample each row of logits [B, V] with its own temperature (> 0), top-k (0 = off) and top-p, given one
    uniform number u[b] in [0, 1) per row: the token whose interval of the filtered distribution's CDF (in
    vocabulary order) holds u.

    The filter: softmax(logits / temperature); keep the k most likely tokens; of those, keep the smallest
    most-likely-first prefix whose mass reaches top_p; renormalise. A row's token depends only on its logits,
    its parameters and its u, so a request that draws u from its own generator samples the same tokens in
    any batch. Settings are host lists (no device sync); the work is a few batched kernels for any number
    of rows, where a per-row sampler launches its kernels once per row."""
    V = logits.shape[-1]
    dev = logits.device
    z = logits.float() / torch.tensor(temperature, device=dev, dtype=torch.float32)[:, None]
    probs = torch.softmax(z, -1)
    if any(0 < k < V for k in top_k) or any(p < 1 for p in top_p):  # the filters rank the tokens by likelihood
        ranked, order = torch.sort(z, descending=True, dim=-1)
        k = torch.tensor([k if 0 < k < V else V for k in top_k], device=dev)
        ranked = ranked.masked_fill(torch.arange(V, device=dev) >= k[:, None], float("-inf"))
        p_ranked = torch.softmax(ranked, -1)
        mass = torch.tensor([p if p < 1 else float("inf") for p in top_p], device=dev)  # 1: no cut, even rounded
        keep = p_ranked.cumsum(-1) - p_ranked <= mass[:, None]
        keep &= p_ranked > 0
        # the CDF below stays in vocabulary order whatever the filters: a row samples the same token for the
        # same u whether or not its batch mates needed the ranking
        probs = probs * torch.zeros_like(keep).scatter(1, order, keep)
    # flat across filtered tokens by construction: a GPU's cumsum is a tree scan, whose rounding can lift a
    # zero-probability token's running sum a few ulps above the last kept token's, where a threshold may fall
    cdf = torch.where(probs > 0, probs.cumsum(-1), 0).cummax(-1).values
    threshold = u.to(dev, torch.float32)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, threshold, right=True)[:, 0]  # the first token whose CDF passes u
    # u·total can round up to the total: fall back to the last token that has any mass
    last = V - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last)


@torch.no_grad()
def chunked_prefill(model, input_ids: torch.Tensor, cache, chunk_size: int | None = None) -> torch.Tensor:
    """Feed the prompt [B, T] through `cache`, `chunk_size` tokens at a time (all at once when None), and
    return the last position's logits [B, V]. Chunks bound the activation memory, so a long prompt is
    limited by its cache alone; the result equals one pass over the whole prompt."""
    T = input_ids.shape[1]
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    step = chunk_size or T
    for start in range(0, T, step):
        logits = model(input_ids[:, start:start + step], cache=cache, logits_to_keep=1).logits[:, -1]
    return logits


@torch.no_grad()
def stream_generate(model, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                    eos_token_id: int | None = None, prefill=None, prefill_chunk: int | None = 65536,
                    cuda_graph: bool | None = None) -> Iterator[torch.Tensor]:
    """Yields the next token [B] for each step; stops after max_new_tokens or when every row emitted EOS.

    prefill(input_ids, cache) -> logits [B, T, V] replaces the prompt's forward (e.g. to splice in images).
    prefill_chunk: feed the prompt this many tokens at a time (bounds prefill memory; None = one pass).
    cuda_graph: decode from a preallocated cache through one captured CUDA graph per token (default: on
    CUDA devices); False keeps the eager, growing cache."""
    if isinstance(input_ids, list):
        input_ids = torch.tensor([input_ids] if input_ids and isinstance(input_ids[0], int) else input_ids)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    graphed = wants_graphs(model, device, cuda_graph)
    if graphed and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
    was_training = model.training
    model.eval()
    try:
        B, T = input_ids.shape
        cache = model.new_cache(B, T + max_new_tokens) if graphed else model.new_cache()
        if prefill is not None:
            logits = prefill(input_ids, cache)[:, -1]
        else:
            logits = chunked_prefill(model, input_ids, cache, prefill_chunk)
        if graphed and max_new_tokens > 1:
            decode = GraphedDecodeStep(model, cache).step
        else:
            decode = lambda tok: model(tok[:, None], cache=cache).logits[:, -1]  # noqa: E731
        done = torch.zeros(B, dtype=torch.bool, device=device)
        for i in range(max_new_tokens):
            tok = sample_next(logits, temperature, top_k, top_p, gen)
            if eos_token_id is not None:
                tok = torch.where(done, torch.full_like(tok, eos_token_id), tok)
                done |= tok == eos_token_id
            yield tok
            if i == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
                break
            logits = decode(tok)
    finally:
        model.train(was_training)


def generate(model, input_ids, max_new_tokens: int = 64, **kwargs) -> torch.Tensor:
    """Returns [B, T + n]: the prompt followed by the generated tokens."""
    if isinstance(input_ids, list):
        input_ids = torch.tensor([input_ids] if input_ids and isinstance(input_ids[0], int) else input_ids)
    toks = list(stream_generate(model, input_ids, max_new_tokens, **kwargs))
    out = torch.stack(toks, dim=1) if toks else input_ids.new_zeros(input_ids.shape[0], 0)
    return torch.cat([input_ids, out.to(input_ids.device)], dim=1)
