"""What a step loop reports and keeps of its steps: the report its sink gets, the logprobs read off a result
by sequence, where its steps' time went, and a prompt's block hashes (routing asks each loop's cache)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.codec import (
    decode_logprobs,
)
from scheduler_service.core.batch import SchedulerOutput, StepUpdate
from scheduler_service.core.block_allocator import block_hash
from scheduler_service.core.sequence import Request
from scheduler_service.text.output import Delta, TokenLogprob


@dataclass
class StepProfile:
    """Where the time of a replica's steps went, cumulative seconds."""

    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    schedule: float = 0.0
    build_plan: float = 0.0
    round_trip: float = 0.0  # plan sent -> result received (with overlap, includes time queued behind a step)
    wait: float = 0.0  # the step loop blocked on a result: what the scheduler did not hide behind the workers
    worker_prepare: float = 0.0
    worker_forward: float = 0.0
    worker_sample: float = 0.0
    process_output: float = 0.0
    masks: float = 0.0  # structured-output masks that followed their plans
    draft: float = 0.0  # making drafts (part of schedule)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def prompt_block_hashes(prompt: list[int], block_size: int, root: bytes | None = None) -> list[bytes]:
    """Chained hashes of the prompt's full blocks that prefix caching could reuse (never the last token);
    root: the first block's parent (a LoRA adapter's identity, as core/sequence.py chains them)."""
    hashes: list[bytes] = []
    for i in range((len(prompt) - 1) // block_size):
        hashes.append(block_hash(hashes[-1] if hashes else root, prompt[i * block_size:(i + 1) * block_size]))
    return hashes


def read_logprobs(out: SchedulerOutput, result) -> dict[int, TokenLogprob] | None:
    """The step result's logprobs: those of sampled tokens by sequence id; prompt logprobs are stored in
    their requests at once (positions recomputed after a preemption overwrite theirs with the same values).
    Raises CodecError when the arrays do not match what the plan asked for."""
    by_seq = None
    read = out.read
    if read.logprobs_k is not None:
        k = read.logprobs_k
        rows = np.flatnonzero(k >= 0)
        lp = decode_logprobs(result, "logprobs", rows.size, int(k[rows].sum()))
        if lp is not None:
            by_seq, at = {}, 0
            chosen, ids, values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_values.tolist()
            for n, row in enumerate(rows.tolist()):
                seq, kk = out.scheduled[row].seq, int(k[row])
                by_seq[seq.seq_id] = TokenLogprob(-1, chosen[n],
                                                  list(zip(ids[at:at + kk], values[at:at + kk], strict=True)))
                at += kk
    if read.prompt_logprobs is not None:
        k, counts = read.prompt_logprobs
        rows = np.flatnonzero(counts > 0)
        total = int(counts.sum())
        lp = decode_logprobs(result, "prompt_logprobs", total, int((counts[rows] * k[rows]).sum()))
        chosen, ids, values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_values.tolist()
        pos = top_at = 0
        for row in rows.tolist():
            item = out.scheduled[row]
            request, kk = item.seq.request, int(k[row])
            for j in range(item.start + 1, item.start + 1 + int(counts[row])):
                top = list(zip(ids[top_at:top_at + kk], values[top_at:top_at + kk], strict=True))
                request.prompt_logprobs[j] = TokenLogprob(request.prompt_token_ids[j], chosen[pos], top)
                pos += 1
                top_at += kk
    return by_seq


@dataclass
class StepReport:
    """One applied step, for the sink: the step as scheduled, what its result did, each sample's stream delta
    (request, delta) in order, the gaps between tokens of one sequence, and the plan's round trip."""

    out: SchedulerOutput
    update: StepUpdate
    deltas: list[tuple[Request, Delta]]
    token_gaps: list[float]
    seconds: float
