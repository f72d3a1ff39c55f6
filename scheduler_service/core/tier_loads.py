"""A prompt's prefix read back from the KV tiers: which blocks (and a hybrid's snapshot) are worth
loading, planned and settled. A hybrid resumes only where a snapshot follows its blocks.
"""

from __future__ import annotations

from scheduler_service.core.block_allocator import BlockAllocator
from scheduler_service.core.kv_tiers import KvTiers, Load
from scheduler_service.core.sequence import Sequence
from scheduler_service.core.state_slots import StateSlots


def snapshot_point(
    hashes: list[bytes], run: int, states: StateSlots, tiers: KvTiers
) -> tuple[int, tuple[bytes, int, int] | None]:
    """The deepest n <= run with a snapshot after block n, and the tier entry holding it (None:
    pool).
    """
    for n in range(run, 0, -1):
        h = hashes[n - 1]
        if states.has(h):
            return n, None
        held = tiers.states.find([h]) if tiers.states is not None else []
        if held:
            return n, held[0]
    return 0, None


def plan_loads(
    allocator: BlockAllocator,
    tiers: KvTiers,
    states: StateSlots | None,
    seq: Sequence,
    hits: list[int],
    step_id: int,
) -> bool:
    # one function: what is found, cut, afforded and held before the loads start is one decision
    """Plan loads past the cached prefix where reading beats computing; True if seq must wait."""
    if tiers.is_loading(seq.seq_id):
        return True
    bs = allocator.block_size
    hashes = [seq.block_hash(i, bs) for i in range(len(hits), (seq.num_tokens - 1) // bs)]
    if not hashes or tiers.wait_for(seq.seq_id, hashes[0]):
        return bool(hashes)
    pooled = []  # a hybrid's blocks the pool holds past its snapshot
    while states is not None and len(pooled) < len(hashes):
        block = allocator.lookup(hashes[len(pooled)])
        if block is None:
            break
        pooled.append(block)
    held = hits + pooled
    revived = sum(1 for b in held if allocator.is_cached_free(b))
    # a block left for what is computed
    room = allocator.num_available_blocks - revived - 1
    found = tiers.find(hashes[len(pooled) :])[: max(room, 0)]
    snapshot, tokens = None, None
    if states is not None:
        n, snapshot = snapshot_point(hashes, len(pooled) + len(found), states, tiers)
        found, tokens = found[: max(n - len(pooled), 0)], n * bs
        if not n or (snapshot is None and not found):
            return False
        if snapshot is not None and tiers.wait_for(seq.seq_id, snapshot[0], state=True):
            return True
    if not found and snapshot is None:
        return False
    request_id = seq.request.request_id
    if not tiers.worth_loading(found, request_id, snapshot[1] if snapshot else 0, tokens):
        return False
    slot = states.reserve() if snapshot is not None else None
    if snapshot is not None and slot is None:
        return False  # every state slot is held: computed instead
    tiers.touch(found)  # blocks this allocation evicts to the host tier do not push these out
    if snapshot is not None:
        tiers.states.touch([snapshot])
    # nor are the pool's blocks of the prefix evicted for the fresh ones
    allocator.share(held)
    blocks = allocator.allocate(len(found))
    allocator.free(held[::-1])
    # (a tier smaller than the run loses its oldest)
    still = tiers.find([h for h, _, _ in found])
    keep = next(
        (i for i, (a, b) in enumerate(zip(found, still, strict=False)) if a != b), len(still)
    )
    if keep < len(found):
        if snapshot is not None:  # the snapshot follows every one of them
            keep = 0
            states.loaded(slot, snapshot[0], False)
            snapshot = None
        allocator.free(blocks[keep:][::-1])
        blocks, found = blocks[:keep], found[:keep]
        if not found:
            return False
    first, lora = len(held), seq.request.lora
    loads = [
        Load(
            b,
            h,
            tier,
            seq.block_hash(first + i - 1, bs) if first + i else None,
            seq.token_ids[(first + i) * bs : (first + i + 1) * bs],
            lora.event_id if lora is not None else None,
            tiers.epoch,
        )
        for i, (b, (h, tier, _)) in enumerate(zip(blocks, found, strict=True))
    ]
    slots = [host_slot for _, _, host_slot in found]
    if snapshot is not None:
        h, tier, host_slot = snapshot
        loads.append(Load(slot, h, tier, None, [], None, tiers.epoch, state=True))
        slots.append(host_slot)
    tiers.start(step_id, seq.seq_id, loads, slots)
    return True


def settle_loads(
    allocator: BlockAllocator,
    tiers: KvTiers,
    states: StateSlots | None,
    step_id: int,
    failed: set[int] | None,
) -> None:
    """Loaded blocks enter the prefix cache; loaded snapshots are kept."""
    done = tiers.settle(step_id, failed)
    for ld, ok in done:
        if ld.state:
            states.loaded(ld.block, ld.hash, ok)
        elif ok:
            allocator.register(ld.block, ld.hash, ld.parent, ld.tokens, ld.lora)
    allocator.free([ld.block for ld, _ in reversed(done) if not ld.state])
