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

    def schedule_in_flight(self, may_feed_in_flight: Callable[[Sequence], bool]) -> list[Sequence] | None:
        """Plan a decode step while the previous one is still on the device (async output): every running
        sequence feeds its in-flight token, which only the device knows yet. None when the step needs the host
        to go first: a request waits (admission), a running sequence has no token in flight (prefill) or
        `may_feed_in_flight` refuses it (e.g. its in-flight token may be its last), the token budget is short,
        or a block is missing (preemption). Those steps run after the previous one finishes, via `schedule`."""
        if self.waiting or not self.running or len(self.running) > self.max_batch_tokens:
            return None
        if not all(s.in_flight and may_feed_in_flight(s) for s in self.running):
            return None
        if not all(self.pool.ensure_blocks(s, s.num_computed + 1) for s in self.running):
            return None
        return list(self.running)

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
        return [s for s, _ in plan], [n for _, n in plan]
