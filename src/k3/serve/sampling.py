"""Per-request sampling: parameters with validation, and the sampler (greedy, temperature, top-k/top-p, seeds,
logprobs, grammar masks). Each request owns a seeded generator, so its tokens do not depend on what it was batched
with; a request with a grammar (k3.serve.grammar) has its disallowed tokens masked before sampling, while the
unconstrained rows of the same batch are left untouched."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from k3.model.generate import sample_rows

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How one request samples and when it stops. temperature 0 is greedy."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob plus the top k
    grammar: object = None  # a k3.serve.grammar.Grammar the output must follow (each sequence starts its own matcher)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_num(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > 4:
            raise ValueError(f"stop accepts at most 4 strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, list) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # [(token id, logprob)], best first


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own random stream, on the host: one uniform number per sampled token (see sample_rows)."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
    return torch.Generator().manual_seed(seed)


def make_grammar_state(params: SamplingParams):
    """The sequence's own matcher of its request's grammar, or None."""
    return params.grammar.start() if params.grammar is not None else None


def mask_grammar_rows(logits: torch.Tensor, states: list) -> torch.Tensor:
    """logits [S, V] with -inf where a row's grammar forbids the token (rows whose state is None untouched), in
    one pass. The model's own logits are kept for logprobs: a new tensor is returned when any row is masked."""
    from k3.serve.grammar import bitmask_to_bool, fill_bitmasks

    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    S, V = logits.shape
    words = max((V + 31) // 32, (states[rows[0]].grammar.ll.vocab_size + 31) // 32)
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
    fill_bitmasks([states[i] for i in rows], bitmask)
    allowed = bitmask_to_bool(bitmask, V, logits.device)
    if len(rows) < S:
        full = torch.ones(S, V, dtype=torch.bool, device=logits.device)
        full[torch.tensor(rows, device=logits.device)] = allowed
        allowed = full
    return logits.masked_fill(~allowed, float("-inf"))


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  grammars: list | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [S, V], one row per sequence → (next token per row, logprobs per row or None).
    The sampled rows go through one batched `sample_rows`, each with a uniform number from its own generator;
    everything is read back together: one wait per step, not one per row. grammars: per row, a GrammarState
    (k3.serve.grammar) or None; constrained rows sample from their allowed tokens and their states advance.
    Logprobs are the model's own (vLLM's default, raw logprobs), not the masked distribution's."""
    raw = logits = logits.float()
    if grammars is not None:
        logits = mask_grammar_rows(logits, grammars)
    picked = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows])
        picked[rows] = sample_rows(logits[rows], [params[i].temperature for i in rows],
                                   [params[i].top_k for i in rows], [params[i].top_p for i in rows], u)
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], -1)
        chosen = lp.gather(1, picked[want][:, None])[:, 0]
        top = torch.topk(lp, max(params[i].logprobs for i in want), dim=-1)
    tokens = picked.tolist()
    for state, token in zip(grammars or [], tokens):
        if state is not None:
            state.advance(token)
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if want:
        chosen, top_ids, top_lps = chosen.tolist(), top.indices.tolist(), top.values.tolist()
        for row, i in enumerate(want):
            k = params[i].logprobs
            logprobs[i] = TokenLogprob(tokens[i], chosen[row], list(zip(top_ids[row][:k], top_lps[row][:k])))
    return tokens, logprobs
