"""Per-request sampling: parameters with validation, and the sampler (greedy, temperature, top-k/top-p/min-p,
seeds, logprobs, grammar masks, logit bias, penalties, min_tokens). Each request owns a seeded generator, so its
tokens do not depend on what it was batched with; a request with a grammar (k3.serve.grammar) has its disallowed
tokens masked before sampling, while the unconstrained rows of the same batch are left untouched.

The order of operations is vLLM's: min_tokens and logit_bias, then the penalties (repetition, frequency,
presence) on the logits, then temperature, then min_p, top-k and top-p (k3.model.generate.sample_rows)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3.model.cache import BatchCacheView
from k3.model.generate import check_sampling, sample_rows

upload = BatchCacheView.upload  # host lists → device in one copy that does not wait for queued kernels
send = BatchCacheView.send  # a host tensor → device, the same way

MAX_LOGPROBS = 20
# Bounds on a request's lists (the HTTP layer's models use these numbers): each is read per sampled token, so an
# unbounded one lets a single request slow every stream (3M stop ids made each step 4x slower).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024   # each stop string: the text held back from a stream is as long as the longest
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024          # entries of logit_bias
MAX_SEED = 2**64               # seeds lie in [0, MAX_SEED): what torch.Generator.manual_seed takes
# Prompt logprobs held per sequence: prompt tokens × (k + 1) (each token's own logprob and its top k). On the host an
# entry costs ~120 B as kept by the engine and ~600 B at the peak of rendering the JSON reply, so this bounds one
# sequence to ~0.6 GB; it still admits lm-eval's loglikelihood_rolling (k = 1) over a 512K-token document, or the
# top 20 over ~50K tokens. Unbounded, a 1M-token prompt at k = 20 would need ~13 GB of host memory.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 20
# repetition_penalty's range: past it a float32 logit scaled by it overflows to inf or underflows to 0 (and 0 × inf is
# NaN), which left every step sampling the last id; 100 already turns a logit of 30 into 0.3
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass
class SamplingParams:
    """How one request samples and when it stops. temperature 0 is greedy. Penalties, logit_bias and min_tokens
    change greedy picks too; temperature, min_p, top_k and top_p only shape random sampling."""
    max_tokens: int = 16  # 0: score the prompt only (prefill, prompt_logprobs), sample nothing
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob plus the top k
    grammar: object = None  # a k3.serve.grammar.Grammar the output must follow (each sequence starts its own matcher)
    prompt_logprobs: int | None = None  # None: off; k >= 0: each prompt token's logprob plus the top k
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    min_p: float = 0.0  # drop tokens less likely than min_p × the most likely one's probability (after temperature)
    presence_penalty: float = 0.0  # OpenAI: minus this from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI: minus this × the token's count in the output so far
    repetition_penalty: float = 1.0  # HF/vLLM: logits of prompt and output tokens divided (> 0) or multiplied (< 0)
    logit_bias: dict[int, float] | None = None  # token id → added to its logit, in [-100, 100]

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Raise ValueError, its message starting with the field's name, for any value out of range."""
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters each")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids accepts at most {MAX_STOP_TOKEN_IDS} ids, "
                             f"got {len(self.stop_token_ids)}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not is_num(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be a number in [{low:g}, {high:g}] (1 = off), "
                             f"got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token id to bias, got "
                                 f"{type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias accepts at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            for t, b in self.logit_bias.items():
                if not is_int(t) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                if not is_num(b) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether the sampler must know the sequence's tokens (repetition/frequency/presence penalties)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


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
    # pinned on CUDA, so its copy to the device does not wait for queued kernels
    bitmask = torch.zeros(len(rows), words, dtype=torch.int32, pin_memory=logits.is_cuda)
    fill_bitmasks([states[i] for i in rows], bitmask)
    allowed = bitmask_to_bool(bitmask, V, logits.device)
    if len(rows) < S:
        full = torch.ones(S, V, dtype=torch.bool, device=logits.device)
        allowed = full.index_copy_(0, upload([rows], logits.device)[0], allowed)
    return logits.masked_fill(~allowed, float("-inf"))


