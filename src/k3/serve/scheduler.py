"""Continuous batching: which sequences run this step and how many tokens each (a per-step token budget,
chunked prefill next to decodes, FCFS admission, preemption by swapping to host memory)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable

from k3.serve.block_pool import CachePool
from k3.serve.sequence import Sequence, Status


class Scheduler:
    def __init__(self, pool: CachePool, max_batch_tokens: int, max_num_seqs: int):
        if max_batch_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"max_batch_tokens and max_num_seqs must be >= 1, got {max_batch_tokens}, {max_num_seqs}")
        self.pool = pool
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = min(max_num_seqs, pool.capacity.num_slots)
        self.waiting: deque[Sequence] = deque()  # swapped-out sequences go back to the front
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def chunk_len(self, seq: Sequence, budget: int) -> int:
        """Tokens to feed next: one when decoding; when prefilling, up to the budget but never past the next
        checkpoint boundary, so the KDA state can be saved exactly there."""
        if not seq.in_prefill:
            return 1
        end = min(seq.prompt_len, seq.num_computed + budget)
        for b in self.checkpoint_boundaries(seq):
            if seq.num_computed < b < end:
                end = b
                break
        return end - seq.num_computed

    def checkpoint_boundaries(self, seq: Sequence) -> list[int]:
        """Match boundaries at which to checkpoint the prompt: the end of the prompt and every chat-turn end,
        each rounded down to a match unit."""
        u = self.pool.match_unit
        # A prompt ending exactly on a boundary also gets the one before, so the same prompt sent again
        # (which must recompute its last token) still hits.
        ends = [*seq.checkpoint_at, seq.prompt_len, seq.prompt_len - 1]
        return sorted({(p // u) * u for p in ends if 0 < p <= seq.prompt_len} - {0})

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.swap_out(seq)
        seq.status = Status.SWAPPED
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule_in_flight(self, may_feed_in_flight: Callable[[Sequence], bool],
                           ends_in_flight: Callable[[Sequence], bool],
                           admit: bool) -> tuple[list[Sequence], list[int]] | None:
        """Plan a step while the previous one is still on the device (async output): every decoding sequence
        feeds its in-flight token, which only the device knows yet, but one whose in-flight token ends it
        (`ends_in_flight`: max_tokens, max_model_len) sits the step out and finishes at the read-back. With
        `admit` (the runner takes prompt chunks beside such decodes), running prompts take their next chunks and
        waiting requests are admitted as in `schedule`, the decodes served first; without it only decode steps
        are planned.
        None when the step needs the host to go first: a decoding sequence has no token in flight or
        `may_feed_in_flight` refuses it (e.g. a grammar's next mask needs the token), the budget is short of the
        decodes, a block is missing (preemption), a swapped-out sequence is next to come back, (without `admit`)
        a prompt would run, or nothing would. Those steps run after the previous one finishes, via `schedule`."""
        running = [s for s in self.running if not (s.in_flight and ends_in_flight(s))]
        decoding = [s for s in running if not s.in_prefill]
        if not running or len(decoding) > self.max_batch_tokens:
            return None
        if not all(s.in_flight and may_feed_in_flight(s) for s in decoding):
            return None
        if not admit and (len(decoding) < len(running) or self.waiting):
            return None
        if self.waiting and self.waiting[0].status is Status.SWAPPED:  # swapped ones wait at the front
            return None
        budget = self.max_batch_tokens - len(decoding)
        plan: list[tuple[Sequence, int]] = []
        for seq in running:
            n = self.chunk_len(seq, budget) if seq.in_prefill else 1  # (decodes are in the budget already)
            if n <= 0:
                continue
            if not self.pool.ensure_blocks(seq, seq.num_computed + n):
                return None
            plan.append((seq, n))
            if seq.in_prefill:
                budget -= n
        self._admit(plan, budget)
        return [s for s, _ in plan], [n for _, n in plan]

    def schedule(self) -> tuple[list[Sequence], list[int]]:
        """Plan one step → (sequences, tokens to feed for each)."""
        budget = self.max_batch_tokens
        plan: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self.chunk_len(seq, budget)
            while not self.pool.ensure_blocks(seq, seq.num_computed + n):
                victim = self.running[-1]  # the newest running sequence gives way
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                plan.append((seq, n))
                budget -= n
                i += 1
        self._admit(plan, budget)
        return [s for s, _ in plan], [n for _, n in plan]

    def _admit(self, plan: list[tuple[Sequence, int]], budget: int) -> None:
        """Waiting sequences into `plan` (FCFS: swapped-out ones first) while the budget, the sequence limit and
        the pool allow."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.status is Status.SWAPPED:
                n = self.chunk_len(seq, budget)
                if not self.pool.swap_in(seq, n):
                    break
            else:
                # The first chunk is sized before the cache hit is known; the hit only shortens the work.
                if not self.pool.admit(seq, 0):
                    break
                n = self.chunk_len(seq, budget)
                if not self.pool.ensure_blocks(seq, seq.num_computed + n):
                    self.pool.free(seq)
                    break
                self.pool.record_query(seq)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
