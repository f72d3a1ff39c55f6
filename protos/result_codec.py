"""The StepResult half of the wire codec: a step's sampled tokens, accepted drafts, logprobs, pooled
rows and failed tier loads <-> bytes (protos/wire.proto documents them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos import wire_pb2
from protos.codec import F32, I32, CodecError, array_bytes, bytes_array


@dataclass
class Logprobs:
    """Log-probabilities of a step's rows that asked, row order (protos/wire.proto StepResult)."""

    chosen: np.ndarray  # float32 [N]: the log-probability of each position's token
    top_ids: np.ndarray  # int32 [sum K]
    top_values: np.ndarray  # float32 [sum K]


_LOGPROB_FIELDS = {
    "logprobs": ("logprobs", "top_token_ids", "top_logprobs"),
    "prompt_logprobs": ("prompt_logprobs", "prompt_top_token_ids", "prompt_top_logprobs"),
}


def encode_result(
    step_id: int,
    sampled: np.ndarray,
    logprobs: Logprobs | None = None,
    prompt_logprobs: Logprobs | None = None,
    num_accepted: np.ndarray | None = None,
    pooled: np.ndarray | None = None,
    kv_load_failed: np.ndarray | None = None,
    **timings: float,
) -> wire_pb2.StepResult:
    """sampled int32 [S] (-1: no sample); num_accepted when drafting; pooled when pooling; failed
    tier loads.
    """
    msg = wire_pb2.StepResult(
        step_id=step_id,
        sampled_token_ids=np.ascontiguousarray(sampled, I32).tobytes(),
        num_accepted=array_bytes(num_accepted, I32),
        pooled=array_bytes(pooled, F32),
        kv_load_failed=array_bytes(kv_load_failed, I32),
        **timings,
    )
    for lp, (chosen, ids, values) in (
        (logprobs, _LOGPROB_FIELDS["logprobs"]),
        (prompt_logprobs, _LOGPROB_FIELDS["prompt_logprobs"]),
    ):
        if lp is not None:
            setattr(msg, chosen, array_bytes(lp.chosen, F32))
            setattr(msg, ids, array_bytes(lp.top_ids, I32))
            setattr(msg, values, array_bytes(lp.top_values, F32))
    return msg


def decode_logprobs(
    msg: wire_pb2.StepResult, which: str, positions: int, tops: int
) -> Logprobs | None:
    """`which`: "logprobs" or "prompt_logprobs", as the plan sized it, else CodecError."""
    if positions == 0:
        return None
    chosen, ids, values = _LOGPROB_FIELDS[which]
    return Logprobs(
        bytes_array(getattr(msg, chosen), F32, positions, chosen),
        bytes_array(getattr(msg, ids), I32, tops, ids),
        bytes_array(getattr(msg, values), F32, tops, values),
    )


def decode_result(msg: wire_pb2.StepResult, num_seqs: int) -> np.ndarray:
    """-> int32 [num_seqs] sampled token ids; raises CodecError when the count is wrong."""
    tokens = np.frombuffer(msg.sampled_token_ids, dtype=I32)
    if tokens.shape[0] != num_seqs:
        raise CodecError(
            f"step {msg.step_id}: {tokens.shape[0]} sampled tokens for {num_seqs} sequences"
        )
    return tokens


def decode_pooled(msg: wire_pb2.StepResult, rows: int, hidden: int) -> np.ndarray | None:
    """float32 [rows, hidden] of the pooled rows, None if none; CodecError on a size mismatch."""
    if rows == 0:
        return None
    return bytes_array(msg.pooled, F32, rows * hidden, "pooled").reshape(rows, hidden)


def decode_load_failed(msg: wire_pb2.StepResult, num_loads: int) -> set[int]:
    """The plan's tier loads that failed; CodecError for an index out of range."""
    if len(msg.kv_load_failed) % I32.itemsize:
        raise CodecError("kv_load_failed is not a whole number of int32")
    failed = set(np.frombuffer(msg.kv_load_failed, dtype=I32).tolist())
    if any(not 0 <= i < num_loads for i in failed):
        raise CodecError(f"kv_load_failed names a load outside the plan's {num_loads}")
    return failed


def decode_accepted(msg: wire_pb2.StepResult, num_seqs: int) -> np.ndarray | None:
    """-> int32 [num_seqs] drafted tokens accepted per row, or None when the result carries none."""
    if not msg.num_accepted:
        return None
    return bytes_array(msg.num_accepted, I32, num_seqs, "num_accepted")
