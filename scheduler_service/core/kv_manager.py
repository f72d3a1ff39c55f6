"""Page tables over the block allocator: every change to what a sequence's table holds. The
scheduler decides; this carries decisions out on memory and says whether they fit (None: preempt and
ask again).
"""

from __future__ import annotations

from typing import NamedTuple

from scheduler_service.core.block_allocator import BlockAllocator
from scheduler_service.core.kv_tiers import KvTiers
from scheduler_service.core.sequence import Request, Sequence
from scheduler_service.core.state_slots import StateSlots
from scheduler_service.core.tier_loads import plan_loads, settle_loads


class BlockCopy(NamedTuple):
    """Copy-on-write: table entry `index` now holds `dst`, filled from `src` before the forward."""

    index: int
    src: int
    dst: int


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        kv_window: int = 0,
        state_slots: int = 0,
        max_trails: int = 1,
    ) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        # a hybrid's recurrent-state slots: one with each table (None: the model keeps no state)
        self.states = StateSlots(state_slots, max_trails) if state_slots else None
        self.block_size = block_size
        self.caching = enable_prefix_caching
        # every layer slides over kv_window keys or more (0: not all): drop_out_of_window
        self.kv_window = kv_window
        self.tiers: KvTiers | None = None  # host and disk tiers under the pool (use_tiers)

    def use_tiers(self, tiers: KvTiers) -> None:
        """Evicted blocks go down to these tiers and prompts find prefixes there."""
        if self.caching:
            self.tiers = tiers
            self.allocator.tiers = tiers
            if self.states is not None:
                self.states.tiers = tiers.states

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return self.allocator.blocks_for_tokens(num_tokens)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The longest cached run of seq's full blocks, leaving its last token to compute."""
        if not self.reads_cache(seq):
            return []
        hits = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block = self.allocator.lookup(seq.block_hash(i, self.block_size))
            if block is None:
                break
            hits.append(block)
        if self.states is not None:  # a hybrid resumes where a snapshot of its state was taken
            return hits[: self.states.deepest(seq, len(hits), self.block_size)]
        return hits

    def reads_cache(self, seq: Sequence) -> bool:
        """seq, waiting with nothing computed, may start from cached blocks."""
        if not self.caching or seq.num_computed_tokens or seq.block_ids:
            return False
        request = seq.request
        # every prompt position's logits are needed
        if request.sampling.prompt_logprobs is not None:
            return False
        return request.embed is None or request.embed.spec.prefix_cacheable  # a mean reads them all

    def load_from_tiers(self, seq: Sequence, hits: list[int], step_id: int) -> bool:
        """Plans tier loads past the cached prefix where reading beats computing; True if seq must
        wait.
        """
        if self.tiers is None or self.kv_window or not self.reads_cache(seq):
            return False
        return plan_loads(self.allocator, self.tiers, self.states, seq, hits, step_id)

    def settle_loads(self, step_id: int, failed: set[int] | None) -> None:
        """A step's loads are done (failed: those that did not; None: none did)."""
        if self.tiers is not None and step_id in self.tiers.inflight:
            settle_loads(self.allocator, self.tiers, self.states, step_id, failed)

    def step_failed(self, step_id: int, state_saves: list[tuple[int, int, int]]) -> None:
        """A step gave no result: drop its loads and snapshots."""
        self.settle_loads(step_id, None)
        if self.states is not None and state_saves:
            self.states.failed(state_saves)

    def admit(self, seq: Sequence, hits: list[int], num_new: int) -> bool:
        """Cached prefix plus fresh blocks for num_new tokens; False (nothing changed) if they do
        not fit.
        """
        num_cached = len(hits) * self.block_size
        need = self.blocks_for_tokens(num_cached + num_new) - len(hits)
        # a cached prefix longer than every window: its blocks before the window stay cached
        skip = self.out_of_window(seq, num_cached) if hits else 0
        # hits that leave the LRU
        revived = sum(1 for b in hits[skip:] if self.allocator.is_cached_free(b))
        if not self.allocator.can_allocate(need + revived):
            return False
        resume = seq.block_hash(len(hits) - 1, self.block_size) if hits else None
        if self.states is not None and not self.states.admit(seq, resume):
            return False
        self.allocator.share(hits[skip:])
        seq.block_ids = [-1] * skip + hits[skip:] + self.allocator.allocate(need)
        seq.mirror.stale()
        seq.num_dropped_blocks = skip
        seq.dropped_ids = hits[:skip]
        seq.num_computed_tokens = num_cached
        seq.num_registered_blocks = len(hits)
        return True

    def fork(self, leader: Sequence, forks: list[Sequence]) -> None:
        """Samples 1..n-1 share the leader's prompt blocks and recompute
        only the last prompt token.
        """
        prompt_len = leader.request.prompt_len
        prompt_blocks = leader.block_ids[: self.blocks_for_tokens(prompt_len)]
        for seq in forks:
            self.allocator.share([b for b in prompt_blocks if b >= 0])
            seq.block_ids = list(prompt_blocks)
            seq.mirror.stale()
            seq.num_dropped_blocks = min(leader.num_dropped_blocks, len(prompt_blocks))
            seq.dropped_ids = leader.dropped_ids[: seq.num_dropped_blocks]
            seq.num_computed_tokens = prompt_len - 1
            seq.num_registered_blocks = (prompt_len - 1) // self.block_size

    def writes_in_place(self, seq: Sequence, pos: int) -> bool:
        """The token lands in seq's own last block: a decode's fast path."""
        if not pos % self.block_size:
            return False
        block = seq.block_ids[pos // self.block_size]
        return self.allocator.refcount(block) == 1 and not self.allocator.is_hashed(block)

    def _writes_need_copy(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Indices of blocks the next write would change but may not (shared or cached)."""
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_ids), self.blocks_for_tokens(seq.num_computed_tokens + num_tokens))
        return [
            i
            for i in range(first, last)
            if self.allocator.refcount(seq.block_ids[i]) > 1
            or self.allocator.is_hashed(seq.block_ids[i])
        ]

    def allocate_slots(
        self, seq: Sequence, num_new: int, lookahead: int = 0
    ) -> list[BlockCopy] | None:
        """Room for num_new + `lookahead` tokens, copying blocks seq does not own alone -> the
        copies, or None (nothing changed) if the pool is short.
        """
        num_tokens = num_new + lookahead
        copies = self._writes_need_copy(seq, num_tokens)
        need = (
            self.blocks_for_tokens(seq.num_computed_tokens + num_tokens)
            - len(seq.block_ids)
            + len(copies)
        )
        if not self.allocator.can_allocate(need):
            return None
        fresh = self.allocator.allocate(need)
        done = []
        for i in copies:
            src, dst = seq.block_ids[i], fresh.pop()
            done.append(BlockCopy(i, src, dst))
            seq.block_ids[i] = dst
            seq.mirror.stale(i)
            self.allocator.free([src])
        seq.block_ids.extend(fresh)
        return done

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past num_tokens (a rejected draft's): fresh and never cached."""
        keep = self.blocks_for_tokens(num_tokens)
        if len(seq.block_ids) <= keep:
            return
        tail = seq.block_ids[keep:]
        del seq.block_ids[keep:]
        seq.mirror.stale(keep)
        self.allocator.free(tail[::-1])

    def tokens_that_fit(self, seq: Sequence, num_new: int) -> int:
        """How many of num_new tokens the free blocks hold: a chunk shrinks before anyone is
        preempted.
        """
        copies = len(self._writes_need_copy(seq, num_new))
        have = len(seq.block_ids)
        blocks = have + self.allocator.num_available_blocks - copies
        return blocks * self.block_size - seq.num_computed_tokens

    def register_full_blocks(self, seq: Sequence, computed: int) -> None:
        """Offer seq's blocks that `computed` tokens (a step's confirmed end) fill to the prefix
        cache.
        """
        if not self.caching:
            return
        full = computed // self.block_size
        events = self.allocator.events is not None
        for i in range(seq.num_registered_blocks, full):
            # given back before its step was confirmed (drop_out_of_window)
            if seq.block_ids[i] < 0:
                continue
            if events:  # subscribers see each block's parent, tokens and adapter
                lora = seq.request.lora
                self.allocator.register(
                    seq.block_ids[i],
                    seq.block_hash(i, self.block_size),
                    seq.block_hash(i - 1, self.block_size) if i else None,
                    seq.token_ids[i * self.block_size : (i + 1) * self.block_size],
                    lora.event_id if lora is not None else None,
                )
            else:
                self.allocator.register(seq.block_ids[i], seq.block_hash(i, self.block_size))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def record_kv_events(self) -> None:
        """Keep the prefix cache's changes for KV-event subscribers from now on."""
        self.allocator.events = [("cleared",)]

    def take_kv_events(self) -> list[tuple]:
        """The prefix cache's changes since the last call (none unless recorded)."""
        a = self.allocator
        if not a.events:
            return []
        events, a.events = a.events, []
        return events

    def cached_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks of a prompt held in the pool or a tier (a hybrid's to its deepest
        snapshot).
        """
        n = 0
        for h in hashes:
            if self.allocator.lookup(h) is None and (self.tiers is None or not self.tiers.holds(h)):
                break
            n += 1
        if self.states is None:
            return n
        # a hybrid resumes only where the state after a block is kept, in its pool or a tier
        lane = self.tiers.states if self.tiers is not None else None
        while n and not (
            self.states.has(hashes[n - 1]) or (lane is not None and lane.holds(hashes[n - 1]))
        ):
            n -= 1
        return n

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, the tiers' too -> how many."""
        if self.states is not None:
            self.states.clear()
        return self.allocator.reset_prefix_cache() + (
            self.tiers.clear() if self.tiers is not None else 0
        )

    def out_of_window(self, seq: Sequence, start: int) -> int:
        """How many of seq's leading blocks no query from position `start` on reads (see below)."""
        if not self.kv_window or seq.request.sampling.is_penalized:
            return 0
        return max(start - self.kv_window, 0) // self.block_size

    def drop_out_of_window(self, seq: Sequence, start: int) -> None:
        """Give back blocks no query from `start` on reads (all sliding); penalties keep all."""
        end = self.out_of_window(seq, start)
        if end <= seq.num_dropped_blocks:
            return
        first = seq.num_dropped_blocks
        dropped = [b for b in seq.block_ids[first:end] if b >= 0]
        for i in range(first, end):
            seq.dropped_ids.append(seq.block_ids[i])
            seq.block_ids[i] = -1
        seq.mirror.stale(first)
        seq.num_dropped_blocks = end
        self.allocator.free(dropped[::-1])

    @staticmethod
    def disown(seq: Sequence) -> None:
        """seq comes from a lost replica's pool: its table starts empty here, to be recomputed."""
        seq.block_ids = []
        seq.state_slot = -1
        seq.state_trail = None
        seq.mirror.stale()
        seq.dropped_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_dropped_blocks = 0
        seq.epoch += 1

    def free(self, seq: Sequence) -> None:
        """Give back every block, last first, so the LRU evicts a chain from its leaf."""
        if seq.block_ids:
            self.allocator.free([b for b in reversed(seq.block_ids) if b >= 0])
        if seq.dropped_ids and self.caching:
            # dropped blocks become the LRU's newest, root last, so the chain is evicted from its
            # leaf
            for i in range(len(seq.dropped_ids) - 1, -1, -1):
                if seq.dropped_ids[i] >= 0:
                    self.allocator.touch(seq.dropped_ids[i], seq.block_hash(i, self.block_size))
        if self.states is not None:
            self.states.give_back(seq)
        self.disown(seq)  # the table empties; nothing is left to give back

    @staticmethod
    def request_blocks(request: Request) -> int:
        """Distinct blocks a request holds (samples share their prompt's blocks)."""
        return len({b for s in request.seqs for b in s.block_ids if b >= 0})

    def check_invariants(self, running: list[Sequence], waiting) -> None:
        """Every block in exactly one state, refcounts equal owners, tables cover tokens."""
        self.allocator.check_invariants()
        owned: dict[int, int] = {}
        for b in self.tiers.held_blocks() if self.tiers is not None else ():  # loads in flight
            owned[b] = owned.get(b, 0) + 1
        for seq in running:
            for b in seq.block_ids:
                if b >= 0:
                    owned[b] = owned.get(b, 0) + 1
            if len(seq.block_ids) < self.blocks_for_tokens(seq.num_computed_tokens):
                raise AssertionError(f"{seq} holds too few blocks for its computed tokens")
            if any(b < 0 for b in seq.block_ids[seq.num_dropped_blocks :]) or any(
                b >= 0 for b in seq.block_ids[: seq.num_dropped_blocks]
            ):
                raise AssertionError(
                    f"{seq}: given-back blocks are not exactly its first {seq.num_dropped_blocks}"
                )
        for seq in waiting:
            if seq.block_ids or seq.num_computed_tokens:
                raise AssertionError(f"waiting {seq} holds blocks")
        if self.states is not None:
            self.states.check(running)
        for b in range(self.num_blocks):
            if owned.get(b, 0) != self.allocator.refcount(b):
                raise AssertionError(
                    f"block {b}: refcount {self.allocator.refcount(b)}, owners {owned.get(b, 0)}"
                )
