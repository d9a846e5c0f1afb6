"""The engine: requests in, tokens out. `LLMEngine` is the synchronous core (add, step, abort);
`EngineThread` runs it in a background thread for the HTTP server."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from k3.cpu_threads import configure_torch_threads
from k3.model.cache import BatchCacheView
from k3.ops.mx_experts import use_decode_layout_, wants_decode_layout
from k3.serve.block_pool import CachePool, plan_capacity
from k3.serve.metrics import Metrics, StepLog
from k3.serve.runner import ModelRunner, PromptScores
from k3.serve.sampling import (MAX_PROMPT_LOGPROB_ENTRIES, DeviceRead, PendingSample, SamplingParams, finish_sampling,
                               launch_sampling, make_adjuster, make_generator, make_grammar_state, read_back,
                               start_read, token_logprobs)
from k3.serve.scheduler import Scheduler
from k3.serve.sequence import OutputIds, RequestOutput, Sequence, Status


# Contexts (tokens) whose decode graphs `warm_up` captures before serving; a longer context captures its block-table
# width at first use (vLLM's max_seq_len_to_capture, 8192, made the same trade).
WARMUP_LEN = 8192


@dataclass
class EngineConfig:
    memory_bytes: int = 1 << 30      # KV pool + KDA slab budget
    block_size: int = 2048           # allocation unit (tokens per physical block)
    match_unit: int = 512            # prefix-hash granularity (divides block_size)
    max_batch_tokens: int = 8192     # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64           # concurrently running sequences
    num_state_slots: int | None = None  # KDA slots (running + checkpoints); default 2 × max_num_seqs
    max_model_len: int | None = None    # prompt + max_tokens limit; default: what the pool holds
    prefix_caching: bool = True
    num_blocks: int | None = None       # exact block count (overrides the budget's share; tests, benchmarks)
    decode_graphs: bool | None = None   # decode-only steps from CUDA graphs (default: on CUDA; see ModelRunner)
    # with graphs: a step's decodes replay their graph beside its prompt chunks (issue 21: its CUDA test passed on an
    # H200; at 64 streams ~7% more output tok/s and ~17% shorter mixed steps, see benchmarks/RESULTS.md)
    split_mixed_steps: bool = True
    # async output processing: while a step runs on the device, the host finishes the previous one (read-back,
    # stop checks, outputs) and launches the next, whose decodes feed the picked ids from the device (with graphs
    # and split steps, beside new admissions and prompt chunks). On by default: at 64 streams on an H200 it doubled
    # the engine's output tok/s (4,488 -> 9,614, issue 21; before admissions stopped draining it).
    async_output: bool = True
    # steps that feed prompt chunks (their decodes too, unless split off) through piecewise CUDA graphs, one per
    # token bucket, broken at the mixers' cores (k3.serve.prefill_graphs). Default: on CUDA where the model allows
    # graphs, from one process (a distributed engine's pieces would capture collectives: not yet tried). On an
    # H200 at 64 streams a 2,048-token step took 56 ms eager (host-bound) and 22 ms through them (issue 21).
    prefill_graphs: bool | None = None
    # with prefill graphs: their KDA cores over a fixed-shape layout per token bucket (the step's rows, a pad
    # document, empty ones; fla's chunk plan padded alike: k3.serve.runner.StaticKDAView), captured with the pieces,
    # so only MLA's cores break the chain: a 2,048-token step at 64 streams on an H200 took 5.9 ms against 19.1 ms
    # (issue 21, benchmarks/RESULTS.md, twenty-second session). Default: where every KDA core is fla's lean chunked
    # one (16-bit models on CUDA); True asks for it (the runner refuses other models with a warning; on a CPU the
    # layout runs eagerly, for tests), False breaks the pieces at every core.
    static_kda_cores: bool | None = None
    # packed MXFP4 experts in the GPU kernels' decode layout, rearranged once at load (default: on CUDA where the
    # kernels run; True forces it, e.g. on the CPU for tests; checkpoints saved from the model stay released)
    decode_layout: bool | None = None

    def validate(self) -> None:
        for name in ("memory_bytes", "block_size", "match_unit", "max_batch_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.block_size % self.match_unit:
            raise ValueError(f"block_size ({self.block_size}) must be a multiple of match_unit ({self.match_unit})")


@dataclass
class LaunchedStep:
    """A step queued on the device and not yet read: its rows, the sequences that sample (in `sample`'s row
    order), the prompt logprobs it scored, and the sequences that only scored their prompt."""
    seqs: list[Sequence]
    chosen: list[Sequence]
    sample: PendingSample | None
    scores: PromptScores | None
    scores_read: DeviceRead | None  # the prompt logprobs' copy to the host, queued at launch
    scored_only: list[Sequence]


def fit_engine_config(config, engine_config: EngineConfig | None = None) -> EngineConfig:
    """The engine settings for a model of `config`: max_model_len defaults to its max_position_embeddings and
    may not exceed them."""
    engine_config = engine_config or EngineConfig()
    if engine_config.max_model_len is None:
        engine_config.max_model_len = config.max_position_embeddings
    elif engine_config.max_model_len > config.max_position_embeddings:
        raise ValueError(f"--max-model-len {engine_config.max_model_len} exceeds the model's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    return engine_config


def check_policy_version(policy_version) -> None:
    """policy_version: None, an int or a str (raise ValueError otherwise: other types hash ambiguously)."""
    if policy_version is not None and (isinstance(policy_version, bool)
                                       or not isinstance(policy_version, (int, str))):
        raise ValueError(f"policy_version must be an int, a str or None, got {type(policy_version).__name__}")


@dataclass(frozen=True)
class RequestLimits:
    """What a request must fit to be served: the engine checks with it, and so does a server whose engine runs in
    another process (k3.serve.engine_process), before anything is queued."""
    vocab_size: int
    max_model_len: int
    media_pad: int | None  # the <|media_pad|> id of a vision model, None for text only

    def check(self, prompt: list[int], params: SamplingParams, images: list | None = None) -> None:
        """Raise ValueError (naming the field) for a request the engine cannot serve.
        images: preprocessed images (k3.vision.ImageInput) whose pads the prompt carries, in order."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a non-empty list of token ids")
        V = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < V for t in prompt):
            raise ValueError(f"prompt token ids must be integers in [0, {V})")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = next((t for t in ids if t >= V), None)
            if bad is not None:
                raise ValueError(f"{name} holds token id {bad}, outside the vocabulary [0, {V})")
        if params.prompt_logprobs is not None:
            entries = len(prompt) * (params.prompt_logprobs + 1)
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise ValueError(f"prompt_logprobs {params.prompt_logprobs} over {len(prompt)} prompt tokens would "
                                 f"keep {entries} logprobs (tokens × (k+1)); at most {MAX_PROMPT_LOGPROB_ENTRIES} "
                                 f"per sequence: ask for fewer top logprobs or score a shorter prompt")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"maximum sequence length {self.max_model_len}")
        pad = self.media_pad
        if images and pad is None:
            raise ValueError("images were given but this model has no vision tower (text only)")
        if pad is not None:
            want = sum(im.num_tokens for im in images or [])
            if prompt.count(pad) != want:
                raise ValueError(f"prompt holds {prompt.count(pad)} <|media_pad|> tokens but the images need {want}")


