"""Serving memory (SPEC §5): a paged pool of MLA latent blocks, a slab of KDA state slots, and the prefix cache
on top of them: chained hashes every `match_unit` tokens, KDA checkpoints at chosen boundaries, LRU eviction.

Three granularities, deliberately separate:
  allocation   one physical block = `block_size` tokens of latent KV for every MLA layer;
  matching     a hash per `match_unit` tokens (block_size is a multiple of it), chained over the prefix;
  checkpoints  a copy of all KDA state (recurrent + conv tails) at a match boundary, in a slab slot.
A hit is the longest boundary where every unit's latents are cached and a checkpoint exists. Fully covered
blocks are shared by reference; a partly covered block is copied (copy-on-write) into a fresh one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from k3.config import K3Config
from k3.model.cache import kda_local_heads
from k3.serve.sequence import CacheReport, Sequence

_ROOT_HASH = 0x6B33  # the hash of the empty prefix


def chain_hash(prev: int, unit: list[int] | tuple[int, ...]) -> int:
    """Hash of a prefix = hash(hash of the prefix before this unit, this unit's tokens)."""
    return hash((prev, tuple(unit)))


def root_hash(seq: Sequence) -> int:
    """Hash of seq's empty prefix: it carries seq's policy version (the cache namespace), so every chained
    hash below it does too and no entry of another version can be matched."""
    return hash((_ROOT_HASH, seq.cache_root))


@dataclass
class Capacity:
    num_blocks: int
    block_size: int
    num_slots: int
    bytes_per_token: int
    bytes_per_slot: int

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} tokens of MLA latents "
                f"({self.bytes_per_token} B/token); {self.num_slots} KDA state slots "
                f"({self.bytes_per_slot / 2**20:.2f} MiB each) shared by running sequences and checkpoints")


