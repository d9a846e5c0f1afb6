"""Incremental generation over the explicit cache: prefill once, then one token per step."""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Iterator

import torch

from k3.memory import check_fits
from k3.model.cache import BatchCacheView
from k3.model.cuda_graph import GraphedDecodeStep, wants_graphs


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """A ValueError, its message starting with the field's name, unless temperature >= 0 (finite), 0 < top_p <= 1
    and top_k an integer >= 0: the one rule for these three, `generate`'s and the server's (SamplingParams)."""
    def is_num(v):  # numpy's scalars too; a bool (JSON's true) is not a number here
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    if not is_num(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if not is_num(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick the next token from logits [B, V]: greedy when temperature == 0, else temperature/top-k/top-p."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    B = logits.shape[0]
    u = torch.rand(B, generator=generator, device=generator.device if generator is not None else logits.device)
    return sample_rows(logits, [temperature] * B, [top_k] * B, [top_p] * B, u)


def sample_rows(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
                u: torch.Tensor, min_p: list[float] | None = None) -> torch.Tensor:
    """Sample each row of logits [B, V] with its own temperature (> 0), top-k (0 = off) and top-p, given one
    uniform number u[b] in [0, 1) per row: the token whose interval of the filtered distribution's CDF (in
    vocabulary order) holds u.

    The filter (vLLM's order): softmax(logits / temperature); drop the tokens whose probability is below min_p
    (0 = off) times the most likely one's; keep the k most likely tokens; of those, keep the smallest
    most-likely-first prefix whose mass reaches top_p; renormalise. A row's token depends only on its logits,
    its parameters and its u, so a request that draws u from its own generator samples the same tokens in
    any batch. Settings are host lists (no device sync); the work is a few batched kernels for any number
    of rows, where a per-row sampler launches its kernels once per row."""
    V = logits.shape[-1]
    dev = logits.device
    # the settings go to the device in one copy each of floats and ints that does not wait for queued kernels
    temp_t, min_p_t, mass = BatchCacheView.upload(
        [temperature, min_p or [], [p if p < 1 else float("inf") for p in top_p]],  # 1: no cut, even rounded
        dev, torch.float32)
    k_t, = BatchCacheView.upload([[k if 0 < k < V else V for k in top_k]], dev)
    z = logits.float() / temp_t[:, None]
    probs = torch.softmax(z, -1)
    if min_p is not None and any(m > 0 for m in min_p):
        floor = min_p_t[:, None] * probs.max(-1, keepdim=True).values
        z = z.masked_fill(probs < floor, float("-inf"))
        probs = torch.softmax(z, -1)
    if any(0 < k < V for k in top_k) or any(p < 1 for p in top_p):  # the filters rank the tokens by likelihood
        ranked, order = torch.sort(z, descending=True, dim=-1)
        ranked = ranked.masked_fill(torch.arange(V, device=dev) >= k_t[:, None], float("-inf"))
        p_ranked = torch.softmax(ranked, -1)
        keep = p_ranked.cumsum(-1) - p_ranked <= mass[:, None]
        keep &= p_ranked > 0
        # the CDF below stays in vocabulary order whatever the filters: a row samples the same token for the
        # same u whether or not its batch mates needed the ranking
        probs = probs * torch.zeros_like(keep).scatter(1, order, keep)
    # flat across filtered tokens by construction: a GPU's cumsum is a tree scan, whose rounding can lift a
    # zero-probability token's running sum a few ulps above the last kept token's, where a threshold may fall
    cdf = torch.where(probs > 0, probs.cumsum(-1), 0).cummax(-1).values
    threshold = u.to(dev, torch.float32, non_blocking=True)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, threshold, right=True)[:, 0]  # the first token whose CDF passes u
    # u·total can round up to the total: fall back to the last token that has any mass
    last = V - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.minimum(idx, last)


# What one prefill chunk's activations may take on CPU (on a GPU: a quarter of its free memory, at least this).
PREFILL_BUDGET_BYTES = 512 * 2**20
# Activation bytes per prompt token of a chunk, in hidden-size widths of the model's dtype: the working set of a
# layer (norms, AttnRes sources, projections, MoE rows); measured ~78 on `tiny` (40 KB/token at hidden 128, fp32).
_WIDTHS_PER_TOKEN = 96
# CPU SDPA materialises fp32 scores for the chunk's queries × the whole context: ~2.3 copies measured on `tiny`.
_SCORE_COPIES = 3


def prefill_budget(device: torch.device) -> int:
    """Bytes one prefill chunk's activations may take on `device`."""
    if device.type == "cuda":
        return max(PREFILL_BUDGET_BYTES, torch.cuda.mem_get_info(device)[0] // 4)
    return PREFILL_BUDGET_BYTES


def _chunk_costs(config, batch: int, device: torch.device, dtype: torch.dtype) -> tuple[int, int, int]:
    """Estimated bytes of a prefill chunk of c tokens ending at context length S: c·per_token + S·per_key
    + c·S·per_pair. per_key: an MLA layer expands the whole cached context into K and V for the chunk;
    per_pair: the attention scores, which CPU SDPA materialises (a GPU's fused kernels do not)."""
    elt = torch.empty((), dtype=dtype, device="meta").element_size()
    per_token = batch * elt * _WIDTHS_PER_TOKEN * config.hidden_size
    if not config.mla_layer_ids:
        return per_token, 0, 0
    H, dk, dv = config.num_attention_heads, config.qk_head_dim, config.v_head_dim
    per_key = batch * elt * H * (2 * dk + dv)  # kv_b_proj's K_nope and V, then K with its shared rope part
    per_pair = 0 if device.type == "cuda" else batch * 4 * H * _SCORE_COPIES
    return per_token, per_key, per_pair


def prefill_chunk_sizes(config, batch: int, prompt_len: int, device: torch.device, dtype: torch.dtype,
                        budget: int | None = None, start: int = 0) -> list[int]:
    """The "auto" prefill schedule: each chunk as long as fits `budget` bytes of activations (default
    `prefill_budget(device)`), so chunks shrink as the context grows. A chunk of one token takes the decode
    path (no K/V expansion, no score matrix), so even a context whose expansion alone exceeds the budget
    goes on, a token at a time. `start`: tokens already in the cache."""
    budget = prefill_budget(device) if budget is None else budget
    per_token, per_key, per_pair = _chunk_costs(config, batch, device, dtype)
    cost = lambda c, pos: c * per_token + (pos + c) * per_key + c * (pos + c) * per_pair  # noqa: E731
    sizes, pos, end = [], start, start + prompt_len
    while pos < end:
        # the largest c with per_pair·c² + (per_token + per_key + per_pair·pos)·c + pos·per_key − budget <= 0
        b, c0 = per_token + per_key + per_pair * pos, pos * per_key - budget
        if c0 >= 0:
            c = 0
        elif per_pair == 0:
            c = -c0 / b
        else:
            c = (-b + math.sqrt(b * b - 4 * per_pair * c0)) / (2 * per_pair)
        c = min(int(c), end - pos)
        while c > 1 and cost(c, pos) > budget:  # float rounding of the root
            c -= 1
        sizes.append(max(c, 1))
        pos += sizes[-1]
    return sizes


def prefill_memory(config, batch: int, total_len: int, device: torch.device, dtype: torch.dtype,
                   budget: int | None = None) -> int:
    """Bytes a generation of `total_len` tokens needs beyond the weights: the cache at full length (MLA
    latents, growing by copy, so one layer's twice; KDA states), plus one prefill chunk's budget."""
    elt = torch.empty((), dtype=dtype, device="meta").element_size()
    la = config.linear_attn_config
    n_mla = len(config.mla_layer_ids)
    mla_layer = batch * total_len * (config.kv_lora_rank + config.qk_rope_head_dim) * elt
    kda = (config.num_hidden_layers - n_mla) * batch * la.num_heads * la.head_dim * (
        la.head_dim + 3 * (la.short_conv_kernel_size - 1)) * 4
    return (n_mla + (n_mla > 0)) * mla_layer + kda + (prefill_budget(device) if budget is None else budget)


@torch.no_grad()
def chunked_prefill(model, input_ids: torch.Tensor, cache, chunk_size: int | str | None = "auto") -> torch.Tensor:
    """Feed the prompt [B, T] through `cache` in chunks and return the last position's logits [B, V].
    chunk_size: "auto" (`prefill_chunk_sizes`: as long as fits the activation budget), an int (that many
    tokens a chunk) or None (one pass). Chunks bound the activation memory, so a long prompt is limited by
    its cache alone; the result equals one pass over the whole prompt."""
    T = input_ids.shape[1]
    if chunk_size == "auto":
        w = model.model.embed_tokens.weight
        sizes = prefill_chunk_sizes(model.config, input_ids.shape[0], T, w.device, w.dtype, start=cache.seq_len)
    elif chunk_size is None:
        sizes = [T]
    elif isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size > 0:
        sizes = [min(chunk_size, T - s) for s in range(0, T, chunk_size)]
    else:
        raise ValueError(f"chunk_size must be a positive int, 'auto' or None, got {chunk_size!r}")
    start = 0
    for n in sizes:
        logits = model(input_ids[:, start:start + n], cache=cache, logits_to_keep=1).logits[:, -1]
        start += n
    return logits


# transformers' generate arguments that k3 spells differently or does not have, and what to do instead
_HF_INSTEAD = {
    "max_length": "give max_new_tokens (the tokens after the prompt)",
    "do_sample": "sampling is temperature > 0 (temperature=0, the default, is greedy)",
    "attention_mask": "rows of one call share their length and have no padding; generate ragged prompts one by "
                      "one or through k3.serve's engine",
    "num_beams": "k3 has no beam search (greedy or sampling only)",
    "generation_config": "pass max_new_tokens, temperature, top_k, top_p, seed and eos_token_id directly",
    "pad_token_id": "rows are never padded; finished rows repeat their EOS id",
}


def _as_batch(input_ids) -> tuple[torch.Tensor, bool]:
    """[B, T] ids from a list, a list of lists, a 1-D or a 2-D tensor; True when the input was one 1-D row."""
    if isinstance(input_ids, list):
        return torch.tensor([input_ids] if input_ids and isinstance(input_ids[0], int) else input_ids), False
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
        return input_ids[None], True
    return input_ids, False


def _eos_ids(model, eos_token_id) -> list[int]:
    """The ids that end a row: `eos_token_id` ("config": the model config's; None: never stop early)."""
    if isinstance(eos_token_id, str) and eos_token_id == "config":
        eos_token_id = model.config.eos_token_id
    if eos_token_id is None:
        return []
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"eos_token_id must be an int, a list of ints, None or 'config', got {eos_token_id!r}")
    return list(ids)


def stream_generate(model, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                    eos_token_id: int | list[int] | str | None = "config", prefill=None,
                    prefill_chunk: int | str | None = "auto", cuda_graph: bool | None = None,
                    **unsupported) -> Iterator[torch.Tensor]:
    """Yields the next token [B] for each step; stops after max_new_tokens or when every row emitted EOS.

    input_ids: [B, T] (or one row: a 1-D tensor or a list of ints). eos_token_id: the id(s) that end a row;
    "config" (default) takes the model config's, None never stops early. A prompt longer than the config's
    max_position_embeddings is a ValueError; a generation that would run past it stops there, with a warning.
    prefill(input_ids, cache) -> logits [B, T, V] replaces the prompt's forward (e.g. to splice in images).
    prefill_chunk: "auto" (default) feeds the prompt in chunks sized to a memory budget (`prefill_chunk_sizes`);
    an int, that many tokens at a time; None, one pass. cuda_graph: decode from a preallocated cache through
    one captured CUDA graph per token (default: on CUDA devices); False keeps the eager, growing cache.
    Arguments, limits and memory are checked when called, before the first token is asked for; a transformers
    argument k3 does not take is a TypeError saying what to use instead."""
    for name in unsupported:
        raise TypeError(f"generate() got an unexpected keyword argument {name!r}"
                        + (f": {_HF_INSTEAD[name]}" if name in _HF_INSTEAD else ""))
    input_ids, _ = _as_batch(input_ids)
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a non-empty [batch, seq] or [seq] tensor (or a list of ids), got {shape}")
    check_sampling(temperature, top_k, top_p)
    eos = _eos_ids(model, eos_token_id)
    B, T = input_ids.shape
    limit = model.config.max_position_embeddings
    if T > limit:
        raise ValueError(f"the prompt has {T:,} tokens; the model's max_position_embeddings is {limit:,}: "
                         f"shorten the prompt")
    if T + max_new_tokens > limit:
        warnings.warn(f"generating at most {limit - T:,} of max_new_tokens={max_new_tokens:,} tokens: the model's "
                      f"max_position_embeddings is {limit:,} and the prompt has {T:,}", stacklevel=2)
        max_new_tokens = limit - T
    device = next(model.parameters()).device
    w = model.model.embed_tokens.weight
    check_fits(f"generating {T:,} + {max_new_tokens:,} tokens x {B} rows (cache and one prefill chunk)",
               prefill_memory(model.config, B, T + max_new_tokens, device, w.dtype), device)
    input_ids = input_ids.to(device)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    graphed = wants_graphs(model, device, cuda_graph)
    if graphed and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
    return _token_stream(model, input_ids, max_new_tokens, temperature, top_k, top_p, gen, eos, prefill,
                         prefill_chunk, graphed)


@torch.no_grad()
def _token_stream(model, input_ids, max_new_tokens, temperature, top_k, top_p, gen, eos, prefill, prefill_chunk,
                  graphed) -> Iterator[torch.Tensor]:
    """stream_generate's loop, over arguments it has checked: prefill, then sample and decode token by token."""
    (B, T), device = input_ids.shape, input_ids.device
    was_training = model.training
    model.eval()
    try:
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
        eos_t = torch.tensor(eos, dtype=torch.long, device=device)
        for i in range(max_new_tokens):
            tok = sample_next(logits, temperature, top_k, top_p, gen)
            if eos:  # a finished row repeats its first EOS id
                tok = torch.where(done, torch.full_like(tok, eos[0]), tok)
                done |= torch.isin(tok, eos_t)
            yield tok
            if i == max_new_tokens - 1 or (eos and bool(done.all())):
                break
            logits = decode(tok)
    finally:
        model.train(was_training)


def generate(model, input_ids, max_new_tokens: int = 64, **kwargs) -> torch.Tensor:
    """Returns the prompt followed by the generated tokens: [B, T + n] (a 1-D prompt gives [T + n]); n is
    shorter than max_new_tokens when every row stopped at EOS. Keywords as in `stream_generate`."""
    batch, one_row = _as_batch(input_ids)
    toks = list(stream_generate(model, batch, max_new_tokens, **kwargs))
    out = torch.stack(toks, dim=1) if toks else batch.new_zeros(batch.shape[0], 0)
    full = torch.cat([batch, out.to(batch.device)], dim=1)
    return full[0] if one_row else full