class LLMEngine:
    # Set by distributed serving (k3.serve.distributed): how the sampled ids become rank 0's on every rank, and
    # how often an idle EngineThread steps anyway (the heartbeat the other ranks wait on).
    agree_tokens = None
    idle_step_s: float | None = None

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, metrics: Metrics | None = None):
        self.config = config = config or EngineConfig()
        config.validate()
        self.model = model.eval()
        self.tokenizer = tokenizer
        param = next(model.parameters())
        if param.device.type == "cuda":  # the host's work is small index lists: no OpenMP wake-ups (cpu_threads)
            configure_torch_threads(accelerator=True)
        slots = config.num_state_slots or 2 * config.max_num_seqs
        tp = getattr(model, "tensor_parallel_size", 1)  # a TP rank's KDA slots hold its heads only
        self.capacity = plan_capacity(model.config, config.memory_bytes, config.block_size, slots, param.dtype,
                                      config.num_blocks, tp=tp)
        self.pool = CachePool(model.config, self.capacity, config.match_unit, param.dtype, param.device,
                              config.prefix_caching, tp=tp)
        self.scheduler = Scheduler(self.pool, config.max_batch_tokens, config.max_num_seqs)
        self.metrics = metrics or Metrics()
        self.max_model_len = min(config.max_model_len or self.capacity.tokens, self.capacity.tokens)
        self.eos_id = tokenizer.eos_id if tokenizer is not None else None
        # Generation ends at the end of a turn (<|end_of_msg|>, config.json's eos) and at a document end ([EOS]).
        self.stop_ids = (frozenset(getattr(tokenizer, "stop_token_ids", None) or [self.eos_id])
                         if tokenizer is not None else frozenset())
        # A model's vocabulary may be padded past its tokenizer's: never sample an id that has no text.
        vocab = model.config.vocab_size
        self.sample_vocab = min(vocab, tokenizer.vocab_size) if tokenizer is not None else vocab
        if wants_decode_layout(param.device, config.decode_layout):  # a distributed load has done it already
            use_decode_layout_(model)
        self.runner = ModelRunner(model, self.pool, config.decode_graphs, config.max_num_seqs, self.sample_vocab,
                                  config.split_mixed_steps, config.prefill_graphs, config.max_batch_tokens,
                                  config.static_kda_cores)
        self.seqs: dict[str, Sequence] = {}
        self.in_flight: LaunchedStep | None = None  # async output: the step on the device, not yet finished
        self.step_log: StepLog | None = None  # set to trace every step (benchmarks)
        self.profiler = None  # a cProfile.Profile: EngineThread profiles every step under it (benchmarks)

    def describe_capacity(self) -> str:
        return (f"{self.capacity.describe()}; max {self.scheduler.max_num_seqs} concurrent sequences, "
                f"max {self.max_model_len} tokens per sequence")

    def warm_up(self, max_len: int | None = None) -> int:
        """Make now every CUDA graph the engine replays, so that no request waits for a capture: each prefill-graph
        token bucket (one request of exactly that many random tokens, alone on the idle engine: one step of the
        bucket) and each decode graph (row bucket × block-table width) for contexts up to max_len tokens (default
        WARMUP_LEN; longer ones are captured at their first use). On a CPU the same steps run eagerly where graphs
        are forced on (tests). The warm-up's requests stay out of the metrics. Returns how many graphs were made."""
        if self.has_unfinished():
            raise RuntimeError("warm_up runs on an idle engine: requests are in flight")
        max_len = min(max_len or WARMUP_LEN, self.max_model_len)
        metrics, self.metrics = self.metrics, Metrics()
        try:
            made = self._warm_up(max_len)
        finally:
            self.metrics = metrics
        return made

    def _warm_up(self, max_len: int) -> int:
        runner, made = self.runner, 0
        with torch.inference_mode():
            if runner.prefill_graphs is not None:
                before = len(runner.prefill_graphs.entries)
                params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                V = self.model.config.vocab_size
                rng = torch.Generator().manual_seed(7919)  # random prompts: nothing later hits their cache entries
                lo = min(64, V - 1)  # clear of the special tokens
                for tokens in runner.prefill_graphs.buckets:
                    if tokens in runner.prefill_graphs.entries or tokens + 1 > self.max_model_len:
                        continue
                    self.add_request(torch.randint(lo, V, (tokens,), generator=rng).tolist(), params)
                    while self.has_unfinished():
                        self.step()
                made += len(runner.prefill_graphs.entries) - before
            if runner.graphs is not None:
                made += runner.graphs.warm_up(-(-max_len // self.pool.block_size))
        return made

    # ---- requests -------------------------------------------------------------------------------------
    @property
    def limits(self) -> "RequestLimits":
        return RequestLimits(self.model.config.vocab_size, self.max_model_len,
                             getattr(self.model, "media_placeholder_token_id", None))

    @property
    def vision_config(self):
        return getattr(self.model, "vision_config", None)

    def check_request(self, prompt: list[int], params: SamplingParams, images: list | None = None) -> None:
        """Raise ValueError (naming the field) for a request the engine cannot serve (`RequestLimits.check`)."""
        self.limits.check(prompt, params, images)

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                    checkpoint_at: list[int] | None = None, images: list | None = None,
                    policy_version: int | str | None = None) -> str:
        """Queue a request; `checkpoint_at`: extra token positions (e.g. chat-turn ends) worth a KDA checkpoint;
        `images`: preprocessed images for the prompt's <|media_pad|> runs (encoded here, once);
        `policy_version`: the prefix-cache namespace (RL: the weights' version); requests only ever hit cache
        entries computed under the same version, so new weights never reuse state of old ones."""
        self.check_request(prompt, params, images)
        check_policy_version(policy_version)
        seq = Sequence(list(prompt), params, request_id or "", list(checkpoint_at or []), policy_version)
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        if images:
            seq.mm = self._encode_images(prompt, images)
        seq.generator = make_generator(params)
        seq.grammar = make_grammar_state(params)
        seq.adjuster = make_adjuster(params, seq.prompt, self.stop_ids)
        seq.stop_set = frozenset(params.stop_token_ids)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # nothing predicts the first prompt token
        seq.decoder = self.tokenizer.decode_stream(skip_special_tokens=True) if self.tokenizer else None
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def _encode_images(self, prompt: list[int], images: list) -> list:
        """→ [(first pad position, rows [n, D], digest)]: image k takes the next num_tokens pads, in order."""
        pad = self.model.media_placeholder_token_id
        positions = [i for i, t in enumerate(prompt) if t == pad]
        with torch.inference_mode():
            rows = self.model.encode(images)
        out, k = [], 0
        for im in images:
            out.append((positions[k], rows[k:k + im.num_tokens], im.digest))
            k += im.num_tokens
        return out

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its blocks and state slot. False if unknown or already finished."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        if seq.status is Status.RUNNING:
            self.pool.free(seq)
        seq.host_copy = None
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def close(self) -> None:
        """Release the pool (device memory on a GPU) now; the engine is unusable afterwards. Waiting for the
        engine to be collected is not enough: FastAPI caches endpoint functions, which keep their engine.
        Stop the EngineThread that drives it first."""
        self.seqs.clear()
        self.in_flight = None
        self.pool = self.scheduler = self.runner = None

    # ---- one step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; return the outputs of the steps that finished in it. Without config.async_output: plan,
        launch, read back, finish. With it (the default), a step that samples stays on the device (`in_flight`);
        the next call plans and launches its successor, its decodes feeding the picked ids on the device (beside
        prompt chunks and admissions where the runner takes such a step: `ModelRunner.takes_mixed_in_flight`),
        and only then finishes it, so the host's work overlaps the device's. Whatever needs the host's tokens
        first (preemption, a swap-in, grammar, a last token, distributed serving's agreement) drains to the
        synchronous path; a match boundary does not (see `_file_boundaries`)."""
        outputs = []
        if self.in_flight is not None:
            previous, self.in_flight = self.in_flight, None
            plan = self.scheduler.schedule_in_flight(self._may_feed_in_flight, self._ends_in_flight,
                                                     self.runner.takes_mixed_in_flight)
            if plan is not None:
                seqs, lens = plan
                fed = [s for s in seqs if s.in_flight]  # the decodes, in step order
                # none when the previous step's decodes all end on their in-flight tokens beside a running prompt:
                # the plan is prompt chunks only, fed from the host
                launched = self._launch(seqs, lens, self._picked_ids(previous, fed) if fed else None)
                outputs = self._finish_step(previous)
                self._file_boundaries(seqs)
                return outputs + self._defer_or_finish(launched)
            outputs = self._finish_step(previous)
        seqs, lens = self.scheduler.schedule()
        if not seqs:
            return outputs
        return outputs + self._defer_or_finish(self._launch(seqs, lens))

    def _defer_or_finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Keep a launched step on the device for the next call when it may stay (`_may_defer`), else finish it."""
        if self.config.async_output and self._may_defer(launched):
            self.in_flight = launched
            return []
        return self._finish_step(launched)

    def _may_defer(self, launched: LaunchedStep) -> bool:
        """Whether a step may stay in flight: it samples, no row follows a grammar (the next mask needs the host
        token) and no other rank must agree on its ids first."""
        return (launched.sample is not None and self.agree_tokens is None
                and all(s.grammar is None for s in launched.chosen))

    def _may_feed_in_flight(self, seq: Sequence) -> bool:
        """Whether seq's next step may feed its in-flight token before the host knows it: not under a grammar (its
        next mask needs the token). A step that completes a match unit may: its state is copied at launch, the
        unit and checkpoint hashed once the token is read back (`_file_boundaries`)."""
        return seq.grammar is None

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Whether seq's in-flight token is its last (max_tokens, max_model_len): it finishes at the read-back."""
        return (seq.num_output + seq.in_flight >= seq.params.max_tokens
                or len(seq.tokens) + seq.in_flight >= self.max_model_len)

    def _file_boundaries(self, seqs: list[Sequence]) -> None:
        """After the previous step's read-back: register the units and name the checkpoints of the match
        boundaries that the step just launched completed with tokens the host did not know at its launch. A
        sequence that finished in that read-back (stop, its blocks freed) files nothing: its copy's slot is freed."""
        for s in seqs:
            if s.unfiled_boundary is None:
                continue
            (pos, slot), s.unfiled_boundary = s.unfiled_boundary, None
            if s.finished:
                if slot is not None:
                    self.pool.free_slots.append(slot)
                continue
            self.pool.register_computed(s)
            if slot is not None:
                self._keep_gen_checkpoint(s, self.pool.name_checkpoint(s, pos, slot))

    def _picked_ids(self, previous: LaunchedStep, seqs: list[Sequence]) -> torch.Tensor:
        """seqs' in-flight tokens: their rows of the previous step's picked ids, still on the device."""
        row = {id(s): i for i, s in enumerate(previous.chosen)}
        order = [row[id(s)] for s in seqs]
        picked = previous.sample.picked
        if order == list(range(picked.shape[0])):
            return picked
        order_t, = BatchCacheView.upload([order], picked.device)
        return picked.index_select(0, order_t)

    def _launch(self, seqs: list[Sequence], lens: list[int], ids: torch.Tensor | None = None) -> LaunchedStep:
        """Queue one step on the device: the forward, the host bookkeeping that needs no new token (progress,
        prefix units, checkpoints) and the sampling, with no read-back. ids: the input tokens of the step's
        decodes on the device (the previous step's picks: every decoding row then has one in flight)."""
        now = time.perf_counter()
        self.metrics.on_step(seqs, lens, now)
        if self.step_log is not None:
            self.step_log.launch(now, seqs, lens, ids is not None)
        # a row samples when it feeds the last known token (an in-flight one counts as known)
        done = [i for i, (s, n) in enumerate(zip(seqs, lens)) if s.num_computed + n == len(s.tokens) + s.in_flight]
        sampling = [i for i in done if seqs[i].params.max_tokens > 0]
        scored_only = [seqs[i] for i in done if seqs[i].params.max_tokens == 0]  # prompt scored, nothing to sample
        self.pool.flush_checkpoint_copies()  # the new sequences' slots zeroed (all of the step's admissions at once)
        logits, scores = self.runner.run(seqs, lens, sampling, ids)
        logits = logits[:, :self.sample_vocab]
        unit = self.pool.match_unit
        for s, n in zip(seqs, lens):
            decoding = not s.in_prefill
            s.num_computed += n
            if not decoding or s.num_computed % unit == 0:  # a decoded token completes a unit only on a boundary
                if s.in_flight:  # the unit's last token is on the device: hashed after the read-back
                    s.unfiled_boundary = (s.num_computed, self.pool.copy_state_unnamed(s))
                    continue
                self.pool.register_computed(s)
                self._maybe_checkpoint(s, decoding)
        self.pool.flush_checkpoint_copies()  # before a finishing sequence frees its slot
        chosen = [seqs[i] for i in sampling]
        sample = None
        if chosen:
            sample = launch_sampling(logits, [s.params for s in chosen], [s.generator for s in chosen],
                                     [s.grammar for s in chosen], [s.adjuster for s in chosen],
                                     [s.num_output + s.in_flight < s.params.min_tokens for s in chosen],
                                     agree=self.agree_tokens)
            for s in chosen:
                s.in_flight += 1
        scores_read = (start_read(scores.targets, (scores.chosen, scores.top_ids, scores.top_lps))
                       if scores is not None else None)
        return LaunchedStep(seqs, chosen, sample, scores, scores_read, scored_only)

    def _finish_step(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read a launched step back and turn it into outputs. A sequence that finished (stop, abort) after this
        step was launched ran one wasted row in it: its token is dropped."""
        outputs = []
        if launched.sample is not None:
            tokens, logprobs = finish_sampling(launched.sample)
        if launched.scores is not None:
            self._keep_prompt_logprobs(launched.seqs, launched.scores, launched.scores_read)
        now = time.perf_counter()
        if launched.sample is not None:
            for s, tok, lp in zip(launched.chosen, tokens, logprobs):
                s.in_flight -= 1
                if not s.finished:
                    outputs.append(self._append_token(s, tok, lp, now))
        for s in launched.scored_only:
            if s.finished:
                continue
            self._finish(s, "length", now)
            outputs.append(RequestOutput(s.request_id, [], "", [], OutputIds(s.tokens, s.prompt_len, s.prompt_len),
                                         "", True, "length", s.prompt_len, s.cache, s.prompt_logprobs))
        return outputs

    @staticmethod
    def _keep_prompt_logprobs(seqs: list[Sequence], scores: PromptScores, read: DeviceRead) -> None:
        """Append this step's prompt logprobs to each scoring sequence (one read-back for all of them)."""
        targets, (chosen, top_ids, top_lps) = read_back(read)
        a = 0
        for i, _, count in scores.spans:
            k = seqs[i].params.prompt_logprobs
            seqs[i].prompt_logprobs += token_logprobs(targets[a:a + count], chosen[a:a + count],
                                                      top_ids[a:a + count], top_lps[a:a + count], [k] * count)
            a += count

    def _maybe_checkpoint(self, seq: Sequence, decoding: bool) -> None:
        if decoding:  # end of generation: keep the newest boundary reached while decoding
            if seq.num_computed % self.pool.match_unit == 0:
                self._keep_gen_checkpoint(seq, self.pool.save_checkpoint(seq))
        elif seq.num_computed in self.scheduler.checkpoint_boundaries(seq):
            self.pool.save_checkpoint(seq)

    def _keep_gen_checkpoint(self, seq: Sequence, h: int | None) -> None:
        """h: seq's newest boundary reached while decoding; the one it replaces is dropped."""
        if h is not None and seq.gen_checkpoint is not None and seq.gen_checkpoint != h:
            self.pool.drop_checkpoint(seq.gen_checkpoint)
        seq.gen_checkpoint = h

    def _append_token(self, seq: Sequence, tok: int, lp, now: float) -> RequestOutput:
        p = seq.params
        first = seq.first_token_time is None
        self.metrics.on_token(first, now - (seq.arrival if first else seq.last_token_time))
        if first:
            seq.first_token_time = now
        seq.last_token_time = now
        seq.tokens.append(tok)
        if lp is not None:
            seq.logprobs.append(lp)
        num_output = len(seq.tokens) - seq.prompt_len
        may_stop = num_output >= p.min_tokens  # as vLLM: no stop token or string ends it before min_tokens
        stop_tok = may_stop and (tok in seq.stop_set or (tok in self.stop_ids and not p.ignore_eos))
        if seq.decoder is not None and not stop_tok:
            seq.output_text += seq.decoder.step(tok)
        reason = None
        if stop_tok:
            reason = "stop"
        elif p.stop and may_stop and self._cut_at_stop_string(seq):
            reason = "stop"
        elif num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason, now)
        # Hold back text that could still become the start of a stop string.
        hold = 0 if reason or not p.stop else max(len(s) for s in p.stop) - 1
        upto = max(seq.text_sent, len(seq.output_text) - hold)
        new_text = seq.output_text[seq.text_sent:upto]
        seq.text_sent = upto
        prompt_logprobs = seq.prompt_logprobs if first else None
        seq.prompt_logprobs = None  # handed out with the first output, which holds them from now on
        return RequestOutput(seq.request_id, [tok], new_text, [lp] if lp is not None else [],
                             OutputIds(seq.tokens, seq.prompt_len, len(seq.tokens)), seq.output_text, seq.finished,
                             seq.finish_reason, seq.prompt_len, seq.cache, prompt_logprobs)

    def _cut_at_stop_string(self, seq: Sequence) -> bool:
        text = seq.output_text
        longest = max(len(s) for s in seq.params.stop)
        start = max(0, seq.text_sent - longest)
        hits = [i for i in (text.find(s, start) for s in seq.params.stop) if i >= 0]
        if hits:
            seq.output_text = text[:min(hits)]
            return True
        return False

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.scheduler.remove(seq)
        self.pool.free(seq)
        self.seqs.pop(seq.request_id, None)
        self.metrics.on_finish(seq, reason, now)

    # ---- convenience ----------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 checkpoint_at: list[list[int]] | None = None, images: list[list] | None = None,
                 policy_version: int | str | None = None) -> list[RequestOutput]:
        """Run the given prompts to completion (offline use and tests); final outputs in prompt order.
        images: per prompt, its preprocessed images (vision models); policy_version: for every prompt."""
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp, checkpoint_at=(checkpoint_at[i] if checkpoint_at else None),
                                images=(images[i] if images else None), policy_version=policy_version)
               for i, (p, sp) in enumerate(zip(prompts, params))]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