class LogitAdjuster:
    """What one sequence's request adds to the model's logits before sampling, prepared once instead of per step:
    logit_bias as (ids, values), the ids min_tokens bans (its stop ids, and EOS unless ignore_eos), and for the
    penalties the count of each generated id and which ids the prompt or output holds, kept current by
    `record_tokens` rather than rescanned. Tensors live on the logits' device and cover its vocabulary (made on
    first use). Each step stacks the penalised rows' tensors once: the sequences then keep views of that stack,
    which `record_tokens` counts the new tokens into."""

    def __init__(self, params: SamplingParams, prompt: list[int], eos_ids=frozenset()):
        self.penalized = params.penalized
        self._bias = dict(params.logit_bias or {})
        self._banned = (set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
                        if params.min_tokens else set())
        self._prompt = prompt if self.penalized else None
        self.num_bias = self.num_banned = 0
        self.bias_ids = self.bias_values = self.banned_ids = None
        self.counts: torch.Tensor | None = None  # [V] float32 (exact to 2**24; no int→float pass per step)
        self.seen: torch.Tensor | None = None  # [V] bool: in the prompt or the output (repetition penalty)
        self.stacked: tuple | None = None  # (counts [R, V], seen [R, V], row): this step's stack holding its views

    def materialize(self, vocab: int, device: torch.device) -> None:
        if self._bias is None:
            return
        bias = [(t, float(b)) for t, b in self._bias.items() if t < vocab]  # ids past it are never sampled
        self.num_bias = len(bias)
        banned = sorted(t for t in self._banned if t < vocab)
        self.num_banned = len(banned)
        prompt = [t for t in self._prompt if t < vocab] if self.penalized else []
        self.bias_ids, self.banned_ids, ids = upload([[t for t, _ in bias], banned, prompt], device)
        self.bias_values, = upload([[b for _, b in bias]], device, torch.float32)
        if self.penalized:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill_(0, ids, True)
        self._bias = self._banned = self._prompt = None


def make_adjuster(params: SamplingParams, prompt: list[int], eos_ids=frozenset()) -> LogitAdjuster | None:
    """The sequence's LogitAdjuster, or None when its request changes no logit (it then costs nothing)."""
    if params.logit_bias or params.min_tokens or params.penalized:
        return LogitAdjuster(params, prompt, eos_ids)
    return None


def _flat_entries(rows: torch.Tensor, sizes: torch.Tensor, total: int, parts: list[torch.Tensor],
                  vocab: int) -> torch.Tensor:
    """Flat positions row × vocab + id of every entry of the rows' id tensors (`parts`), with no read-back:
    the entry count is known on the host."""
    return torch.repeat_interleave(rows, sizes, output_size=total) * vocab + torch.cat(parts)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams], adjusters: list | None = None,
                  banning: list[bool] | None = None) -> torch.Tensor:
    """The logits [S, V] that sampling reads, in vLLM's order: min_tokens bans (rows with banning[i] true set
    their banned ids to -inf), logit_bias, then repetition, frequency and presence penalties. adjusters: per
    row a LogitAdjuster or None. Rows without one cost nothing; when no row has one, `logits` itself is
    returned (else a new tensor: the model's own logits stay for logprobs). The step's row lists go to the
    device in one copy; each kind is then a few kernels over the rows' prepared tensors, whatever the number
    of entries, and nothing is read back."""
    if not adjusters or all(a is None for a in adjusters):
        return logits
    S, V = logits.shape
    dev = logits.device
    for a in adjusters:
        if a is not None:
            a.materialize(V, dev)
    ban = [i for i, a in enumerate(adjusters) if a is not None and a.num_banned and banning and banning[i]]
    bias = [i for i, a in enumerate(adjusters) if a is not None and a.num_bias]
    penalised = [i for i, a in enumerate(adjusters) if a is not None and a.penalized]
    ban_sizes = [adjusters[i].num_banned for i in ban]
    bias_sizes = [adjusters[i].num_bias for i in bias]
    ban_t, ban_sizes_t, bias_t, bias_sizes_t, pen_t = upload([ban, ban_sizes, bias, bias_sizes, penalised], dev)
    logits = logits.clone()
    flat = logits.view(-1)
    if ban:
        at = _flat_entries(ban_t, ban_sizes_t, sum(ban_sizes), [adjusters[i].banned_ids for i in ban], V)
        flat.index_fill_(0, at, float("-inf"))
    if bias:
        at = _flat_entries(bias_t, bias_sizes_t, sum(bias_sizes), [adjusters[i].bias_ids for i in bias], V)
        flat.index_add_(0, at, torch.cat([adjusters[i].bias_values for i in bias]).to(logits.dtype))
    if penalised:
        counts, seen = _stack_penalty_state([adjusters[i] for i in penalised])  # [R, V] each
        settings = [(params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty)
                    for i in penalised]
        rep, freq, pres = upload([[v for row in zip(*settings) for v in row]], dev, torch.float32)[0] \
            .to(logits.dtype).view(3, len(penalised), 1)
        x = logits.index_select(0, pen_t)
        if any(r != 1 for r, _, _ in settings):  # each part only when some row uses it: passes over [R, V]
            x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        if any(f or p for _, f, p in settings):
            x = x - (freq * counts + pres * (counts > 0))
        logits.index_copy_(0, pen_t, x)
    return logits


