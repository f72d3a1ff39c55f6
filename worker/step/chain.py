"""The link from one step to the next on the device: the last step's tokens (the next plan may read
them before they are read back), the steps whose tokens must not be used, and their pinned buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from protos.codec import CodecError, PlanArrays


class TokenChain:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.last_step_id = 0
        self.tokens: torch.Tensor | None = None  # the last launched step's, on the device
        self.sampled_rows: np.ndarray | None = None  # which of its rows sampled (host)
        self.failed: list[int] = []  # recent steps whose tokens must not be used
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._flip = 0

    def link(self, step_id: int, tokens: torch.Tensor, do_sample: np.ndarray) -> None:
        self.last_step_id, self.tokens, self.sampled_rows = step_id, tokens, do_sample.copy()

    def fail(self, step_id: int) -> None:
        """A step's tokens are bad: steps reading them report that instead."""
        self.failed.append(step_id)
        del self.failed[:-8]
        if self.last_step_id == step_id:
            self.forget()

    def forget(self) -> None:
        self.tokens = self.sampled_rows = None

    @property
    def last_sampled(self) -> np.ndarray | None:
        """The last step's tokens on the host (-1: no sample); waits."""
        return None if self.tokens is None else self.tokens.cpu().numpy().astype(np.int32)

    def state(self) -> tuple:
        return self.last_step_id, self.tokens, self.sampled_rows

    def restore(self, state: tuple) -> None:
        self.last_step_id, self.tokens, self.sampled_rows = state

    def pending_rows(self, p: PlanArrays) -> bool:
        """Whether the plan reads the previous step's tokens, checked against its sampled rows."""
        if p.prev_rows is None or not (p.prev_rows >= 0).any():
            return False
        if (
            self.sampled_rows is None
            or p.prev_step_id != self.last_step_id
            or p.prev_step_id in self.failed
        ):
            raise CodecError(
                f"the plan needs tokens sampled in step {p.prev_step_id}, which this worker "
                f"does not have (its last completed step is {self.last_step_id})"
            )
        src = p.prev_rows[p.prev_rows >= 0]
        if (src >= self.sampled_rows.shape[0]).any() or not self.sampled_rows[src].all():
            raise CodecError(
                f"the plan refers to rows of step {p.prev_step_id} that sampled no token"
            )
        p.token_ids = np.where(p.prev_rows >= 0, 0, p.token_ids).astype(np.int32)
        return True

    def read(self, prev: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids with the previous step's tokens where prev >= 0, read on the device."""
        return torch.where(prev >= 0, self.tokens[prev.clamp(min=0)].clamp(min=0), token_ids)

    def host_buffer(self, n: int) -> torch.Tensor:
        """Pinned host memory for a step's tokens, two in turn."""
        self._flip ^= 1
        buf = self._buffers[self._flip]
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self._buffers[self._flip] = buf
        return buf[:n]
