"""CUDA graphs of the decode step, one per batch-size bucket, replayed as one launch; steps that do
not fit run eagerly. On a CPU "replay" runs the static-buffer forward, so the fitting is tested.
"""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from worker.model.attention import AttentionBackend
from worker.model.kv_pool import KVPool
from worker.model.llama import LlamaModel, StepInputs

log = structlog.get_logger("worker.step.graphs")

BUCKETS = (
    1,
    2,
    4,
    8,
    16,
    24,
    32,
    48,
    64,
    96,
    128,
    160,
    192,
    224,
    256,
    320,
    384,
    448,
    512,
    640,
    768,
    896,
    1024,
)


def bucket_sizes(max_rows: int) -> list[int]:
    """Batch sizes captured up to max_rows, each once."""
    return sorted({b for b in BUCKETS if b < max_rows} | {max_rows})


class DecodeGraphs:
    """Decode steps replayed as CUDA graphs, padded to the smallest bucket and context tier."""

    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        attn: AttentionBackend,
        device: torch.device,
        max_rows: int,
        max_context: int | list[int],
    ) -> None:
        self.model, self.pool, self.attn, self.device = model, pool, attn, device
        if max_rows < 1:
            raise ValueError(f"decode graphs need at least one row, got {max_rows}")
        self.buckets = bucket_sizes(max_rows)
        self.contexts = sorted(set([max_context] if isinstance(max_context, int) else max_context))
        if not self.contexts or self.contexts[0] < 1:
            raise ValueError(f"decode graphs need a positive context, got {max_context}")
        self.max_context = self.contexts[-1]
        # block-table entries of the longest sequence
        self.width = -(-self.max_context // pool.block_size)
        top = self.buckets[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.token_ids = torch.zeros(top, **i64)
        self.positions = torch.zeros(top, **i64)
        self.slots = torch.full((top,), -1, **i64)
        self.tables = torch.zeros(top, self.width, **i32)
        self.seq_lens = torch.ones(top, **i32)
        self.qsl = torch.arange(top + 1, **i32)
        # One logits buffer for every bucket: per-bucket outputs would each hold [bucket, vocab] for
        # life.
        self.logits = torch.empty(top, model.config.vocab_size, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}  # (context tier, rows)
        self._pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def covers(self, q_lens: np.ndarray, seq_lens: np.ndarray) -> bool:
        """Whether a step with these query and sequence lengths can replay a graph."""
        return (
            0 < len(q_lens) <= self.buckets[-1]
            and bool((q_lens == 1).all())
            and int(seq_lens.max()) <= self.max_context
        )

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def tier(self, longest: int) -> int:
        return next(c for c in self.contexts if c >= longest)

    # --- capture ----------------------------------------------------------------------------------
    def _forward(self, rows: int, context: int) -> torch.Tensor:
        """Decode over the first `rows` static rows -> logits."""
        width = -(-context // self.pool.block_size)
        meta = self.attn.prepare(
            self.tables[:rows, :width],
            self.seq_lens[:rows],
            self.qsl[: rows + 1],
            self.pool.block_size,
            max_seq_len=context,
            max_q_len=1,
            host_q_lens=np.ones(rows, dtype=np.int64),
        )
        step = StepInputs(self.token_ids[:rows], self.positions[:rows], self.slots[:rows], meta)
        hidden = self.model(step, self.pool, self.attn)
        logits = self.logits[:rows]
        logits.copy_(self.model.compute_logits(hidden))
        return logits

    def capture_all(self) -> float:
        """Capture every (tier, bucket), largest first, on a side stream -> seconds; raises as
        capture does.
        """
        t0 = time.perf_counter()
        self._pad(0)
        with torch.inference_mode():
            stream = torch.cuda.Stream() if self.device.type == "cuda" else None
            for context in reversed(self.contexts):
                for rows in reversed(self.buckets):
                    if stream is None:
                        self.graphs[context, rows] = None
                        continue
                    stream.wait_stream(torch.cuda.current_stream())
                    # a first run off the capture: lazy initialization here
                    with torch.cuda.stream(stream):
                        self._forward(rows, context)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                        self._forward(rows, context)
                    self.graphs[context, rows] = graph
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        log.info(
            "decode_graphs_captured",
            buckets=self.buckets,
            contexts=self.contexts,
            seconds=round(seconds, 2),
        )
        return seconds

    # --- replay -----------------------------------------------------------------------------------
    def _pad(self, rows: int) -> None:
        """Rows from `rows` on: no K/V write, one key of block 0."""
        self.token_ids[rows:] = 0
        self.positions[rows:] = 0
        self.slots[rows:] = -1
        self.tables[rows:] = 0
        self.seq_lens[rows:] = 1

    def run(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        seq_lens: torch.Tensor,
        longest: int,
    ) -> torch.Tensor:
        """A covered decode step -> logits [rows, vocab]."""
        rows = token_ids.shape[0]
        bucket, context = self.bucket(rows), self.tier(longest)
        self.token_ids[:rows].copy_(token_ids)
        self.positions[:rows].copy_(positions)
        self.slots[:rows].copy_(slots)
        # a row's blocks past max_context keys are never read
        width = min(self.width, tables.shape[1])
        self.tables[:rows, :width].copy_(tables[:, :width])
        self.tables[:rows, width:] = 0
        self.seq_lens[:rows].copy_(seq_lens)
        if rows < bucket:
            self._pad(rows)
        graph = self.graphs[context, bucket]
        if graph is None:  # no CUDA: the same static-buffer forward, eagerly
            return self._forward(bucket, context)[:rows]
        graph.replay()
        return self.logits[:rows]
