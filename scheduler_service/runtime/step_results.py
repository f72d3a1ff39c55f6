"""What a step loop reports and keeps of its steps: the sink's report, logprobs by sequence, where
the time went, a prompt's block hashes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from protos.result_codec import decode_logprobs
from scheduler_service.core.batch import SchedulerOutput, StepUpdate
from scheduler_service.core.block_allocator import block_hash
from scheduler_service.core.queues import Queues
from scheduler_service.core.sequence import FinishReason, Request
from scheduler_service.text.output import Delta, SampleOutput, TokenLogprob


@dataclass
class StepProfile:
    """Where the time of a replica's steps went, cumulative seconds."""

    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    schedule: float = 0.0
    build_plan: float = 0.0
    # plan sent -> result received (with overlap, includes time queued behind a step)
    round_trip: float = 0.0
    # the step loop blocked on a result: what the scheduler did not hide behind the workers
    wait: float = 0.0
    worker_prepare: float = 0.0
    worker_forward: float = 0.0
    worker_sample: float = 0.0
    process_output: float = 0.0
    masks: float = 0.0  # structured-output masks that followed their plans
    draft: float = 0.0  # making drafts (part of schedule)

    def add(self, flight: Flight, result, t_wait: float, t3: float, t4: float) -> None:
        """One applied step: t_wait when waiting began, t3 the result in, t4 applied."""
        out = flight.out
        self.steps += 1
        self.tokens += out.num_tokens
        self.prefill_tokens += out.num_prefill_tokens
        self.schedule += flight.t1 - flight.t0
        self.draft += out.draft_seconds
        self.build_plan += flight.t2 - flight.t1
        self.round_trip += t3 - flight.t2
        self.wait += t3 - t_wait
        self.worker_prepare += result.time_prepare
        self.worker_forward += result.time_forward
        self.worker_sample += result.time_sample
        self.process_output += t4 - t3

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.__dict__.items()}


def prompt_block_hashes(
    prompt: list[int], block_size: int, root: bytes | None = None
) -> list[bytes]:
    """Chained hashes of the prompt's reusable full blocks; root: a LoRA adapter's identity."""
    hashes: list[bytes] = []
    for i in range((len(prompt) - 1) // block_size):
        hashes.append(
            block_hash(
                hashes[-1] if hashes else root, prompt[i * block_size : (i + 1) * block_size]
            )
        )
    return hashes


def read_logprobs(out: SchedulerOutput, result) -> dict[int, TokenLogprob] | None:
    """Sampled logprobs by sequence id; prompt logprobs go to their requests; CodecError on
    mismatch.
    """
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
                by_seq[seq.seq_id] = TokenLogprob(
                    -1, chosen[n], list(zip(ids[at : at + kk], values[at : at + kk], strict=True))
                )
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
                top = list(
                    zip(ids[top_at : top_at + kk], values[top_at : top_at + kk], strict=True)
                )
                request.prompt_logprobs[j] = TokenLogprob(
                    request.prompt_token_ids[j], chosen[pos], top
                )
                pos += 1
                top_at += kk
    return by_seq


@dataclass
class StepReport:
    """One applied step for the sink: result, deltas, token gaps, round trip."""

    out: SchedulerOutput
    update: StepUpdate
    deltas: list[tuple[Request, Delta]]
    token_gaps: list[float]
    seconds: float


@dataclass
class Flight:
    """A step sent to the workers whose result has not been applied yet."""

    out: SchedulerOutput
    t0: float  # scheduling began
    t1: float  # plan building began
    t2: float  # sent
    limit: float  # seconds the workers have for it once they start it
    task: asyncio.Task | None = field(default=None, repr=False)
    # Set once the plan is on the socket; masks that follow go after.
    sent: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    masks_sent: bool = False


def apply_text(
    samples: dict[int, SampleOutput],
    sched: Queues,
    update: StepUpdate,
    logprobs: dict[int, TokenLogprob] | None,
) -> tuple[list[tuple[Request, Delta]], list[float]]:
    """Each new token through its sample's text, where a stop string ends it -> deltas, gaps."""
    now = time.monotonic()
    deltas, gaps, ended = [], [], []
    tokens = update.tokens
    for i, (seq, token) in enumerate(tokens):
        sample = samples.get(seq.seq_id)
        # (finished: by a stop string among this step's tokens)
        if sample is None or sample.finished:
            continue
        if seq.request.first_token_time is None:
            seq.request.first_token_time = now
        if seq.last_token_time is not None:
            gaps.append(now - seq.last_token_time)
        seq.last_token_time = now
        lp = logprobs.get(seq.seq_id) if logprobs else None
        if lp is not None:
            lp.token_id = token
        delta, reason = sample.add_token(token, lp)
        if reason is not None:
            if reason is not seq.finish_reason:  # a stop string: the text ends it
                sched.finish(seq, reason, drop=sum(1 for s, _ in tokens[i + 1 :] if s is seq))
            ended.append(seq)
        deltas.append((seq.request, delta))
    for seq in update.embedded:
        sample = samples.get(seq.seq_id)
        if sample is not None:
            delta = sample.last_delta(FinishReason.STOP)
            delta.embedding = seq.pooling.vector
            deltas.append((seq.request, delta))
            ended.append(seq)
    for seq in ended:
        samples.pop(seq.seq_id, None)
    return deltas, gaps