def plan_capacity(config: K3Config, memory_bytes: int, block_size: int, num_slots: int,
                  dtype: torch.dtype, num_blocks: int | None = None, tp: int = 1) -> Capacity:
    """Split a memory budget: `num_slots` KDA state slots first, the rest in MLA latent blocks
    (or exactly `num_blocks` blocks when given, ignoring the budget). tp: one rank of a tensor-parallel group,
    whose slots hold its H/tp KDA heads; the MLA latents are per token, whole on every rank."""
    la = config.linear_attn_config
    n_mla = sum(config.is_mla(l) for l in range(config.num_hidden_layers))
    n_kda = config.num_hidden_layers - n_mla
    H = kda_local_heads(config, tp)
    C = H * la.head_dim
    per_token = n_mla * (config.kv_lora_rank + config.qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()
    per_slot = n_kda * 4 * (H * la.head_dim * la.head_dim + 3 * (la.short_conv_kernel_size - 1) * C)
    left = memory_bytes - num_slots * per_slot
    if num_blocks is None:
        num_blocks = left // (per_token * block_size) if per_token else 0
    if num_blocks < 1:
        raise ValueError(f"memory budget {memory_bytes} B is too small: {num_slots} state slots take "
                         f"{num_slots * per_slot} B and one block of {block_size} tokens {per_token * block_size} B")
    return Capacity(int(num_blocks), block_size, num_slots, per_token, per_slot)


class CachePool:
    """Physical storage plus the prefix-cache index. Single-threaded: only the engine loop calls it."""

    def __init__(self, config: K3Config, capacity: Capacity, match_unit: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", prefix_caching: bool = True, tp: int = 1):
        if capacity.block_size % match_unit:
            raise ValueError(f"block_size ({capacity.block_size}) must be a multiple of match_unit ({match_unit})")
        la = config.linear_attn_config
        self.block_size, self.match_unit, self.prefix_caching = capacity.block_size, match_unit, prefix_caching
        self.capacity = capacity
        self.device = torch.device(device)
        self.mla_layers = [l for l in range(config.num_hidden_layers) if config.is_mla(l)]
        self.kda_layers = [l for l in range(config.num_hidden_layers) if not config.is_mla(l)]
        self.latent_dim = config.kv_lora_rank
        D = config.kv_lora_rank + config.qk_rope_head_dim
        # under tensor parallelism a rank's KDA state holds its own heads only (tp: see plan_capacity)
        H, K, W = kda_local_heads(config, tp), la.head_dim, la.short_conv_kernel_size
        nb, ns = capacity.num_blocks, capacity.num_slots
        # One block and one slot past the allocatable ones: scratch that a fixed-shape decode step's padding rows
        # read and write (k3.serve.runner.DecodeGraphs), never handed to a sequence.
        self.scratch_block, self.scratch_slot = nb, ns
        self.kv = {l: torch.zeros(nb + 1, self.block_size, D, dtype=dtype, device=self.device)
                   for l in self.mla_layers}
        # Every KDA layer's states in one tensor [layers, slots, ...] (`state[l]`, `conv[l]` are its layers' views):
        # a slot's copy, zeroing or swap is one op for all layers, not one per layer. A slot's conv tails are the
        # q, k and v tails side by side [W−1, 3·C], as the serving short convs run them (one conv over 3·C channels):
        # they gather and write back as one tensor.
        self.all_state = torch.zeros(len(self.kda_layers), ns + 1, H, K, K, dtype=torch.float32, device=self.device)
        self.all_conv = torch.zeros(len(self.kda_layers), ns + 1, W - 1, 3 * H * K, dtype=torch.float32,
                                    device=self.device)
        self.state = {l: self.all_state[i] for i, l in enumerate(self.kda_layers)}
        self.conv = {l: self.all_conv[i] for i, l in enumerate(self.kda_layers)}
        # blocks
        self.ref = [0] * nb
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(nb))  # LRU: oldest first
        self.unit_index: dict[int, tuple[int, int]] = {}  # unit hash -> (block, unit offset in block)
        self.block_units: list[list[int]] = [[] for _ in range(nb)]
        # state slots and checkpoints
        self.free_slots = list(range(ns - 1, -1, -1))
        self.checkpoints: OrderedDict[int, int] = OrderedDict()  # boundary hash -> slot, LRU oldest first
        # checkpoint slot -> the sequence slot it copies, until flush_checkpoint_copies (one copy for a whole
        # step's checkpoints, not one per sequence and layer); slots to zero (new sequences'), likewise
        self.pending_copies: dict[int, int] = {}
        self.pending_zeros: list[int] = []
        self.evicted_checkpoints: OrderedDict[int, None] = OrderedDict()  # remembered to explain misses
        self.stats = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "hits": 0, "evicted_blocks": 0,
                      "evicted_checkpoints": 0, "swaps_out": 0, "swaps_in": 0}

    # ---- accounting -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.capacity.num_blocks - len(self.free_blocks)

    @property
    def num_used_slots(self) -> int:
        """Slots held by sequences (checkpoints are evictable, so they do not count as used)."""
        return self.capacity.num_slots - len(self.free_slots) - len(self.checkpoints)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- blocks ---------------------------------------------------------------------------------------
    def _alloc_block(self) -> int:
        b, _ = self.free_blocks.popitem(last=False)
        if self.block_units[b]:  # reusing a cached block: its units leave the index
            self.stats["evicted_blocks"] += 1
            for h in self.block_units[b]:
                if self.unit_index.get(h, (None,))[0] == b:
                    del self.unit_index[h]
            self.block_units[b] = []
        self.ref[b] = 1
        return b

    def _retain_block(self, b: int) -> None:
        if self.ref[b] == 0:
            del self.free_blocks[b]
        self.ref[b] += 1

    def _release_block(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free_blocks[b] = None  # most recently used end

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for its first `num_tokens` tokens; False (nothing changed) if the pool is short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > len(self.free_blocks):
            return False
        for _ in range(max(need, 0)):
            seq.block_table.append(self._alloc_block())
        return True

    # ---- slots ----------------------------------------------------------------------------------------
    def _alloc_slot(self) -> int | None:
        """A free slot, else the least recently used checkpoint's (evicted), else None."""
        if self.free_slots:
            return self.free_slots.pop()
        if self.checkpoints:
            h, slot = self.checkpoints.popitem(last=False)
            self._forget_evicted(h)
            return slot
        return None

    def _forget_evicted(self, h: int) -> None:
        self.stats["evicted_checkpoints"] += 1
        self.evicted_checkpoints[h] = None
        while len(self.evicted_checkpoints) > 4096:
            self.evicted_checkpoints.popitem(last=False)

    def can_take_slot(self) -> bool:
        return bool(self.free_slots) or bool(self.checkpoints)

    def _zero_slot(self, slot: int) -> None:
        """Queue the zeroing of a new sequence's slot: a step's admissions are zeroed together, at the next
        flush (before the step's forward reads them)."""
        if self.pending_copies:  # (the order kept: a copy queued earlier lands before the zeros)
            self.flush_checkpoint_copies()
        self.pending_zeros.append(slot)

    def _copy_slot(self, src: int, dst: int) -> None:
        self.flush_checkpoint_copies()
        for t in (self.all_state, self.all_conv):
            t[:, dst].copy_(t[:, src])

    # ---- prefix cache ---------------------------------------------------------------------------------
    def update_unit_hashes(self, seq: Sequence) -> None:
        """Extend seq.unit_hashes over every complete unit of its known tokens."""
        u = self.match_unit
        while (len(seq.unit_hashes) + 1) * u <= len(seq.tokens):
            i = len(seq.unit_hashes)
            prev = seq.unit_hashes[-1] if seq.unit_hashes else root_hash(seq)
            seq.unit_hashes.append(chain_hash(prev, seq.hash_unit(i * u, (i + 1) * u)))

    def boundary_hash(self, seq: Sequence, pos: int) -> int:
        return root_hash(seq) if pos == 0 else seq.unit_hashes[pos // self.match_unit - 1]

    def match(self, seq: Sequence) -> tuple[CacheReport, list[tuple[int, int]]]:
        """Longest usable prefix of seq's prompt → (report, [(block, unit offset)] for the restored units)."""
        if not self.prefix_caching:
            return CacheReport(reason="disabled"), []
        if seq.params.prompt_logprobs is not None:  # a restored position would have no logits to score
            return CacheReport(reason="prompt_logprobs"), []
        self.update_unit_hashes(seq)
        u = self.match_unit
        locs = []
        for h in seq.unit_hashes[:seq.prompt_len // u]:
            if h not in self.unit_index:
                break
            locs.append(self.unit_index[h])
        matched = len(locs) * u
        restored = 0
        for j in range(len(locs), 0, -1):  # longest boundary with a checkpoint that leaves ≥ 1 token to run
            if j * u <= seq.prompt_len - 1 and seq.unit_hashes[j - 1] in self.checkpoints:
                restored = j * u
                break
        if matched == 0:
            reason = "miss"
        elif restored == matched:
            reason = "full"
        elif matched >= seq.prompt_len:
            reason = "last_token_recomputed"
        elif seq.unit_hashes[len(locs) - 1] in self.evicted_checkpoints:
            reason = "checkpoint_evicted"
        else:
            reason = "no_checkpoint"
        return CacheReport(matched, restored, reason), locs[:restored // u]

    def admit(self, seq: Sequence, first_chunk: int) -> bool:
        """Give a new sequence a state slot and its blocks, restoring the best cached prefix.
        Needs room for `first_chunk` tokens after the restored prefix; False (nothing changed) otherwise."""
        report, locs = self.match(seq)
        restored = report.restored_tokens
        units_per_block = self.block_size // self.match_unit
        # Which blocks can be shared whole: all their units found, in order, in one physical block.
        shared = []
        for j in range(restored // self.block_size):
            group = locs[j * units_per_block:(j + 1) * units_per_block]
            b = group[0][0]
            shared.append(b if all(g == (b, i) for i, g in enumerate(group)) else None)
        sources = {b for b, _ in locs}
        pinned_free = sum(1 for b in sources if self.ref[b] == 0)
        new_blocks = self.blocks_for(restored + first_chunk) - sum(1 for b in shared if b is not None)
        if new_blocks > len(self.free_blocks) - pinned_free or not self.can_take_slot():
            return False
        for b in sources:  # pin, so allocating the copies cannot evict what they copy from
            self._retain_block(b)
        src = None
        if restored:
            h = seq.unit_hashes[restored // self.match_unit - 1]
            self.checkpoints.move_to_end(h)
            src = self.checkpoints[h]
        # If the slab is full and this checkpoint is the only one, the slot taken is the checkpoint's own
        # (still holding its state): the sequence consumes it.
        slot = self._alloc_slot()
        seq.slot = slot
        table = []
        for j in range(self.blocks_for(restored)):
            if j < len(shared) and shared[j] is not None:
                self._retain_block(shared[j])
                table.append(shared[j])
                continue
            dst = self._alloc_block()  # copy-on-write of a partly shared (or scattered) block
            for i, (b, off) in enumerate(locs[j * units_per_block:(j + 1) * units_per_block]):
                rows = slice(off * self.match_unit, (off + 1) * self.match_unit)
                dst_rows = slice(i * self.match_unit, (i + 1) * self.match_unit)
                for l in self.mla_layers:
                    self.kv[l][dst, dst_rows] = self.kv[l][b, rows]
            table.append(dst)
        for b in sources:
            self._release_block(b)
        seq.block_table = table
        if src is None:
            self._zero_slot(slot)
        elif src != slot:
            self._copy_slot(src, slot)
        seq.num_computed = restored
        seq.units_registered = restored // self.match_unit
        seq.cache = report
        ok = self.ensure_blocks(seq, restored + first_chunk)
        assert ok, "admission accounting"
        return True

    def record_query(self, seq: Sequence) -> None:
        """Count one admitted request in the prefix-cache statistics."""
        self.stats["queries"] += 1
        self.stats["query_tokens"] += seq.prompt_len
        self.stats["hit_tokens"] += seq.cache.restored_tokens
        self.stats["hits"] += seq.cache.restored_tokens > 0

    def register_computed(self, seq: Sequence) -> None:
        """Index every newly completed unit of seq (its latents now sit in seq's blocks)."""
        if not self.prefix_caching:
            return
        self.update_unit_hashes(seq)
        u, done = self.match_unit, seq.num_computed // self.match_unit
        while seq.units_registered < done:
            i = seq.units_registered
            h = seq.unit_hashes[i]
            if h not in self.unit_index:
                b = seq.block_table[i * u // self.block_size]
                self.unit_index[h] = (b, (i * u % self.block_size) // u)
                self.block_units[b].append(h)
            seq.units_registered += 1

    def save_checkpoint(self, seq: Sequence) -> int | None:
        """Copy seq's KDA state (at num_computed, a match boundary) into a checkpoint; returns its hash."""
        if not self.prefix_caching or seq.num_computed == 0 or seq.num_computed % self.match_unit:
            return None
        self.update_unit_hashes(seq)
        h = self.boundary_hash(seq, seq.num_computed)
        if h in self.checkpoints:
            self.checkpoints.move_to_end(h)
            return h
        slot = self._alloc_slot()
        if slot is None:
            return None
        self.pending_copies[slot] = seq.slot
        self.checkpoints[h] = slot
        self.evicted_checkpoints.pop(h, None)
        return h

    def copy_state_unnamed(self, seq: Sequence) -> int | None:
        """Queue a copy of seq's KDA state (at num_computed, a match boundary) into a fresh slot, before its hash
        can be known (async output: the unit's last token is still on the device); `name_checkpoint` files it
        once that token is read back. The copy must be queued now: the next step writes seq's slot again."""
        if not self.prefix_caching or seq.num_computed == 0 or seq.num_computed % self.match_unit:
            return None
        slot = self._alloc_slot()
        if slot is not None:
            self.pending_copies[slot] = seq.slot
        return slot

    def name_checkpoint(self, seq: Sequence, pos: int, slot: int) -> int:
        """File the state copied into `slot` by `copy_state_unnamed` under the hash of seq's tokens up to pos,
        now known; where a checkpoint of that hash exists already, the copy's slot is freed. Returns the hash."""
        self.update_unit_hashes(seq)
        h = self.boundary_hash(seq, pos)
        if h in self.checkpoints:
            self.checkpoints.move_to_end(h)
            self.free_slots.append(slot)
            return h
        self.checkpoints[h] = slot
        self.evicted_checkpoints.pop(h, None)
        return h

    def flush_checkpoint_copies(self) -> None:
        """Zero the new sequences' slots, then copy the states of the checkpoints saved since the last flush, all
        at once (every KDA layer in one op per tensor). The engine flushes before a step's forward (which reads
        the new slots) and after its checkpoints, before anything writes a sequence's slot again; every other
        slot copy and swap flushes first too. Copy sources are running sequences' slots and targets fresh
        checkpoint slots, so no copy reads another's target."""
        zeros, copies = self.pending_zeros, self.pending_copies
        if not zeros and not copies:
            return
        self.pending_zeros, self.pending_copies = [], {}
        # Slot by slot, through views: a slot is a few contiguous MiB per layer, which zero_ and copy_ move at the
        # card's bandwidth, and no index goes to the device (at 64 streams some sequence reaches a match boundary in
        # most decode steps). One advanced-indexing copy of 16 slots took 1.4 ms on an H200 (a gather and an
        # index_put, per element), ~10x the bytes' time.
        for t in (self.all_state, self.all_conv):
            for slot in zeros:
                t[:, slot].zero_()
            for dst, src in copies.items():
                t[:, dst].copy_(t[:, src])

    def drop_checkpoint(self, h: int) -> None:
        slot = self.checkpoints.pop(h, None)
        if slot is not None:
            self.free_slots.append(slot)

    # ---- release and swap -----------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Return seq's slot and blocks (blocks keep their contents for later hits until reused)."""
        for b in reversed(seq.block_table):  # the tail is the least reusable, so it is evicted first
            self._release_block(b)
        seq.block_table = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    def swap_out(self, seq: Sequence) -> None:
        """Copy seq's state and latents to host memory and free its device memory (preemption)."""
        self.flush_checkpoint_copies()
        pin = self.device.type == "cuda"
        host = {"kv": {}}
        idx = torch.tensor(seq.block_table, dtype=torch.long, device=self.device)
        host["state"], host["conv"] = (t[:, seq.slot].to("cpu", copy=True) for t in (self.all_state, self.all_conv))
        for l in self.mla_layers:
            t = self.kv[l][idx].to("cpu", copy=True)
            host["kv"][l] = t.pin_memory() if pin else t
        seq.host_copy = host
        self.free(seq)
        self.stats["swaps_out"] += 1

    def swap_in(self, seq: Sequence, extra_tokens: int) -> bool:
        """Bring a swapped sequence back with room for `extra_tokens` more; False (nothing changed) if short."""
        need = self.blocks_for(seq.num_computed + extra_tokens)
        if need > len(self.free_blocks) or not self.can_take_slot():
            return False
        self.flush_checkpoint_copies()
        seq.slot = self._alloc_slot()
        n_old = len(seq.host_copy["kv"][self.mla_layers[0]]) if self.mla_layers else 0
        seq.block_table = [self._alloc_block() for _ in range(need)]
        idx = torch.tensor(seq.block_table[:n_old], dtype=torch.long, device=self.device)
        self.all_state[:, seq.slot].copy_(seq.host_copy["state"])
        self.all_conv[:, seq.slot].copy_(seq.host_copy["conv"])
        for l in self.mla_layers:
            self.kv[l][idx] = seq.host_copy["kv"][l].to(self.device)
        seq.host_copy = None
        self.stats["swaps_in"] += 1
        return True