class EngineThread:
    """Owns an LLMEngine in a background thread; other threads submit and abort through a mailbox.
    after_outputs: called on the engine thread once each iteration's outputs have gone to their listeners (and once
    after a crash's error outputs): where a listener that batches them sends its batch."""

    def __init__(self, engine: LLMEngine, after_outputs: Callable[[], None] | None = None):
        self.engine, self.after_outputs = engine, after_outputs
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._listeners: dict[str, Callable[[RequestOutput], None]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def submit(self, prompt: list[int], params: SamplingParams, request_id: str,
               on_output: Callable[[RequestOutput], None], checkpoint_at: list[int] | None = None,
               images: list | None = None, policy_version: int | str | None = None) -> None:
        self.engine.check_request(prompt, params, images)  # raise in the caller's thread, before queueing
        check_policy_version(policy_version)
        with self._cv:
            self._inbox.append(("add", prompt, params, request_id, on_output, checkpoint_at, images, policy_version))
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cv:
                    while not self._stop and not self._inbox and not eng.has_unfinished():
                        if not self._cv.wait(eng.idle_step_s):
                            break  # an idle step (distributed serving's heartbeat)
                    if self._stop:
                        return
                    inbox, self._inbox = self._inbox, []
                t_in = time.perf_counter()
                for item in inbox:
                    if item[0] == "add":
                        _, prompt, params, rid, cb, ckpt, images, version = item
                        self._listeners[rid] = cb
                        try:
                            eng.add_request(prompt, params, rid, ckpt, images, version)
                        except ValueError as e:  # e.g. a duplicate id: tell that request only
                            self._listeners.pop(rid)(RequestOutput(rid, [], "", [], [], "", True, f"error: {e}",
                                                                   len(prompt), None))
                    else:
                        eng.abort(item[1])
                        self._listeners.pop(item[1], None)
                t0, prof = time.perf_counter(), eng.profiler
                if prof is not None:
                    prof.enable()
                try:
                    with torch.inference_mode():
                        outputs = eng.step()
                finally:
                    if prof is not None:
                        prof.disable()
                t1 = time.perf_counter()
                for out in outputs:
                    cb = self._listeners.get(out.request_id)
                    if out.finished:
                        self._listeners.pop(out.request_id, None)
                    if cb is not None:
                        cb(out)
                if self.after_outputs is not None:
                    self.after_outputs()
                if (log := eng.step_log) is not None:
                    log.iteration(t0, t1, time.perf_counter(), intake=t0 - t_in)
        except BaseException as e:  # surface engine crashes to waiting requests instead of hanging them
            self.error = e
            for rid, cb in list(self._listeners.items()):
                cb(RequestOutput(rid, [], "", [], [], "", True, f"error: {e}", 0, None))
            if self.after_outputs is not None:
                self.after_outputs()
            raise