def _stack_penalty_state(adjusters: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' counts and seen as [R, V] stacks; each adjuster keeps views of its row (no second copy)."""
    counts = torch.stack([a.counts for a in adjusters])
    seen = torch.stack([a.seen for a in adjusters])
    for j, a in enumerate(adjusters):
        a.counts, a.seen, a.stacked = counts[j], seen[j], (counts, seen, j)
    return counts, seen


def record_tokens(adjusters: list | None, picked: torch.Tensor) -> None:
    """Count each penalised row's new token (picked [S]) in its LogitAdjuster: one scatter into the stack that
    adjust_logits made this step (a new stack only when these rows were not stacked together)."""
    rows = [i for i, a in enumerate(adjusters or []) if a is not None and a.penalized]
    if not rows:
        return
    penalised = [adjusters[i] for i in rows]
    first = penalised[0].stacked
    same = first is not None and first[0].shape[0] == len(penalised) and all(
        a.stacked is not None and a.stacked[0] is first[0] and a.stacked[2] == j for j, a in enumerate(penalised))
    counts, seen = (first[0], first[1]) if same else _stack_penalty_state(penalised)
    dev, V = picked.device, counts.shape[1]
    rows_t, = upload([rows], dev)
    at = torch.arange(len(rows), device=dev) * V + picked.index_select(0, rows_t)
    counts.view(-1).index_add_(0, at, torch.ones(len(rows), device=dev, dtype=counts.dtype))
    seen.view(-1).index_fill_(0, at, True)
    for a in penalised:
        a.stacked = None


def score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """log_softmax of logits [n, V] in float32 → (each row's target logprob [n], top-k ids [n, k] and their
    logprobs [n, k], best first)."""
    lp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(lp, k, dim=-1)
    return lp.gather(1, targets[:, None])[:, 0], top.indices, top.values


@dataclass
class DeviceRead:
    """read_back's values on their way to the host: on CUDA a non-blocking copy into pinned memory and the
    event after it, so the read waits for the work queued before the copy only, not for a step launched since
    (async output). On a CPU the tensor itself."""
    host: torch.Tensor  # the ids [n], or ids, chosen, top ids and top logprobs flattened into float64
    event: object
    n: int
    m: int
    k: int


def start_read(ids: torch.Tensor, scores: tuple[torch.Tensor, ...] | None = None) -> DeviceRead:
    """Queue the copy of ids [n] and score_rows' (chosen [m], top ids [m, k], top logprobs [m, k]) to the host.
    Float64 holds the ids and the float32 logprobs exactly."""
    m, k = scores[1].shape if scores is not None else (0, 0)
    flat = ids if scores is None else torch.cat([ids.double(), scores[0].double(), scores[1].double().flatten(),
                                                 scores[2].double().flatten()])
    if not flat.is_cuda:
        return DeviceRead(flat, None, ids.shape[0], m, k)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return DeviceRead(host, event, ids.shape[0], m, k)


def read_back(ids: torch.Tensor | DeviceRead, scores: tuple[torch.Tensor, ...] | None = None
              ) -> tuple[list[int], tuple[list, list, list] | None]:
    """ids [n] and score_rows' (chosen [m], top ids [m, k], top logprobs [m, k]) as host lists, in one copy from
    the device (or a copy `start_read` queued earlier): each read waits for the kernels queued before its copy,
    so a step reads once."""
    read = ids if isinstance(ids, DeviceRead) else start_read(ids, scores)
    if read.event is not None:
        read.event.synchronize()
    flat = read.host.tolist()
    n, m, k = read.n, read.m, read.k
    if read.host.dtype != torch.float64:
        return flat, None
    at = n + m
    rows = lambda xs: [xs[r * k:(r + 1) * k] for r in range(m)]  # noqa: E731
    return ([int(t) for t in flat[:n]],
            (flat[n:at], rows([int(t) for t in flat[at:at + m * k]]), rows(flat[at + m * k:])))


def token_logprobs(tokens: list[int], chosen: list[float], top_ids: list[list[int]], top_lps: list[list[float]],
                   ks: list[int]) -> list[TokenLogprob]:
    """Host lists (from score_rows) → one TokenLogprob per row, row i keeping its own ks[i] best."""
    return [TokenLogprob(t, c, list(zip(ids[:k], lps[:k])))
            for t, c, ids, lps, k in zip(tokens, chosen, top_ids, top_lps, ks)]


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                  grammars: list | None = None, adjusters: list | None = None,
                  banning: list[bool] | None = None, agree: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [S, V], one row per sequence → (next token per row, logprobs per row or None).
    The sampled rows go through one batched `sample_rows`, each with a uniform number from its own generator;
    everything is read back together: one wait per step, not one per row. grammars: per row, a GrammarState
    (k3.serve.grammar) or None; constrained rows sample from their allowed tokens and their states advance.
    adjusters: per row, its LogitAdjuster or None (penalty counts advance here); banning: per row, whether
    min_tokens still bans its stop ids. See adjust_logits.
    Logprobs are the model's own (vLLM's default, raw logprobs), not the adjusted distribution's.
    agree: replaces the picked ids [S] before any state advances (distributed serving: every rank takes rank 0's)."""
    return finish_sampling(launch_sampling(logits, params, generators, grammars, adjusters, banning, agree))


@dataclass
class PendingSample:
    """What `launch_sampling` queued on the device: the picked ids [S] (the next step may feed them without a
    read-back), the logprob rows asked for, and what `finish_sampling` needs to turn them into host values."""
    picked: torch.Tensor
    read: DeviceRead
    want: list[int]
    params: list[SamplingParams]
    grammars: list | None


def launch_sampling(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                    grammars: list | None = None, adjusters: list | None = None, banning: list[bool] | None = None,
                    agree: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PendingSample:
    """sample_tokens' device half: pick every row's token and count it into the penalties, with no read-back."""
    raw = logits = logits.float()
    logits = adjust_logits(logits, params, adjusters, banning)
    if grammars is not None:
        logits = mask_grammar_rows(logits, grammars)
    picked = logits.argmax(-1)
    dev = logits.device
    rows = [i for i, p in enumerate(params) if not p.greedy]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    rows_t, want_t = upload([rows, want], dev) if rows or want else (None, None)
    if rows:
        u = send(torch.cat([torch.rand(1, generator=generators[i]) for i in rows]), dev)
        drawn = sample_rows(logits.index_select(0, rows_t), [params[i].temperature for i in rows],
                            [params[i].top_k for i in rows], [params[i].top_p for i in rows], u,
                            [params[i].min_p for i in rows])
        picked.index_copy_(0, rows_t, drawn)
    if agree is not None:
        picked = agree(picked)
    record_tokens(adjusters, picked)
    scores = score_rows(raw.index_select(0, want_t), picked.index_select(0, want_t),
                        max(params[i].logprobs for i in want)) if want else None
    return PendingSample(picked, start_read(picked, scores), want, params, grammars)


def finish_sampling(pending: PendingSample) -> tuple[list[int], list[TokenLogprob | None]]:
    """sample_tokens' host half: one read-back, then the grammars advance and the logprobs take their shape."""
    tokens, scores = read_back(pending.read)
    for state, token in zip(pending.grammars or [], tokens):
        if state is not None:
            state.advance(token)
    params, want = pending.params, pending.want
    logprobs: list[TokenLogprob | None] = [None] * len(params)
    if want:
        rows_lp = token_logprobs([tokens[i] for i in want], *scores, [params[i].logprobs for i in want])
        for i, lp in zip(want, rows_lp):
            logprobs[i] = lp
    return tokens, logprobs
