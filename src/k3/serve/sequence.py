"""One request as the engine sees it: tokens, progress through the model, where its state lives, how it stops."""
from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from k3.serve.sampling import SamplingParams, TokenLogprob

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"    # never admitted
    RUNNING = "running"    # holds a state slot and MLA blocks
    SWAPPED = "swapped"    # preempted: state and blocks copied to host memory
    FINISHED = "finished"


@dataclass
class CacheReport:
    """What the prefix cache did for a request. `matched_tokens`: longest prefix whose MLA latents were
    cached; `restored_tokens`: where it actually resumed (needs a KDA checkpoint there too); `reason` says
    why they differ: miss | full | last_token_recomputed | no_checkpoint | checkpoint_evicted | disabled |
    prompt_logprobs (the request scores its prompt: every position must run, so nothing is restored)."""
    matched_tokens: int = 0
    restored_tokens: int = 0
    reason: str = "miss"

    def as_dict(self) -> dict:
        return {"matched_tokens": self.matched_tokens, "restored_tokens": self.restored_tokens, "reason": self.reason}


@dataclass
class Sequence:
    prompt: list[int]
    params: SamplingParams
    request_id: str = ""
    checkpoint_at: list[int] = field(default_factory=list)  # extra token positions (chat-turn ends)
    policy_version: int | str | None = None  # prefix-cache namespace: entries never cross versions
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose KV / state went through the model
    in_flight: int = 0  # async output: sampled tokens still on the device, not yet in `tokens` (0 or 1 between steps)
    block_table: list[int] = field(default_factory=list)
    slot: int | None = None
    unit_hashes: list[int] = field(default_factory=list)  # chained hash of each complete match unit
    units_registered: int = 0
    gen_checkpoint: int | None = None  # hash of this sequence's newest end-of-generation checkpoint
    # async output: (position, checkpoint slot or None) of a match boundary its in-flight token completed,
    # filed (units registered, checkpoint named) once that token is read back, in the same engine step
    unfiled_boundary: tuple[int, int | None] | None = None
    host_copy: dict | None = None  # swapped-out state
    generator: torch.Generator | None = None
    grammar: object = None  # its GrammarState (k3.serve.grammar) when the request constrains the output
    decoder: object = None  # a StreamDecoder when the engine has a tokenizer
    cache: CacheReport = field(default_factory=CacheReport)
    finish_reason: str | None = None
    output_text: str = ""
    text_sent: int = 0  # characters of output_text already handed out
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # one entry per prompt token scored so far when the request asks for prompt_logprobs (the first is None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    adjuster: object = None  # its LogitAdjuster (k3.serve.sampling) when the request changes logits
    stop_set: frozenset = frozenset()  # params.stop_token_ids, for a cheap test per token
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    # images: (first pad position, projector rows [n, D], content digest), in prompt order
    mm: list[tuple[int, torch.Tensor, str]] = field(default_factory=list)

    # len(prompt), kept: read several times a token per step (progress, stops), the prompt never changes
    prompt_len: int = field(init=False)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)
        if not self.request_id:
            self.request_id = f"req-{self.seq_id}"
        self.prompt_len = len(self.prompt)

    @property
    def cache_root(self) -> tuple:
        """What the prefix hash chain starts from: the policy version, so the chained hash of every unit (and
        every checkpoint) carries it and a request can only hit entries computed under its own version."""
        return ("policy", type(self.policy_version).__name__, self.policy_version)

    def hash_unit(self, start: int, end: int) -> tuple:
        """What the prefix cache hashes for tokens[start:end]: the ids, plus (digest, offset) of every image
        overlapping them, so that the same text with different images never shares cached state."""
        unit = tuple(self.tokens[start:end])
        images = tuple((digest, s - start) for s, rows, digest in self.mm if s < end and s + rows.shape[0] > start)
        return unit + images if images else unit

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


class OutputIds(SequenceABC):
    """A request's output ids as of one step: a window on its token list, which only ever grows by appending.
    Copying the ids into every step's output costs O(n) per token, O(n²) per request (~0.7 ms per step at 64
    streams of 2K tokens, ~11 ms at 32K); reading them (iteration, slicing, `list()`, `==` with a list) costs
    what reading a list does."""
    __slots__ = ("_tokens", "_start", "_end")

    def __init__(self, tokens: list[int], start: int, end: int):
        self._tokens, self._start, self._end = tokens, start, end

    def __len__(self) -> int:
        return self._end - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._tokens[self._start:self._end][i]
        if not -len(self) <= i < len(self):
            raise IndexError(f"output id {i} out of range for {len(self)} ids")
        return self._tokens[self._start + i % len(self)]

    def __iter__(self):
        return iter(self._tokens[self._start:self._end])

    def __eq__(self, other) -> bool:
        return isinstance(other, SequenceABC) and list(self) == list(other)

    def __repr__(self) -> str:
        return repr(list(self))


@dataclass
class RequestOutput:
    """What one engine step produced for one request (new_* are the increments; the rest are totals)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    output_ids: SequenceABC[int]  # an OutputIds window (a list in the error outputs)
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cache: CacheReport
    # with prompt_logprobs: one entry per prompt token (the first None: nothing predicts it), on the request's
    # first output only (when its prefill finishes); None on every other output
    prompt_logprobs: list[TokenLogprob | None] | None = None
