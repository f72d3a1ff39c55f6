"""The numpy codec of the wire: StepPlan and StepResult arrays <-> little-endian bytes, in one place
(protos/wire.proto documents them). Decoding checks sizes only; values are the worker's business.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos import wire_pb2

I32 = np.dtype("<i4")
I64 = np.dtype("<i8")
U8 = np.dtype("u1")
U64 = np.dtype("<u8")
F32 = np.dtype("<f4")


def lora_identity(folder) -> str:
    """A PEFT folder's hash of config and weights, checked by both sides."""
    import hashlib
    from pathlib import Path

    h = hashlib.blake2b(digest_size=16)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        with open(Path(folder) / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


class CodecError(ValueError):
    """An array of a plan or result has the wrong number of bytes."""


@dataclass
class PlanArrays:
    """One step's plan as arrays: S sequences, T tokens, B blocks each, C copies."""

    step_id: int
    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int64 [T]; -1 writes nothing
    block_tables: np.ndarray  # int32 [S, B]; unused entries -1
    seq_lens: np.ndarray  # int32 [S]
    query_start_loc: np.ndarray  # int32 [S + 1]
    do_sample: np.ndarray  # bool [S]
    sample_index: np.ndarray  # int32 [S]
    temperature: np.ndarray  # float32 [S]
    top_p: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int32 [S]; 0 = off
    seed: np.ndarray  # uint64 [S]
    block_copies: np.ndarray  # int32 [C, 2] of (src, dst)
    prev_step_id: int = 0
    # int32 [T]: -1, or the row of step prev_step_id whose token goes here
    prev_rows: np.ndarray | None = None
    # Request controls; None when no row of the step uses them (see protos/wire.proto).
    repetition_penalty: np.ndarray | None = None  # float32 [S]
    presence_penalty: np.ndarray | None = None  # float32 [S]
    frequency_penalty: np.ndarray | None = None  # float32 [S]
    min_p: np.ndarray | None = None  # float32 [S]
    bias_offsets: np.ndarray | None = None  # int32 [S + 1]
    bias_token_ids: np.ndarray | None = None  # int32 [N]
    bias_values: np.ndarray | None = None  # float32 [N]
    logprobs: np.ndarray | None = None  # int32 [S]; -1 = none
    prompt_logprobs: np.ndarray | None = None  # int32 [S]; -1 = none
    prompt_logprob_counts: np.ndarray | None = None  # int32 [S]
    prompt_logprob_targets: np.ndarray | None = None  # int32 [sum counts]
    mask_rows: np.ndarray | None = None  # int32 [S]; -1 = unconstrained
    token_bitmask: np.ndarray | None = None  # int32 [M, W]
    # the bitmasks come in a StepMask once the step in flight's tokens are known
    mask_follows: bool = False
    # int32 [S]: drafted tokens at the end of each row (speculation)
    num_draft: np.ndarray | None = None
    # int32 [S]: 0, or what the row's hidden states give back (POOL_*)
    pooling: np.ndarray | None = None
    lora_index: np.ndarray | None = None  # int32 [S]: -1 (the base model) or an index into loras
    loras: list[tuple[str, str]] | None = None  # LoRA adapters the rows use: (identity, path)
    state_slots: np.ndarray | None = None  # int32 [S]: each row's recurrent-state slot (hybrids)
    state_copies: np.ndarray | None = None  # int32 [2C]: (src, dst) slots copied before the forward
    state_saves: np.ndarray | None = None  # int32 [3V]: (row, offset, dst) snapshots taken in it
    kv: TierOps | None = None  # the KV tiers' stores, loads and drops, run before the forward

    @classmethod
    def empty(cls, step_id: int) -> PlanArrays:
        """A step with no rows: it only moves blocks between the pool and the tiers."""
        i32, none = np.zeros(0, dtype=I32), np.zeros(0, dtype=F32)
        return cls(
            step_id,
            i32,
            i32,
            np.zeros(0, dtype=I64),
            np.zeros((0, 1), dtype=I32),
            i32,
            np.zeros(1, dtype=I32),
            np.zeros(0, dtype=bool),
            i32,
            none,
            none,
            i32,
            np.zeros(0, dtype=U64),
            np.zeros((0, 2), dtype=I32),
        )

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


HASH_BYTES = 16  # a block's chained hash (scheduler_service/core/block_allocator.py block_hash)
TIER_HOST, TIER_DISK = 1, 2


@dataclass
class TierOps:
    """One step's KV-tier work: stores, then loads, then disk deletions; `states` does the same for
    state snapshots.
    """

    stores: np.ndarray  # int32 [n, 3]
    loads: np.ndarray  # int32 [m, 3]
    hashes: list[bytes]  # n + m
    drops: list[bytes]
    states: TierOps | None = None

    @property
    def is_empty(self) -> bool:
        return not (len(self.stores) or len(self.loads) or self.drops) and (
            self.states is None or self.states.is_empty
        )

    @property
    def num_loads(self) -> int:
        """Loads a result's failures are numbered over: the blocks', then the snapshots'."""
        return len(self.loads) + (len(self.states.loads) if self.states is not None else 0)

    def fields(self, prefix: str) -> dict[str, bytes]:
        """As the plan's fields named prefix_stores, _loads, _hashes, _drops."""
        return {
            f"{prefix}_stores": self.stores.astype(I32, copy=False).tobytes(),
            f"{prefix}_loads": self.loads.astype(I32, copy=False).tobytes(),
            f"{prefix}_hashes": b"".join(self.hashes),
            f"{prefix}_drops": b"".join(self.drops),
        }

    @classmethod
    def none(cls) -> TierOps:
        rows = np.zeros((0, 3), dtype=I32)
        return cls(rows, rows, [], [])


def _hash_list(blob: bytes, count: int | None, what: str) -> list[bytes]:
    if len(blob) % HASH_BYTES or (count is not None and len(blob) != count * HASH_BYTES):
        many = count if count is not None else "a whole number"
        raise CodecError(f"{what}: {len(blob)} bytes is not {many} of {HASH_BYTES}-byte hashes")
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


def _tier_rows(blob: bytes, what: str) -> np.ndarray:
    if len(blob) % (3 * I32.itemsize):
        raise CodecError(f"{what} is not a whole number of (block, tier, slot) rows")
    return np.frombuffer(blob, dtype=I32).reshape(-1, 3)


def _tier_ops(msg: wire_pb2.StepPlan, prefix: str) -> TierOps | None:
    stores, loads, hashes, drops = (
        getattr(msg, f"{prefix}_{part}") for part in ("stores", "loads", "hashes", "drops")
    )
    if not (stores or loads or drops):
        return None
    stores, loads = _tier_rows(stores, f"{prefix}_stores"), _tier_rows(loads, f"{prefix}_loads")
    return TierOps(
        stores,
        loads,
        _hash_list(hashes, len(stores) + len(loads), f"{prefix}_hashes"),
        _hash_list(drops, None, f"{prefix}_drops"),
    )


def decode_tiers(msg: wire_pb2.StepPlan) -> TierOps | None:
    blocks, states = _tier_ops(msg, "kv"), _tier_ops(msg, "state")
    if states is not None:
        blocks = blocks or TierOps.none()
        blocks.states = states
    return blocks


# Optional per-step arrays: (field, dtype, rows), rows "S" (per sequence), "S+1" or "*" (ragged).
_OPTIONAL = (
    ("repetition_penalty", F32, "S"),
    ("presence_penalty", F32, "S"),
    ("frequency_penalty", F32, "S"),
    ("min_p", F32, "S"),
    ("bias_offsets", I32, "S+1"),
    ("bias_token_ids", I32, "*"),
    ("bias_values", F32, "*"),
    ("logprobs", I32, "S"),
    ("prompt_logprobs", I32, "S"),
    ("prompt_logprob_counts", I32, "S"),
    ("prompt_logprob_targets", I32, "*"),
    ("mask_rows", I32, "S"),
    ("num_draft", I32, "S"),
    ("pooling", I32, "S"),
    ("lora_index", I32, "S"),
    ("state_slots", I32, "S"),
    ("state_copies", I32, "*"),
    ("state_saves", I32, "*"),
)

# StepPlan.pooling: what a row's final hidden states give back
POOL_LAST, POOL_SUM, POOL_FIRST = 1, 2, 3


def array_bytes(a: np.ndarray | None, dtype: np.dtype) -> bytes:
    return b"" if a is None else np.ascontiguousarray(a, dtype=dtype).tobytes()


def encode_plan(p: PlanArrays) -> wire_pb2.StepPlan:
    b = array_bytes
    mask = p.token_bitmask
    return wire_pb2.StepPlan(
        step_id=p.step_id,
        num_seqs=p.num_seqs,
        num_tokens=p.num_tokens,
        token_ids=b(p.token_ids, I32),
        positions=b(p.positions, I32),
        slot_mapping=b(p.slot_mapping, I64),
        block_tables=b(p.block_tables, I32),
        max_blocks_per_seq=int(p.block_tables.shape[1]) if p.block_tables.ndim == 2 else 0,
        seq_lens=b(p.seq_lens, I32),
        query_start_loc=b(p.query_start_loc, I32),
        do_sample=b(p.do_sample, U8),
        sample_index=b(p.sample_index, I32),
        temperature=b(p.temperature, F32),
        top_p=b(p.top_p, F32),
        top_k=b(p.top_k, I32),
        seed=b(p.seed, U64),
        block_copies=b(p.block_copies, I32),
        prev_rows=b(p.prev_rows, I32) if p.prev_rows is not None else b"",
        prev_step_id=p.prev_step_id,
        token_bitmask=b(mask, I32),
        bitmask_words=int(mask.shape[1]) if mask is not None else 0,
        mask_follows=p.mask_follows,
        loras=[wire_pb2.LoraRef(identity=i, path=path) for i, path in p.loras or ()],
        **(p.kv.fields("kv") if p.kv is not None else {}),
        **(p.kv.states.fields("state") if p.kv is not None and p.kv.states is not None else {}),
        **{name: b(getattr(p, name), dtype) for name, dtype, _ in _OPTIONAL},
    )


def bytes_array(blob: bytes, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    if len(blob) != count * dtype.itemsize:
        raise CodecError(f"{what}: {len(blob)} bytes, expected {count} x {dtype.itemsize}")
    return np.frombuffer(blob, dtype=dtype)


def decode_plan(msg: wire_pb2.StepPlan) -> PlanArrays:
    """Read-only numpy views of the plan's bytes; raises CodecError when a size does not match."""
    s, t, mb = msg.num_seqs, msg.num_tokens, msg.max_blocks_per_seq
    if len(msg.block_copies) % (2 * I32.itemsize):
        raise CodecError("block_copies is not a whole number of (src, dst) pairs")
    extra = {}
    for name, dtype, rows in _OPTIONAL:
        blob = getattr(msg, name)
        if not blob and rows != "*":  # a ragged array may be empty while its offsets are not
            continue
        if rows == "*":
            if len(blob) % dtype.itemsize:
                raise CodecError(
                    f"{name}: {len(blob)} bytes is not a whole number of {dtype.itemsize}-byte "
                    "items"
                )
            extra[name] = np.frombuffer(blob, dtype=dtype)
        else:
            extra[name] = bytes_array(blob, dtype, s + (rows == "S+1"), name)
    if msg.token_bitmask:
        extra["token_bitmask"] = decode_mask(msg)
    return PlanArrays(
        step_id=msg.step_id,
        token_ids=bytes_array(msg.token_ids, I32, t, "token_ids"),
        positions=bytes_array(msg.positions, I32, t, "positions"),
        slot_mapping=bytes_array(msg.slot_mapping, I64, t, "slot_mapping"),
        block_tables=bytes_array(msg.block_tables, I32, s * mb, "block_tables").reshape(s, mb),
        seq_lens=bytes_array(msg.seq_lens, I32, s, "seq_lens"),
        query_start_loc=bytes_array(msg.query_start_loc, I32, s + 1, "query_start_loc"),
        do_sample=bytes_array(msg.do_sample, U8, s, "do_sample").astype(bool),
        sample_index=bytes_array(msg.sample_index, I32, s, "sample_index"),
        temperature=bytes_array(msg.temperature, F32, s, "temperature"),
        top_p=bytes_array(msg.top_p, F32, s, "top_p"),
        top_k=bytes_array(msg.top_k, I32, s, "top_k"),
        seed=bytes_array(msg.seed, U64, s, "seed"),
        block_copies=np.frombuffer(msg.block_copies, dtype=I32).reshape(-1, 2),
        prev_step_id=msg.prev_step_id,
        prev_rows=bytes_array(msg.prev_rows, I32, t, "prev_rows") if msg.prev_rows else None,
        mask_follows=msg.mask_follows,
        loras=[(r.identity, r.path) for r in msg.loras] or None,
        kv=decode_tiers(msg),
        **extra,
    )


def encode_mask(step_id: int, bitmask: np.ndarray) -> wire_pb2.StepMask:
    return wire_pb2.StepMask(
        step_id=step_id,
        token_bitmask=array_bytes(bitmask, I32),
        bitmask_words=int(bitmask.shape[1]),
    )


def decode_mask(msg: wire_pb2.StepMask) -> np.ndarray:
    """int32 [masks, words]; raises CodecError when the bytes are not whole rows."""
    words = msg.bitmask_words
    if words == 0 or len(msg.token_bitmask) % (words * I32.itemsize):
        raise CodecError("token_bitmask is not a whole number of bitmask_words-word rows")
    return np.frombuffer(msg.token_bitmask, dtype=I32).reshape(-1, words)


def resolve_tokens(p: PlanArrays, last_step_id: int, last_sampled: np.ndarray | None) -> np.ndarray:
    """Pending token ids filled from the worker's last step; CodecError where there is none."""
    if p.prev_rows is None:
        return p.token_ids
    at = np.flatnonzero(p.prev_rows >= 0)
    if at.size == 0:
        return p.token_ids
    if last_sampled is None or p.prev_step_id != last_step_id:
        raise CodecError(
            f"the plan needs tokens sampled in step {p.prev_step_id}, which this worker does "
            f"not have (its last completed step is {last_step_id})"
        )
    src = p.prev_rows[at]
    if (src >= last_sampled.shape[0]).any() or (last_sampled[src] < 0).any():
        raise CodecError(f"the plan refers to rows of step {p.prev_step_id} that sampled no token")
    tokens = p.token_ids.copy()
    tokens[at] = last_sampled[src]
    return tokens
