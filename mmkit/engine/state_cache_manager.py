"""StateCacheManager: the per-request state slots of a hybrid decoder (the KV block manager's sibling).

A hybrid decoder keeps, besides its paged KV blocks, a fixed-size state per request
(mmkit/layers/state_spec.py). This manager owns which slot each running sequence holds: the
scheduler takes a slot when it hands a sequence to the runner (admission, or resumption after
a preemption) and gives it back when the sequence finishes, is aborted or is preempted
(preemption is by recompute: the state is rebuilt from token 0). There are `max_num_seqs`
slots, as many as sequences can run, so a slot is always free for an admitted sequence;
`allocate` on an empty free list is a clear error, never a shared slot.
"""

from __future__ import annotations


class StateCacheManager:
    def __init__(self, num_slots: int, bytes_per_slot: int) -> None:
        if num_slots < 1:
            raise ValueError(f"state cache: got {num_slots} slots; expected at least 1")
        self.num_slots = num_slots
        self.bytes_per_slot = bytes_per_slot
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._slots: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def slot_of(self, seq_id: int) -> int | None:
        return self._slots.get(seq_id)

    def allocate(self, seq_id: int) -> int:
        """The slot of `seq_id` (a new one unless it holds one already)."""
        slot = self._slots.get(seq_id)
        if slot is not None:
            return slot
        if not self._free:
            raise RuntimeError(f"state cache: all {self.num_slots} slots are held by running sequences; "
                               f"sequence {seq_id} cannot get one (the scheduler admits at most max_num_seqs)")
        slot = self._slots[seq_id] = self._free.pop()
        return slot

    def free(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def metrics(self) -> dict[str, int]:
        return {"state_slots_total": self.num_slots, "state_slots_free": self.num_free_slots,
                "state_bytes_per_request": self.bytes_per_slot}
