"""A hybrid model's recurrent-state slots, owned like blocks: a sequence takes one when it is given
its table and gives it back with its blocks (finish, preemption); the worker holds the bytes.
"""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, seq) -> None:
        if seq.state_slot >= 0:
            raise AssertionError(f"{seq} already holds state slot {seq.state_slot}")
        seq.state_slot = self._free.pop()

    def give_back(self, seq) -> None:
        if seq.state_slot >= 0:
            self._free.append(seq.state_slot)
            seq.state_slot = -1

    def check(self, holders) -> None:
        """Every slot is free or held by one sequence with blocks, never both."""
        held = [s.state_slot for s in holders if s.state_slot >= 0]
        free = set(self._free)
        if (
            len(set(held)) != len(held)
            or free & set(held)
            or len(free) + len(held) != self.num_slots
        ):
            raise AssertionError(
                f"state slots: {len(held)} held, {len(free)} free of {self.num_slots}"
            )
        if any(s.block_ids and s.state_slot < 0 for s in holders):
            raise AssertionError("a sequence with blocks holds no state slot")
