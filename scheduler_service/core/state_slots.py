"""A hybrid model's recurrent-state slots, owned like blocks. A slot is free, held by a running
sequence, a snapshot (the state after a full block, keyed by its chained hash, LRU), loading (read
back from a tier) or a trail (a decode's latest snapshot, so a returning turn resumes after the
answer). The worker holds the bytes.
"""

from __future__ import annotations

from collections import OrderedDict

from scheduler_service.core.tier_lanes import Lane


class StateSlots:
    def __init__(self, num_slots: int, max_trails: int = 1) -> None:
        """max_trails: decode snapshots kept at once (each sequence's latest; the oldest goes)."""
        self.num_slots, self.max_trails = num_slots, max_trails
        self._free = list(range(num_slots - 1, -1, -1))
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        # slots the step being planned uses: not evicted before it is sent
        self._pinned: set[int] = set()
        self._deferred: list[int] = []
        # (snapshot, slot) copies the step being planned runs first: admissions that resume
        self.copies: list[tuple[int, int]] = []
        self._loading: set[int] = set()  # slots a tier's snapshot is read into
        self._trails: set[int] = set()  # decode snapshots taken, keyed at their step's result
        self._trail_keys: set[bytes] = set()  # and those kept, by hash
        self.tiers: Lane | None = None  # the KV tiers' snapshot lane: evictions and saves go down

    @property
    def num_free(self) -> int:
        """Slots a sequence may take now (free, or an unpinned snapshot to evict)."""
        return len(self._free) + len(self._snapshots) - len(self._pinned)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    @property
    def num_held(self) -> int:
        taken = len(self._free) + len(self._snapshots) + len(self._deferred)
        taken += len(self._loading) + len(self._trails)
        return self.num_slots - taken

    def new_step(self) -> None:
        """The last plan was sent: its pins go, its copies were taken."""
        self._pinned.clear()
        self._free.extend(self._deferred)
        self._deferred.clear()
        self.copies = []

    def _slot(self, trail: bool = False) -> int | None:
        """A free slot, else the oldest snapshot's; decodes' trails never crowd out prompts'
        snapshots.
        """
        if self._free and not trail:
            return self._free.pop()
        old = next(iter(self._snapshots.items()), None)
        if trail:
            old = next(((h, s) for h, s in self._snapshots.items() if h in self._trail_keys), None)
        if old is None or old[1] in self._pinned:
            return None
        h, slot = old
        del self._snapshots[h]
        self._trail_keys.discard(h)
        if self.tiers is not None:  # the host tier keeps it (stored before reuse)
            self.tiers.evicted(slot, h)
        return slot

    def admit(self, seq, h: bytes | None) -> bool:
        """seq takes a slot, resuming after block h (None: from 0); False if none is left."""
        need = 1 + (h is not None and self._snapshots[h] not in self._pinned)
        if self.num_free < need:
            return False
        src = self.resume(h) if h is not None else -1
        if seq.state_slot >= 0:
            raise AssertionError(f"{seq} already holds state slot {seq.state_slot}")
        seq.state_slot = self._slot()
        if src >= 0:
            self.copies.append((src, seq.state_slot))
        return True

    def give_back(self, seq) -> None:
        """seq's slot is free again; its latest decode snapshot goes down to the disk tier."""
        if seq.state_slot >= 0:
            self._free.append(seq.state_slot)
            seq.state_slot = -1
        h, seq.state_trail = seq.state_trail, None
        if h is not None and h in self._snapshots and self.tiers is not None:
            self.tiers.registered(self._snapshots[h], h)

    # --- snapshots -------------------------------------------------------------------------------
    def deepest(self, seq, hits: int, block_size: int) -> int:
        """How many cached blocks a resume can skip; seq snapshots where its prefix leaves
        another's.
        """
        for n in range(hits, 0, -1):
            if seq.block_hash(n - 1, block_size) in self._snapshots:
                break
        else:
            n = 0
        seq.state_branch = hits * block_size if hits > n else 0
        return n

    def resume(self, h: bytes) -> int:
        """The snapshot slot after block h, pinned for this step and made the LRU's newest."""
        self._snapshots.move_to_end(h)
        slot = self._snapshots[h]
        self._pinned.add(slot)
        return slot

    def save(self, h: bytes) -> int | None:
        """A slot for the state after block h, pinned this step; None if h has one or none free."""
        if h in self._snapshots:
            self._snapshots.move_to_end(h)
            return None
        slot = self._slot()
        if slot is not None:
            self._snapshots[h] = slot
            self._pinned.add(slot)
            if self.tiers is not None:  # the disk tier keeps it, written once this step took it
                self.tiers.registered(slot, h, later=True)
        return slot

    def save_later(self, seq) -> int | None:
        """A slot for a row-end snapshot keyed by `keep` once the step's result makes its block
        known.
        """
        kept = len(self._trail_keys) + len(self._trails) - (seq.state_trail in self._trail_keys)
        slot = self._slot(trail=kept >= self.max_trails)
        if slot is not None:
            self._trails.add(slot)
        return slot

    def keep(self, seq, slot: int, h: bytes | None) -> None:
        """Key a `save_later` snapshot as seq's latest (freed if h is None); a finished one goes to
        disk.
        """
        self._trails.discard(slot)
        if h is None or h in self._snapshots:
            self._free.append(slot)
            return
        before = seq.state_trail
        if before is not None and before in self._trail_keys:
            self._trail_keys.discard(before)
            old = self._snapshots.pop(before)
            (self._deferred if old in self._pinned else self._free).append(old)
        self._snapshots[h] = slot
        self._trail_keys.add(h)
        seq.state_trail = h
        if seq.state_slot < 0:  # finished or preempted while its step ran
            self.give_back(seq)

    def failed(self, saves: list[tuple[int, int, int]]) -> None:
        """A step failed: its snapshots hold nothing."""
        slots = {slot for _, _, slot in saves}
        for h in [h for h, slot in self._snapshots.items() if slot in slots]:
            del self._snapshots[h]
            self._trail_keys.discard(h)
        for slot in slots:
            self._trails.discard(slot)
            (self._deferred if slot in self._pinned else self._free).append(slot)

    def has(self, h: bytes) -> bool:
        return h in self._snapshots

    def reserve(self) -> int | None:
        """A slot to read a tier's snapshot into; None if none is left."""
        slot = self._slot() if self.num_free > 0 else None
        if slot is not None:
            self._loading.add(slot)
        return slot

    def loaded(self, slot: int, h: bytes, ok: bool) -> None:
        """A load is done: the snapshot kept if it loaded, else the slot freed."""
        self._loading.discard(slot)
        if ok and h not in self._snapshots:
            self._snapshots[h] = slot
        else:
            self._free.append(slot)

    @staticmethod
    def points(seq, start: int, num_new: int, block_size: int) -> list[int]:
        """Boundaries in this row where seq's state is snapshotted."""
        last = (seq.prompt_len - 1) // block_size * block_size
        end = start + num_new
        return sorted(p for p in {last, seq.state_branch} if p and start < p <= end)

    def clear(self) -> int:
        """Forget every snapshot (the prefix cache was flushed); how many."""
        n = len(self._snapshots)
        for slot in self._snapshots.values():
            (self._deferred if slot in self._pinned else self._free).append(slot)
        self._snapshots.clear()
        self._trail_keys.clear()
        self._pinned.clear()
        return n

    def check(self, holders) -> None:
        """Every slot is free, a snapshot or held by one sequence with blocks, never two."""
        held = [s.state_slot for s in holders if s.state_slot >= 0]
        snapshots = list(self._snapshots.values())
        parts = [held, self._free, snapshots, self._deferred, [*self._loading, *self._trails]]
        every = [slot for part in parts for slot in part]
        if len(set(every)) != len(every) or len(every) != self.num_slots:
            raise AssertionError(
                f"state slots: {len(held)} held, {len(self._free)} free, "
                f"{len(self._snapshots)} snapshots of {self.num_slots}"
            )
        if any(s.block_ids and s.state_slot < 0 for s in holders):
            raise AssertionError("a sequence with blocks holds no state slot")
