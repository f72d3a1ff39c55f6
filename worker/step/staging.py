"""What a step moves and times around its forward: arrays staged in one copy, pooled rows gathered,
its device time split, and the errors that leave the device unusable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protos.codec import POOL_FIRST, POOL_SUM, PlanArrays
from worker.model.llama import StepInputs
from worker.step.speculation import Drafts


def pool_hidden(hidden: torch.Tensor, p: PlanArrays) -> torch.Tensor | None:
    """The pooling rows' final hidden states, fp32 [rows, hidden]; None if none."""
    rows = np.flatnonzero(p.pooling > 0)
    if rows.size == 0:
        return None
    kinds = p.pooling[rows]
    starts = p.query_start_loc[rows].astype(np.int64)
    ends = p.query_start_loc[rows + 1].astype(np.int64)
    pick = np.where(kinds == POOL_FIRST, starts, ends - 1)
    out = hidden[torch.from_numpy(pick).to(hidden.device)].float()
    summing = np.flatnonzero(kinds == POOL_SUM)
    if summing.size:
        lens = ends[summing] - starts[summing]
        tokens = np.repeat(starts[summing] - np.cumsum(lens) + lens, lens) + np.arange(
            int(lens.sum())
        )
        owner = torch.from_numpy(np.repeat(summing, lens)).to(hidden.device)
        values = hidden[torch.from_numpy(tokens).to(hidden.device)].float()
        sums = torch.zeros_like(out).index_add_(0, owner, values)
        at = torch.from_numpy(summing).to(hidden.device)
        out[at] = sums[at]
    return out


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


class Staging:
    """A step's host arrays moved to the device in one copy from two pinned buffers used in turn."""

    ALIGN = 16  # every view starts 16-byte aligned, whatever the arrays before it

    def __init__(self, device: torch.device, pack: bool | None = None) -> None:
        self.device = device
        self.pack = device.type == "cuda" if pack is None else pack
        self._hosts: list[torch.Tensor | None] = [None, None]
        self._moved: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def put(self, arrays: list[tuple[np.ndarray, torch.dtype]]) -> list[torch.Tensor]:
        typed = [np.ascontiguousarray(a, dtype=_NUMPY[dtype]) for a, dtype in arrays]
        if not self.pack:
            return [torch.from_numpy(a if a.flags.writeable else a.copy()) for a in typed]
        offsets, total = [], 0
        for a in typed:
            offsets.append(total)
            total += -(-a.nbytes // self.ALIGN) * self.ALIGN
        self._turn ^= 1
        turn, cuda = self._turn, self.device.type == "cuda"
        if self._moved[turn] is not None:
            self._moved[turn].synchronize()  # this buffer's last transfer (two steps ago) has run
        buf = self._hosts[turn]
        if buf is None or buf.numel() < total:
            size = max(total, 2 * (0 if buf is None else buf.numel()), 1 << 16)
            buf = self._hosts[turn] = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        host = buf.numpy()
        for a, at in zip(typed, offsets, strict=True):
            host[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
        moved = buf[:total].to(self.device, non_blocking=True)
        if cuda:
            self._moved[turn] = torch.cuda.Event()
            self._moved[turn].record()
        return [
            moved[at : at + a.nbytes].view(dtype).view(a.shape)
            for a, at, (_, dtype) in zip(typed, offsets, arrays, strict=True)
        ]


def is_device_fatal(error: BaseException) -> bool:
    """A CUDA error that leaves the context unusable (every later call fails too)."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return "CUDA error" in text or "device-side assert" in text or "CUBLAS_STATUS" in text


class StepClock:
    """Forward and sampling times: CUDA events on the stream, or the host clock on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.events: dict[str, torch.cuda.Event] | None = {} if device.type == "cuda" else None

    def mark(self, name: str) -> None:
        if self.events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[name] = event

    def wait(self) -> None:
        if self.events:
            self.events["end"].synchronize()

    def done(self) -> bool:
        """Whether the step's tokens are on the host (always, on a CPU)."""
        return not self.events or self.events["end"].query()

    def split(self, host_forward: float, host_sample: float) -> tuple[float, float]:
        """(forward, sampling) seconds; call after wait()."""
        if not self.events:
            return host_forward, host_sample
        e = self.events
        forward = e["start"].elapsed_time(e["logits"]) / 1000
        return forward, e["logits"].elapsed_time(e["end"]) / 1000


@dataclass
class Staged:
    """A step's inputs on the device, where the forward reads them."""

    rows: np.ndarray  # the plan rows that sample
    # the plan row of each logits row: `rows`, a drafting row once per position
    logit_owner: np.ndarray
    graphed: bool  # a decode graph replays this step
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    last_rows: torch.Tensor  # the token row each logits row comes from
    step: StepInputs | None  # the eager forward's inputs (None when a graph replays)
    drafts: Drafts | None = None  # the rows that verify drafts (worker/step/speculation.py)


@dataclass
class InFlight:
    """A launched step whose tokens are being copied to `host_tokens`."""

    step_id: int
    do_sample: np.ndarray  # bool [S]
    # int64 [S] (then [S] accepted drafts when drafting), pinned on CUDA; -1: no sample
    host_tokens: torch.Tensor
    clock: StepClock
    logprobs: object
    prompt_logprobs: object
    depends_on: int  # the step whose tokens it read on the device, 0 if none
    time_prepare: float
    host_forward: float
    host_sample: float
    # float32 [pooling rows, hidden] on the device, when the plan pooled
    pooled: torch.Tensor | None = None
    kv: tuple = (None, 0.0)  # the KV tiers' loads that failed, and their seconds
